#!/usr/bin/env bash
# Two H200s (issue 6): DP2, TP2 and EP2 runs of a small Nano slice for 50 steps, plus the single-GPU
# reference with the same global batch, seed and data; then scripts/run_summary.py checks each run's
# losses against the reference (JSON per layout in $OUT, exit 1 if any check fails).
#
#   OUT=benchmarks/results/h200 bash scripts/gpu_2gpu.sh          (about 4 minutes)
#
# Model: nano30b_slice dims (hidden 2688, Mamba 64x64, 32 experts top-6, GQA 32/2) with the 5-layer
# pattern MEM*E, seq 4096, global batch 4: single (mbs 4), dp2 (mbs 2/rank), tp2+SP (mbs 4), ep2
# (mbs 2/rank, 16 experts per rank), all bf16, kernels.backend=mamba_ssm, real data (data=default).
# Tolerances (per-step relative loss difference |loss - ref| / ref over steps 1..50):
#   dp2: the same initial weights as the reference (TP/EP rank 0 RNG streams), only the gradient
#        reduction order differs -> max 2% over 50 steps, 0.5% at step 1.
#   tp2, ep2: megatron initialises each TP/EP shard from its rank's RNG stream on GPU, so the
#        initial weights differ from the reference's -> step 1 within 1% (init loss ~ ln V for any
#        init at std 0.0173) and max 5% over 50 steps: a check of the training trajectory, not bitwise.
# Env: OUT, WHEELHOUSE, SKIP_SETUP=1, STEPS (default 50), EXTRA (extra Hydra overrides for every run).
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
STEPS="${STEPS:-50}"
gpu_stage_setup 2gpu_setup
export PYTHONPATH="${PYTHONPATH:-$REPO/site:$REPO}"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -lt 2 ]; then
    echo "gpu_2gpu.sh needs 2 GPUs, torch sees $NGPU" | tee "$OUT/parallel_2gpu.FAILED"; exit 1
fi

COMMON=(model=nano30b_slice "model.hybrid_override_pattern=MEM*E" kernels.backend=mamba_ssm data=default
        train.seq_length=4096 train.global_batch_size=4 train.train_iters="$STEPS" train.precision=bf16
        train.device=cuda optim.warmup_iters=5 seed=1234 checkpoint.interval=0 checkpoint.save_on_exit=false
        checkpoint.load=none logger.wandb.mode=disabled)
# shellcheck disable=SC2206
EXTRA_ARR=(${EXTRA:-})
FAILED=0

run() {  # run NAME NPROC OVERRIDES...
    local name="$1" nproc="$2"; shift 2
    local dir="$OUT/parallel_$name"
    rm -rf "$dir"
    echo "=== $name ($nproc GPU): $*"
    local t0; t0=$(date +%s)
    if [ "$nproc" -eq 1 ]; then
        timeout 150 python3 -m nano_hybrid.train "${COMMON[@]}" "$@" "${EXTRA_ARR[@]}" run_dir="$dir" \
            > "$OUT/logs/parallel_$name.log" 2>&1
    else
        timeout 150 torchrun --standalone --nproc-per-node "$nproc" -m nano_hybrid.train "${COMMON[@]}" "$@" \
            "${EXTRA_ARR[@]}" run_dir="$dir" > "$OUT/logs/parallel_$name.log" 2>&1
    fi
    local rc=$?
    echo "    rc $rc, $(( $(date +%s) - t0 ))s"; tail -n 4 "$OUT/logs/parallel_$name.log"
    if [ "$rc" -ne 0 ]; then
        { echo "run $name failed: exit code $rc"; tail -n 80 "$OUT/logs/parallel_$name.log"; } > "$OUT/parallel_$name.FAILED"
        FAILED=1
    fi
    rm -rf "$dir/checkpoints"
}

run single 1 parallel=single train.micro_batch_size=4
run dp2 2 parallel=dp2 train.micro_batch_size=2
run tp2 2 parallel=tp2 train.micro_batch_size=4
run ep2 2 parallel=ep2 train.micro_batch_size=2

check() {  # check NAME RTOL RTOL_FIRST
    local name="$1"
    if [ ! -f "$OUT/parallel_$name/metrics.jsonl" ] || [ ! -f "$OUT/parallel_single/metrics.jsonl" ]; then
        echo "$name: no metrics to compare" | tee -a "$OUT/parallel_$name.FAILED"; FAILED=1; return
    fi
    python3 scripts/run_summary.py "$OUT/parallel_$name" --ref "$OUT/parallel_single" --steps "$STEPS" \
        --rtol "$2" --rtol-first "$3" --label "$name vs single (global batch 4)" \
        --out "$OUT/parallel_${name}_vs_single.json" || FAILED=1
}
check dp2 0.02 0.005
check tp2 0.05 0.01
check ep2 0.05 0.01
echo "total $(( $(date +%s) - START ))s; results in $OUT/parallel_*_vs_single.json"
exit "$FAILED"
