#!/usr/bin/env bash
# The GPU measurements behind benchmarks/*.md, as named stages, on a host with CUDA GPUs:
#
#   bash scripts/gpu_suite.sh STAGE[+STAGE ...] [STAGE[+STAGE ...] ...]
#
# Arguments run one after the other; the stages of one argument joined by '+' run side by side on the same GPU(s)
# (e.g. `long+tests`: the host-bound long run leaves most of the GPU idle). Stages (each writes its JSON/markdown under
# $OUT and its log to $OUT/logs/STAGE.log):
#   tests        pytest -m gpu: every GPU test (kernels against mamba-ssm / causal-conv1d and the fp32 references)
#   equivalence  scripts/kernel_equivalence.py against the kernels in $REFERENCE_TREE (bitwise outputs and gradients)
#   trees        the mixer op's device time and per-call time with the kernels in $REFERENCE_TREE against those in
#                $CURRENT_TREE (default this tree) (scripts/ab_kernel_trees.py: bench_kernels processes alternated per
#                tree, $TREES_PROCESSES each, default 2; mamba-ssm in every process as the A-vs-A control; shape
#                $TREES_SHAPE, default nano)
#   kernels      the mixer op A/B (bench_kernels.py, A-vs-A control) at each shape of $KERNEL_SHAPES (default "nano";
#                e.g. "nano tp8") and the SSD forward (bench_ssd_fwd.py, Nano shape)
#   helion_next  the kernels stage's mixer op A/B and the kernel GPU tests again with the Helion wheel in
#                $HELION_NEXT_WHEEL (installed into ./site_helion_next, ahead of ./site on PYTHONPATH): results in
#                $OUT/helion_next, to set beside the kernels stage's (one Helion version per process)
#   host         host (CPU) cost per mixer op fwd+bwd of each backend: launch time, wall, device, launches and the top
#                host functions (scripts/profile_host.py at $HOST_SHAPES, default "nano tp2 nano_b2_l8192_docs8": packed
#                documents pass seq_idx, the same tensor every call and a new one per call, $HOST_SEQ_IDX, default
#                both); the helion kernels' first-call work
#                without and with the compile cache (scripts/bench_compile_cache.py, shapes nano and nano_tp8)
#   peer         the SSD forward against the fused peer kernel in $PEER_FILE at four shapes (bench_ssd_peer.py)
#   ssd_peers    the SSD op fwd+bwd beside the open peers: the Helion project's Mamba-2 SSD example (folder
#                $EXAMPLE_DIR) and flash-linear-attention's chunk_simple_gla (folder $FLA_DIR holding its fla package);
#                either or both; shapes $PEER_SHAPES (default nano) (bench_ssd_helion_example.py)
#   layers       per-layer A/B at Nano widths and the 52-layer projection (bench_layers.py)
#   step         nano30b_slice training-step A/B (ab_step_time.py; STEP_BLOCKS ABBA rounds, default 4)
#   loss_match   50-step loss match of torch, helion, mamba_ssm (backend_loss_match.py)
#   data         nano30b_slice on the 131k-BPE stdlib corpus with validation loss (training run)
#   hf           nano30b_slice exported to Hugging Face and checked against transformers (scripts/hf_check.py)
#   memory       memory planner against measured peak memory (scripts/plan_vs_measured.py)
#   fullsize     the 52-layer model (mbs 1 x 8192) forward+backward A/B (ab_step_time.py --fwd-bwd-only;
#                FULLSIZE_BLOCKS ABBA rounds of 5 steps, default 20; FULLSIZE_EXPERTS routed experts, default 32,
#                about 89 GiB: an 80 GB card takes 8, python -m nano_hybrid.plan gives the peak of others)
#   breakdown    device time per category of a nano30b_slice step (step_breakdown.py) and the step A/B of the
#                default LM head + optimizer against the plain ones (ab_step_time.py)
#   convergence  scripts/convergence_ab.sh with recipe $RECIPE (two GPUs: one arm each)
#   seeds        the seed study on one GPU (scripts/convergence_study.py): corpus from the installed packages (built
#                if missing), 3 seeds of mamba_ssm and helion and a 20,000-step helion run side by side, stopped
#                after $MINUTES (default 8) and resumed by the next call; report in $OUT/convergence_seeds/compare
#   long         the 20,000-step helion run on one GPU (scripts/convergence_study.py --arms none), stopped with
#                SIGTERM 20 s before $MINUTES (default: what is left of CALL_SECONDS, 585, since this script
#                started, setup included: a 10-minute call; SUITE_T0, epoch seconds, moves that start earlier) and
#                resumed by the next call, on the seeds stage's
#                corpus; no kernel tuning (committed configs); beside it the resume check (RESUME_CHECK, default 300,
#                0: none: the same settings with deterministic steps, stopped at that step and resumed, against an
#                unbroken run, both 400 steps further); report in $OUT/convergence_seeds/compare (long_run.json,
#                long_run.png, resume_check.png)
#   parity       single / single again / DP2 / TP2 / EP2 for 50 steps, losses checked against single (two GPUs)
#   grid         helion vs mamba_ssm on the grid of Mamba-2 layer shapes (scripts/bench_shape_grid.py --resume $GRID_ARGS:
#                a later call with the same measuring arguments, kernels and configs on the same $OUT keeps the shapes
#                already measured). On a fresh machine most of a shape's time is compiling: a first call with
#                "--warm-jobs 6" compiles the shapes in child processes (on one H100, 6 at a time, each about 2x
#                slower than alone: give it a call of its own), then "--warm-jobs 0" calls measure at 20-70 s a shape
#   tune         the grid's shapes (packed documents too) tuned for this GPU into $OUT/helion_configs
#                (scripts/tune_kernels.py --shapes grid --missing, TUNE_JOBS searches at once, default 12, for
#                TUNE_MINUTES, default 8); a pair already there is kept, so the next call goes on. TUNE_SHAPES and
#                TUNE_KERNELS (comma-separated) narrow it; TUNE_MISSING=0 searches every listed pair again, configs or
#                not: each search starts from the committed config (kernels/configs) and its neighbours, so it stores
#                nothing slower than that config, and it overwrites an earlier call's entry in $OUT/helion_configs. The grid after
#                tuning: GRID_ARGS="--kernels-helion autotune=true,cache_dir=$OUT/helion_configs"; to commit them:
#                scripts/tune_kernels.py --merge $OUT/helion_configs
#
# Environment: OUT (default runs/gpu_suite), WHEELHOUSE (offline wheel folders for scripts/gpu_setup.sh, ':' between
# folders, e.g. the GPU wheelhouse and wandb's; SKIP_SETUP=1 when the packages are installed), ARCHIVE (a .tgz written
# at the end: $OUT without checkpoints, data caches and files of 20 MB or more), BACKENDS (default "mamba_ssm,helion"
# for the A/B stages), REFERENCE_TREE (equivalence, trees), CURRENT_TREE / TREES_SHAPE / TREES_PROCESSES (trees),
# PEER_FILE (peer), RECIPE (convergence, default convergence_ab_h200_2000_lowlr), MINUTES, CALL_SECONDS, SUITE_T0 and LONG_STOPS (long:
# steps at which the run is stopped and resumed at once, e.g. "2000"), STEP_BLOCKS (step), FULLSIZE_BLOCKS /
# FULLSIZE_EXPERTS (fullsize), GRID_ARGS (grid), HOST_SHAPES (host), TUNE_SHAPES / TUNE_KERNELS / TUNE_MISSING / TUNE_JOBS / TUNE_MINUTES (tune),
# SEEDS_ARGS (seeds: extra convergence_study.py arguments, e.g. "--arms mamba_ssm,helion,helion_fp32", or "--arms none"
# for the long run alone), STAGE_TIMEOUT (seconds per stage, default 900). A failing stage leaves $OUT/STAGE.FAILED
# with its log's tail; later stages still run; the exit code is the number of failed stages. STAGE_TIMEOUT_<stage>
# (e.g. STAGE_TIMEOUT_tests=500) sets one stage's limit; CALL_LIMIT (whole seconds since SUITE_T0 that the whole call
# may take, e.g. a remote command's time limit: each stage is stopped, its 15 s kill delay included, ARCHIVE_MARGIN,
# default 25, seconds before it, so the archive is written; a stage with no time left is not started, rc 124; the
# long stage's run stops inside it); TESTS_ARGS (tests: the pytest paths, default "tests"),
# TESTS_WORKERS (tests: pytest-xdist workers on the GPU, default 8; 1, or xdist not installed: one process). The stages
# long, seeds and data need data/tokenizers/tekken_131k.json (scripts/prepare_tokenizer.py writes it where
# mistral-common is installed; copy it to the GPU host).
set -u
export SUITE_T0="${SUITE_T0:-$(date +%s)}"
cd "$(dirname "$0")/.."
REPO="$PWD"
OUT="${OUT:-runs/gpu_suite}"
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"
export OUT
BACKENDS="${BACKENDS:-mamba_ssm,helion}"
A="${BACKENDS%%,*}"
FAILED=0

if [ "$#" -eq 0 ]; then
    awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0" | sed 's/^# \{0,1\}//'  # the header comment
    exit 2
fi

for v in CALL_LIMIT ARCHIVE_MARGIN; do
    case "${!v:-0}" in ''|*[!0-9]*) echo "error: $v must be whole seconds, got '${!v}'" >&2; exit 2 ;; esac
done
KNOWN="tests equivalence trees kernels helion_next host peer ssd_peers layers step loss_match data hf memory fullsize breakdown convergence seeds long parity grid tune"
for group in "$@"; do
    IFS=+ read -ra members <<< "$group"
    [ "${#members[@]}" -gt 0 ] || { echo "error: empty stage group '$group'" >&2; exit 2; }
    for stage in "${members[@]}"; do
        case " $KNOWN " in
            *" $stage "*) ;;
            *) echo "error: unknown stage '$stage' (known: $KNOWN)" >&2; exit 2 ;;
        esac
        case "$stage" in  # the stages that tokenize with the 131k BPE: its file is made where mistral-common is installed
            long|seeds|data) [ -f data/tokenizers/tekken_131k.json ] || {
                echo "error: stage '$stage' needs data/tokenizers/tekken_131k.json (python scripts/prepare_tokenizer.py writes it; copy it to this host)" >&2
                exit 2; } ;;
        esac
    done
done

if [ "${SKIP_SETUP:-0}" != "1" ]; then
    STAGES=("$@")
    set --  # gpu_setup.sh reads its own arguments
    # shellcheck source=gpu_setup.sh
    if ! source scripts/gpu_setup.sh ${WHEELHOUSE:+"$WHEELHOUSE"} > "$OUT/logs/setup.log" 2>&1; then
        echo "error: GPU setup failed (see $OUT/logs/setup.log)" >&2; tail -n 20 "$OUT/logs/setup.log" >&2; exit 1
    fi
    set -- "${STAGES[@]}"
fi
export PYTHONPATH="${PYTHONPATH:-$REPO}" PYTHONUNBUFFERED=1
# mamba-ssm's Triton autotune results are cached with the compiled kernels: a warm cache skips minutes of tuning
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$REPO/.triton_cache}"
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv \
    > "$OUT/logs/nvidia_smi.csv" 2>&1
# GPUs as torch counts them; where python3 cannot import torch, as nvidia-smi lists them
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null) || NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
NGPU=${NGPU:-0}

need_gpus() {  # need_gpus N STAGE
    if [ "$NGPU" -lt "$1" ]; then echo "$2 needs $1 GPUs, this host has $NGPU"; return 1; fi
}

st_tests() {  # -v, --early-tracebacks: each test's result (and a failure's traceback) is in the log as it finishes, also
    # when the stage's time limit stops it
    # the GPU tests are compile-bound on the host: TESTS_WORKERS pytest-xdist workers (default 8) share the GPU
    local par=()
    if [ "${TESTS_WORKERS:-8}" -gt 1 ] && python3 -c "import xdist" 2>/dev/null; then
        par=(-n "${TESTS_WORKERS:-8}")
    fi
    # shellcheck disable=SC2086
    python3 -m pytest -v -m gpu -p no:cacheprovider --early-tracebacks "${par[@]}" ${TESTS_ARGS:-tests}
}
st_equivalence() {
    [ -n "${REFERENCE_TREE:-}" ] || { echo "equivalence needs REFERENCE_TREE (a folder holding the reference kernels/)"; return 2; }
    python3 scripts/kernel_equivalence.py --reference-tree "$REFERENCE_TREE" --out "$OUT"
}
st_trees() {
    [ -n "${REFERENCE_TREE:-}" ] || { echo "trees needs REFERENCE_TREE (a folder holding the reference kernels/)"; return 2; }
    local out="$OUT/ab_kernel_trees${CURRENT_TREE:+_$(basename "$CURRENT_TREE")}"  # one folder per compared tree
    python3 scripts/ab_kernel_trees.py --reference-tree "$REFERENCE_TREE" --current-tree "${CURRENT_TREE:-$REPO}" \
        --shape "${TREES_SHAPE:-nano}" --processes "${TREES_PROCESSES:-2}" --out "$out"
}
st_kernels() {  # the mixer op A/B at each of $KERNEL_SHAPES (default nano), then the SSD forward at nano
    local shape
    for shape in ${KERNEL_SHAPES:-nano}; do
        python3 scripts/bench_kernels.py --backend "$A" --compare "${BACKENDS#*,}" --shape "$shape" --rounds 6 \
            --iters 8 --out "$OUT" || return 1
    done
    python3 scripts/bench_ssd_fwd.py --shapes nano --rounds 6 --iters 8 --out "$OUT"
}
st_helion_next() {  # the mixer op A/B and the kernel GPU tests again with the Helion wheel $HELION_NEXT_WHEEL
    [ -n "${HELION_NEXT_WHEEL:-}" ] || { echo "helion_next needs HELION_NEXT_WHEEL (a helion wheel file)"; return 2; }
    local site="$REPO/site_helion_next" par=()
    rm -rf "$site" && python3 -m pip install -q --no-deps --no-index --target "$site" "$HELION_NEXT_WHEEL" || return 1
    python3 -c "import xdist" 2>/dev/null && par=(-n "${TESTS_WORKERS:-8}")
    (
        export PYTHONPATH="$site:$PYTHONPATH"
        python3 -c "import importlib.metadata as m; print('helion', m.version('helion'))" \
            && python3 scripts/bench_kernels.py --backend "$A" --compare "${BACKENDS#*,}" --shape nano --rounds 6 \
                --iters 8 --out "$OUT/helion_next" \
            && python3 -m pytest -v -m gpu -p no:cacheprovider "${par[@]}" tests/test_ssd_helion.py \
                tests/test_ssd_helion_bwd.py tests/test_mamba_split_helion.py tests/test_causal_conv1d.py \
                tests/test_rmsnorm_gated.py
    )
}
st_host() {
    local s
    for s in ${HOST_SHAPES:-nano tp2 nano_b2_l8192_docs8}; do
        python3 scripts/profile_host.py --backends "$BACKENDS" --shape "$s" --seq-idx "${HOST_SEQ_IDX:-both}" \
            --out "$OUT" || return
    done
    python3 scripts/bench_compile_cache.py --shapes nano,nano_tp8 --out "$OUT"
}
st_peer() {
    [ -n "${PEER_FILE:-}" ] || { echo "peer needs PEER_FILE (the fork's ssd_fused5.py)"; return 2; }
    python3 scripts/bench_ssd_peer.py --peer-file "$PEER_FILE" --out "$OUT"
}
st_ssd_peers() {
    [ -n "${EXAMPLE_DIR:-}${FLA_DIR:-}" ] || { echo "ssd_peers needs EXAMPLE_DIR and/or FLA_DIR (the peers' folders)"; return 2; }
    python3 scripts/bench_ssd_helion_example.py ${EXAMPLE_DIR:+--example-dir "$EXAMPLE_DIR"} \
        ${FLA_DIR:+--fla-dir "$FLA_DIR"} --shapes "${PEER_SHAPES:-nano}" --out "$OUT"
}
st_layers() { python3 scripts/bench_layers.py --backends "$BACKENDS" --out "$OUT"; }
st_step() {
    python3 scripts/ab_step_time.py --backends "$BACKENDS,$A" --warmup 3 --blocks "${STEP_BLOCKS:-4}" --block-steps 4 \
        --discard 1 --profile-steps 2 --out "$OUT"
}
st_loss_match() { python3 scripts/backend_loss_match.py --backends "torch,${BACKENDS},torch" --out "$OUT"; }
st_data() {
    python3 -m nano_hybrid.train recipe=nano30b_slice_h200 kernels.backend=helion train.train_iters=60 \
        train.eval_interval=20 train.eval_iters=4 run_dir="$OUT/data_nano30b_slice" checkpoint.interval=0 \
        checkpoint.save_on_exit=false
}
st_hf() { python3 scripts/hf_check.py | tee "$OUT/hf_check.jsonl"; }
st_memory() { python3 scripts/plan_vs_measured.py --out "$OUT"; }
st_fullsize() {
    python3 scripts/ab_step_time.py --backends "$BACKENDS,$A" --fwd-bwd-only --warmup 2 --blocks "${FULLSIZE_BLOCKS:-20}" \
        --block-steps 5 --discard 1 --profile-steps 0 --tag fwdbwd --out "$OUT" model=nano30b \
        model.num_moe_experts="${FULLSIZE_EXPERTS:-32}" train.micro_batch_size=1 train.global_batch_size=1 \
        train.seq_length=8192 train.memory_check=false
}
st_breakdown() {  # the defaults (chunked_compiled LM head + loss, fused AdamW) against megatron's plain head + foreach
    local plain=":model.lm_head_loss=plain:optim.fused=false"
    python3 scripts/step_breakdown.py --backends "$A$plain,helion,$A" --out "$OUT" && python3 scripts/ab_step_time.py \
        --backends "$A$plain,helion,helion$plain,$A$plain" --warmup 3 --blocks 6 --block-steps 4 --profile-steps 0 \
        --out "$OUT"
}
st_convergence() {
    need_gpus 2 convergence || return 1
    OUT="$OUT" RECIPE="${RECIPE:-convergence_ab_h200_2000_lowlr}" GPUS="0 1" STOP_AT=1000 \
        RESUME_EXTRA="checkpoint.save_on_exit=false" bash scripts/convergence_ab.sh
}
st_seeds() {  # one GPU; the same call resumes every run (same run dirs under $OUT/convergence_seeds)
    # the proxy shape's kernels without a committed config are tuned first, each in a child process with a time
    # limit (no training process then tunes on first use)
    python3 scripts/tune_kernels.py recipe=convergence_seeds_h200 --missing --budget-min "${TUNE_MINUTES:-3}" --jobs 8 \
        --out-root "$OUT/helion_configs" || echo "tune_kernels: some kernels were not tuned (first use tunes them)"
    # shellcheck disable=SC2086
    python3 scripts/convergence_study.py --out "$OUT/convergence_seeds" --minutes "${MINUTES:-8}" ${SEEDS_ARGS:-} \
        kernels.helion.cache_dir="$OUT/helion_configs"
}
st_long() {  # one GPU, alone; the same call resumes it (run dir under $OUT/convergence_seeds)
    local wandb=offline
    python3 -c "import wandb" 2>/dev/null || { wandb=disabled; echo "long: wandb is not installed, W&B is off"; }
    local left=$(( ${CALL_SECONDS:-585} - ($(date +%s) - SUITE_T0) ))
    [ -n "${CALL_LIMIT:-}" ] && left=$(( $(call_left) - 15 ))  # inside the stage's own limit
    local minutes="${MINUTES:-$(python3 -c "print(round(max(1.0, $left / 60), 2))")}"
    echo "long: --minutes $minutes"
    python3 scripts/convergence_study.py --out "$OUT/convergence_seeds" --arms none --long-iters 20000 \
        --resume-check "${RESUME_CHECK:-300}" --long-stops "${LONG_STOPS:-}" --minutes "$minutes" --save-margin 20 \
        --grace 30 --wandb "$wandb" kernels.helion.autotune=false
}

# parity: nano30b_slice widths, pattern MEM*E, seq 4096, global batch 4, identical initial weights in every layout
# (model.use_cpu_initialization=true), lr 2e-4 with 20 warm-up steps. Tolerances, fixed before the runs, relative
# loss difference per step against the single-GPU run: step 1 <= 2e-3 (same weights and batch, only bf16
# rounding), every step <= 2% (reduction-order noise), mean <= 0.5% (a missed or doubled reduction shifts the whole
# curve). The second single-GPU run is the A-vs-A control: reported, never failing.
st_grid() {
    # shellcheck disable=SC2086
    python3 scripts/bench_shape_grid.py --out "$OUT" --resume ${GRID_ARGS:-}
}
st_tune() {
    local only=()
    [ -n "${TUNE_KERNELS:-}" ] && only=(--kernels "$TUNE_KERNELS")
    local missing=(--missing)
    case "${TUNE_MISSING:-1}" in
        0) missing=() ;;
        1) ;;
        *) echo "TUNE_MISSING must be 0 or 1, got $TUNE_MISSING"; return 2 ;;
    esac
    python3 scripts/tune_kernels.py --shapes "${TUNE_SHAPES:-grid}" ${missing[@]+"${missing[@]}"} ${only[@]+"${only[@]}"} \
        --jobs "${TUNE_JOBS:-12}" --budget-min "${TUNE_MINUTES:-8}" --out-root "$OUT/helion_configs"
}

st_parity() {
    need_gpus 2 parity || return 1
    local steps=50 rc=0 name nproc
    local common=(model=nano30b_slice "model.hybrid_override_pattern=MEM*E" model.use_cpu_initialization=true
        kernels.backend="$A" data=default train.seq_length=4096 train.global_batch_size=4 train.train_iters=$steps
        train.precision=bf16 train.device=cuda optim=adamw_wsd optim.lr=2e-4 optim.min_lr=2e-5 optim.warmup_iters=20
        seed=1234 checkpoint.interval=0 checkpoint.save_on_exit=false checkpoint.load=none logger.wandb.mode=disabled)
    for spec in "single 1 parallel=single train.micro_batch_size=4" "single_b 1 parallel=single train.micro_batch_size=4" \
                "dp2 2 parallel=dp2 train.micro_batch_size=2" "tp2 2 parallel=tp2 model.lm_head_loss=plain train.micro_batch_size=4" \
                "ep2 2 parallel=ep2 train.micro_batch_size=2"; do
        read -r name nproc extra <<< "$spec"
        rm -rf "$OUT/parity_$name"
        if [ "$nproc" -eq 1 ]; then
            python3 -m nano_hybrid.train "${common[@]}" $extra run_dir="$OUT/parity_$name" || rc=1
        else
            torchrun --standalone --nproc-per-node "$nproc" -m nano_hybrid.train "${common[@]}" $extra \
                run_dir="$OUT/parity_$name" || rc=1
        fi
    done
    for name in single_b dp2 tp2 ep2; do
        python3 scripts/run_summary.py "$OUT/parity_$name" --ref "$OUT/parity_single" --steps $steps --rtol 0.02 \
            --rtol-first 2e-3 --mean-rtol 0.005 --label "$name vs single" --out "$OUT/parity_${name}_vs_single.json" \
            || { [ "$name" = single_b ] || rc=1; }
    done
    return $rc
}

call_left() {  # seconds left of CALL_LIMIT for the stages (the archive's margin kept)
    echo $(( CALL_LIMIT - ($(date +%s) - SUITE_T0) - ${ARCHIVE_MARGIN:-25} ))
}

run_stage() {  # run_stage STAGE: its time limit, log, row in stages.tsv and, when it fails, STAGE.FAILED; its exit code
    local stage=$1 t0 rc
    t0=$(date +%s)
    local limit_var="STAGE_TIMEOUT_$stage"
    local limit="${!limit_var:-${STAGE_TIMEOUT:-900}}"
    if [ -n "${CALL_LIMIT:-}" ]; then  # end in time to write the archive inside the call's limit (TERM, then KILL 15 s on)
        local left=$(( $(call_left) - 15 ))
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    if [ "$limit" -le 0 ]; then
        echo "not started: the call's limit (CALL_LIMIT=$CALL_LIMIT s since SUITE_T0) leaves no time" > "$OUT/logs/$stage.log"
        rc=124
    else
        timeout --signal=TERM --kill-after=15 "$limit" bash -c "st_$stage" > "$OUT/logs/$stage.log" 2>&1
        rc=$?
    fi
    printf '%s\t%s\t%s\n' "$stage" "$rc" "$(( $(date +%s) - t0 ))" >> "$OUT/stages.tsv"
    if [ "$rc" -ne 0 ]; then
        { echo "stage $stage failed: exit code $rc"; tail -n 150 "$OUT/logs/$stage.log"; } > "$OUT/$stage.FAILED"
    fi
    return "$rc"
}

export A BACKENDS NGPU
export -f need_gpus call_left $(declare -F | awk '$3 ~ /^st_/ {print $3}')
printf 'stage\trc\tseconds\n' > "$OUT/stages.tsv"
for group in "$@"; do
    echo "=== [$group] $(date -u +%H:%M:%S)"
    IFS=+ read -ra members <<< "$group"
    pids=()
    for stage in "${members[@]}"; do
        run_stage "$stage" &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}"
        rc=$?
        stage="${members[$i]}"
        echo "--- [$stage] rc $rc"
        tail -n 15 "$OUT/logs/$stage.log"
        if [ "$rc" -ne 0 ]; then
            FAILED=$((FAILED + 1))
            echo "[$stage] FAILED (rc $rc): $OUT/$stage.FAILED"
        fi
    done
done
cat "$OUT/stages.tsv"
if [ -n "${ARCHIVE:-}" ]; then  # one file to take home: $OUT without checkpoints, data caches and files of 20 MB or more
    case "$ARCHIVE" in /*) ;; *) ARCHIVE="$REPO/$ARCHIVE" ;; esac
    mkdir -p "$(dirname "$ARCHIVE")"
    (cd "$OUT" && find . -type f -size -20M -not -path '*/checkpoints/*' -not -path '*/data_cache/*' -print0 \
        | tar --null -czf "$ARCHIVE" -T -) && echo "archive: $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1))"
fi
exit "$FAILED"
