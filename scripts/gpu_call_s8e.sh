#!/usr/bin/env bash
# Session 8, call 5 (docs/GPU_RUNBOOK.md, "Session 8"), ONE quiet H200: the final session-8 defaults (backward states
# and dstates in bf16, zxbcdt read in place) in training: the 50-step model=tiny loss match, the nano30b_slice step A/B.
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s8e.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-195}"
gpu_call_begin || exit 1
export CUDA_VISIBLE_DEVICES=0
stage_table track0_stages.tsv
run_stage ab_step 85 python3 scripts/ab_step_time.py --backends mamba_ssm,helion,mamba_ssm --warmup 3 --blocks 4 \
    --block-steps 4 --discard 1 --profile-steps 2
run_stage loss_match 115 python3 scripts/backend_loss_match.py --backends torch,helion,mamba_ssm,torch --steps 50 --quiet
cat "$OUT"/track0_stages.tsv
