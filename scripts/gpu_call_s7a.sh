#!/usr/bin/env bash
# Session 7, call 1 (docs/GPU_RUNBOOK.md, "Session 7"): the session-6 defaults (backward v7) measured on ONE H200 with
# nothing else running on the host (kind nvidia-h200; <= 8.5 min):
#   the attention layer (target 11 ms) -> per-layer A/B + 52-layer projection with v7 -> mixer op A/B at TP=2 and
#   seqlen 4096 x batch 4 with v7
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s7a.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-500}"
gpu_call_begin || exit 1
export CUDA_VISIBLE_DEVICES=0
stage_table track0_stages.tsv
run_stage attention 80 python3 scripts/check_fast_modules_gpu.py --kinds attention --profile-top 20 --rounds 9
run_stage layers 200 python3 scripts/bench_layers.py --backends mamba_ssm,helion --rounds 3 --iters 4
run_stage ab_tp2 70 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape tp2 --rounds 3 --iters 8
run_stage ab_l4096 70 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape l4096b4 --rounds 3 --iters 8
save_triton_autotune
cat "$OUT"/track0_stages.tsv
