#!/usr/bin/env bash
# One H200 call (<= 9.5 min): GPU tests of the norm/conv kernels, config search for the kernels without
# committed configs, then the first side-by-side A/B of the tuned helion backend against mamba_ssm and a
# profile of the attention and MoE layers.
#   0. setup     offline install (scripts/gpu_setup.sh; WHEELHOUSE=.gpu when the wheels were carried)
#   1. tests     GPU pytest of test_rmsnorm_gated, test_causal_conv1d (vs mamba-ssm, causal-conv1d, fp32)
#   2. tune      scripts/tune_kernels.py for rmsnorm_fwd, conv1d_fwd/bwd and the v2 backward variants
#   3. ab        scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape nano
#   4. layers    scripts/check_fast_modules_gpu.py --skip-numerics --profile-top 25 (+ a cuDNN-first SDPA variant)
# mamba-ssm's Triton autotuning results are cached on disk (TRITON_CACHE_AUTOTUNING=1) under
# $TRITON_CACHE_DIR, and the *.autotune.json files are copied to $OUT/triton_autotune/ so a later call
# can start from them instead of re-benchmarking every config (1-2 min per shape).
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_tune_compare.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-560}"
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$REPO/.triton_cache}"
stage_table gpu_call_tune_compare_stages.tsv
gpu_stage_setup
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$OUT/logs/nvidia_smi.csv" 2>&1
run_stage tests 90 python3 -m pytest -q -m gpu -rf --tb=short tests/test_rmsnorm_gated.py tests/test_causal_conv1d.py
run_stage tune 200 python3 scripts/tune_kernels.py --kernels rmsnorm_fwd,conv1d_fwd,conv1d_bwd,ssd_bwd_dbc_v2,ssd_bwd_dz_dstates_v2 --shapes nano --budget-s 170
mkdir -p "$OUT/configs" && cp -r kernels/configs/sm* "$OUT/configs/" 2>/dev/null
run_stage ab 170 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape nano --rounds 4 --iters 8
run_stage layers 90 python3 scripts/check_fast_modules_gpu.py --skip-numerics --no-reference-timing --iters 8 --profile-top 25 --sdpa-backends 'cudnn_attention,flash_attention,efficient_attention'
save_triton_autotune
cat "$STAGE_TSV"
