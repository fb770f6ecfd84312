#!/usr/bin/env bash
# Session 9, call 3 (docs/GPU_RUNBOOK.md, "Session 9"), kind nvidia-h200 (ONE quiet GPU):
# 1. grad_match: gradients of torch (fp32 SSD reference), mamba_ssm, helion and mamba_ssm again at the SAME trained
#    weights (300 steps of the convergence recipe): calls 1-2 showed helion's loss 0.53% above mamba_ssm's at the end
#    of 2000 steps while two runs of one backend end 0.00-0.02% apart. A systematic gradient difference shows here.
# 2. The attention layer (target 11 ms) with --diag: round vs per-call timing, a profiled whole round, GPU clocks
#    and power during the timed rounds.
# 3. The 50-step model=tiny loss match and the nano30b_slice step A/B with the final (session 8) defaults.
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s9c.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-560}"
gpu_call_begin || exit 1
export CUDA_VISIBLE_DEVICES=0
stage_table track0_stages.tsv
run_stage grad_match 170 python3 scripts/grad_match.py --backends torch,mamba_ssm,helion,mamba_ssm \
    --train-backend mamba_ssm --train-steps 300 --batches 2 recipe=convergence_ab_h200_2000_lowlr
run_stage attention 80 python3 scripts/check_fast_modules_gpu.py --kinds attention --skip-numerics --diag \
    --no-reference-timing --profile-top 20 --rounds 9
run_stage loss_match 120 python3 scripts/backend_loss_match.py --backends torch,helion,mamba_ssm,torch --quiet
run_stage ab_step 170 python3 scripts/ab_step_time.py --backends mamba_ssm,helion,mamba_ssm --warmup 3 --blocks 4 \
    --block-steps 4 --discard 1 --profile-steps 2
save_triton_autotune
cat "$OUT"/track0_stages.tsv
