#!/usr/bin/env bash
# Convergence A/B on two GPUs in one device call (issue 8): one GPU per arm, each run SIGTERMed after STOP_AT
# steps (a checkpoint is saved) and resumed to STEPS. recipe convergence_ab_h200 (nano30b_slice dims, pattern
# MEM*E, 32 experts) at SEQ tokens. Hard limit LIMIT_S; metrics and logs are copied to $OUT/convergence_<TAG>/
# even when the limit cuts a run; compare with scripts/compare_runs.py afterwards.
# Session 4 ran it with the defaults below and LIMIT_S=285: cut at step 1289/1365 (steps take 95 ms at seq
# 1024, each checkpoint save about 48 s). A full 2000-step pair needs LIMIT_S of about 420.
# Session 5 ran the A/B with LIMIT_S=475: both arms 2000 steps with a resume at ~1000 (468 s of wall time).
# The A-vs-A control without a resume and without checkpoints (about 300 s):
#     STOP_AT=0 EXTRA="checkpoint.interval=0 checkpoint.save_on_exit=false" BACKENDS="mamba_ssm mamba_ssm" TAG=ava
#     OUT=/tmp/o WHEELHOUSE=.gpu [BACKENDS="mamba_ssm mamba_ssm" TAG=ava] bash scripts/gpu_call_convergence.sh
# Session 9: RECIPE=convergence_ab_h200_2000_lowlr RESUME_EXTRA=checkpoint.save_on_exit=false (no checkpoint after
# the last step).
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
gpu_call_begin || exit 1
BACKENDS="${BACKENDS:-mamba_ssm helion}" TAG="${TAG:-ab}"
# The runs' checkpoints (~24 GB per arm) go to RAM (/dev/shm) when it has room for two: saving one to the
# disk took ~50 s in session 5. RUNS overrides the choice.
shm_free_gb=$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -n 1 | tr -d ' ')
if [ -z "${RUNS:-}" ]; then
    if [ "${shm_free_gb:-0}" -ge 64 ] 2>/dev/null; then RUNS=/dev/shm/convergence_runs; else RUNS=/tmp/convergence_runs; fi
fi
echo "run dirs in $RUNS (/dev/shm free: ${shm_free_gb:-?} GB)"
rm -rf "$RUNS"; mkdir -p "$RUNS"
OUT="$RUNS" GPUS="0 1" STOP_AT="${STOP_AT:-1000}" COMPARE=0 BACKENDS="$BACKENDS" RESUME_EXTRA="${RESUME_EXTRA:-}" LABELS="${LABELS:-}" \
    timeout --signal=TERM --kill-after=10 "${LIMIT_S:-420}" \
    bash scripts/convergence_ab.sh train.train_iters="${STEPS:-2000}" train.seq_length="${SEQ:-1024}" train.log_interval=100 \
    ${EXTRA:-}
echo "convergence_ab.sh rc $?"
for d in "$RUNS"/convergence_*/; do
    d="${d%/}"; arm="${d##*/convergence_}"
    mkdir -p "$OUT/convergence_$TAG/$arm"
    cp "$d/metrics.jsonl" "$d/config.yaml" "$OUT/convergence_$TAG/$arm/" 2>/dev/null
    wc -l "$d/metrics.jsonl" 2>/dev/null
done
cp -r "$RUNS/logs" "$OUT/convergence_$TAG/" 2>/dev/null
grep -h "checkpoint\]" "$RUNS"/logs/*.log | head; tail -n 2 "$RUNS"/logs/*part2.log
rm -rf "$RUNS"
