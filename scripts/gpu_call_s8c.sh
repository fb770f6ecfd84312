#!/usr/bin/env bash
# Session 8, call 3 (docs/GPU_RUNBOOK.md, "Session 8"): the session-8 defaults measured on ONE H200 with nothing else
# running on the host (kind nvidia-h200): per-call times of host-bound arms (mamba-ssm's mixer op and SSD forward) are
# only comparable there. Mixer op A/B + per-kernel device time -> whole SSD forward A/B -> per-layer A/B + 52-layer
# projection -> nano30b_slice step A/B -> the attention layer (target 11 ms).
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s8c.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-470}"
gpu_call_begin || exit 1
export CUDA_VISIBLE_DEVICES=0
stage_table track0_stages.tsv
run_stage ab_nano 140 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape nano --rounds 6 --iters 8
run_stage ssd_fwd 70 python3 scripts/bench_ssd_fwd.py --shapes nano --rounds 6 --iters 8
run_stage layers 110 python3 scripts/bench_layers.py --backends mamba_ssm,helion --rounds 3 --iters 4
run_stage ab_step 90 python3 scripts/ab_step_time.py --backends mamba_ssm,helion,mamba_ssm --warmup 3 --blocks 4 \
    --block-steps 4 --discard 1 --profile-steps 2
run_stage attention 50 python3 scripts/check_fast_modules_gpu.py --kinds attention --profile-top 20 --rounds 9
save_triton_autotune
cat "$OUT"/track0_stages.tsv
