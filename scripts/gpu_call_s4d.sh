#!/usr/bin/env bash
# Session 4, call 4: convergence A/B with the session-4 kernels (issue 8), one GPU per backend, each run
# SIGTERMed after step 1000 (checkpoint saved) and resumed to step 2000. The slice that fits the ~6
# minutes of device time left: recipe convergence_ab_h200 (nano30b_slice dims, pattern MEM*E, 32 experts)
# at seq 1024 (session 2 ran it at seq 4096 for 800 steps). Hard limit LIMIT_S; metrics and logs are
# copied to $OUT even when the limit cuts a run (the comparison is made afterwards with compare_runs.py).
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s4d.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
gpu_call_begin || exit 1
RUNS=/tmp/s4_conv
rm -rf "$RUNS"; mkdir -p "$RUNS"
OUT="$RUNS" GPUS="0 1" STOP_AT=1000 COMPARE=0 timeout --signal=TERM --kill-after=10 "${LIMIT_S:-290}" \
    bash scripts/convergence_ab.sh train.train_iters=2000 train.seq_length=1024 train.log_interval=100
echo "convergence_ab.sh rc $?"
for be in mamba_ssm helion; do
    mkdir -p "$OUT/convergence_s4/$be"
    cp "$RUNS/convergence_$be/metrics.jsonl" "$RUNS/convergence_$be/config.yaml" "$OUT/convergence_s4/$be/" 2>/dev/null
    wc -l "$RUNS/convergence_$be/metrics.jsonl" 2>/dev/null
done
cp -r "$RUNS/logs" "$OUT/convergence_s4/" 2>/dev/null
grep -h "checkpoint\]" "$RUNS"/logs/*.log | head; tail -n 2 "$RUNS"/logs/*part2.log
