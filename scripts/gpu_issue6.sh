#!/usr/bin/env bash
# GPU bring-up (issue 6), ONE job on one H200, <= 9 minutes wall time in total:
#   0. setup      offline install from the wheelhouse into ./site (scripts/gpu_setup.sh)
#   1. kernels    scripts/bench_kernels.py --backend mamba_ssm [--compare helion, if that backend imports]
#   2. layers     scripts/bench_layers.py (per-layer fwd+bwd M / E / *, 52-layer estimate, Mamba layer per backend)
#   3. train      model=nano30b_slice kernels.backend=mamba_ssm, bf16, micro-batch 2 x seq 8192, real data
#                 (data=default: the stdlib corpus, prepared on the fly), up to 200 steps in the time left,
#                 metrics.jsonl (TRAIN_OVERRIDES come last, so they win)
#   4. summary    scripts/run_summary.py on the training run (steps, NaN check, step time, tokens/s, TFLOP/s, memory)
# A failing stage leaves <stage>.FAILED (exit code + the log's tail with the traceback) in $OUT and the
# later stages still run. Logs: $OUT/logs/<stage>.log; stage table: $OUT/gpu_issue6_stages.tsv.
#
#   OUT=benchmarks/results/h200 bash scripts/gpu_issue6.sh
# Env: OUT (default benchmarks/results/h200), TOTAL_S (time budget, default 540), WHEELHOUSE,
#      TRAIN_STEPS (default 200), TRAIN_OVERRIDES (extra Hydra overrides for stage 3), SKIP_SETUP=1,
#      STAGES (default "kernels layers train"; e.g. STAGES="kernels layers" then STAGES=train to split
#      the job into two shorter ones).
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-540}"
stage_table gpu_issue6_stages.tsv

STAGES="${STAGES:-kernels layers train}"
want() { case " $STAGES " in *" $1 "*) return 0;; *) return 1;; esac; }

# 0. setup -------------------------------------------------------------------------------------
gpu_stage_setup
[ "${SKIP_SETUP:-0}" != "1" ] && cat "$OUT/logs/setup.log"
export PYTHONPATH="${PYTHONPATH:-$REPO/site:$REPO}"
nvidia-smi --query-gpu=name,memory.used,memory.total,temperature.gpu,clocks.sm,power.draw --format=csv \
    > "$OUT/logs/nvidia-smi.csv" 2>&1 || true

# 1. kernels -----------------------------------------------------------------------------------
COMPARE=()
if python3 -c "from kernels.registry import get_backend; get_backend('helion')" > "$OUT/logs/helion_probe.log" 2>&1; then
    COMPARE=(--compare helion)
else
    echo "helion backend not usable here (see logs/helion_probe.log): mamba_ssm only"
fi
want kernels && run_stage kernels 180 python3 scripts/bench_kernels.py --backend mamba_ssm "${COMPARE[@]}" --shape nano --out "$OUT"

# 2. layers ------------------------------------------------------------------------------------
LAYER_BACKENDS=mamba_ssm
[ ${#COMPARE[@]} -gt 0 ] && LAYER_BACKENDS=mamba_ssm,helion
want layers && run_stage layers 150 python3 scripts/bench_layers.py --backends "$LAYER_BACKENDS" --out "$OUT"

# 3. train -------------------------------------------------------------------------------------
RUN_DIR="$OUT/train_nano30b_slice_mamba_ssm"
if want train; then
rm -rf "$RUN_DIR"
LEFT=$(remaining)
# stop cleanly 45 s before the hard timeout (the loop checks train.exit_after_minutes every step)
EXIT_MIN=$(python3 -c "print(round(max(($LEFT - 60) / 60.0, 0.5), 2))")
# shellcheck disable=SC2086
run_stage train $(( LEFT - 15 )) python3 -m nano_hybrid.train \
    model=nano30b_slice kernels.backend=mamba_ssm data=default \
    train.train_iters="${TRAIN_STEPS:-200}" train.micro_batch_size=2 train.global_batch_size=2 \
    train.seq_length=8192 train.precision=bf16 train.device=cuda train.log_interval=10 \
    train.exit_after_minutes="$EXIT_MIN" \
    checkpoint.interval=0 checkpoint.save_on_exit=false checkpoint.load=none \
    logger.wandb.mode=disabled run_dir="$RUN_DIR" ${TRAIN_OVERRIDES:-}

# 4. summary -----------------------------------------------------------------------------------
if [ -f "$RUN_DIR/metrics.jsonl" ]; then
    run_stage summary 30 python3 scripts/run_summary.py "$RUN_DIR" \
        --label "nano30b_slice mamba_ssm 1xGPU" --out "$OUT/train_nano30b_slice_mamba_ssm.json"
else
    echo "no metrics.jsonl from the training stage" | tee "$OUT/summary.FAILED"
fi
rm -rf "$RUN_DIR/checkpoints"
fi

echo "=== stages (rc, seconds):"; cat "$STAGE_TSV"
echo "total $(( $(date +%s) - START ))s; results in $OUT"
ls "$OUT"/*.FAILED 2>/dev/null && exit 1
exit 0
