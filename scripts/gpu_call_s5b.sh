#!/usr/bin/env bash
# Session 5, call 2 (docs/GPU_RUNBOOK.md, "Session 5"): the new defaults measured (SSD backward v4 = dbc v3 +
# dz_dstates v2, FastLauncher on, grouped-query SDPA attention). Two H200s (<= 9.5 min), two single-GPU tracks:
#   GPU 0: nano30b_slice training-step A/B (mamba_ssm, helion, mamba_ssm) -> per-layer A/B and the 52-layer
#          projection (includes the attention layer) -> attention layer alone with its kernel profile ->
#          chunk_cumsum config search with dt strided as the fused op passes it
#   GPU 1: GPU tests of the fused op at the Nano shape (vs mamba-ssm, FastLauncher bitwise) -> mixer-op A/B
#          (per-kernel table) -> RMSNorm + conv1d at the three shapes -> SSD forward A/B -> mixer A/B at TP=2
#          and at seqlen 4096 x batch 4
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s5b.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-545}"
gpu_call_begin || exit 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    stage_table track0_stages.tsv
    run_stage ab_step 190 python3 scripts/ab_step_time.py --backends mamba_ssm,helion,mamba_ssm --warmup 3 --blocks 4 \
        --block-steps 4 --discard 1 --profile-steps 2
    run_stage layers 120 python3 scripts/bench_layers.py --backends mamba_ssm,helion --rounds 3 --iters 4
    run_stage attention 70 python3 scripts/check_fast_modules_gpu.py --kinds attention --profile-top 20 --rounds 7
    run_stage tune_cumsum 130 python3 scripts/tune_kernels.py --kernels ssd_chunk_cumsum --shapes nano --budget-s 100 --from-scratch
    mkdir -p "$OUT/configs" && cp -r kernels/configs/sm* "$OUT/configs/"
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    stage_table track1_stages.tsv
    run_stage gpu_tests 90 python3 -m pytest -v -m gpu -rA --tb=short tests/test_mamba_split_helion.py
    run_stage ab_nano 100 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape nano --rounds 4 --iters 8
    run_stage norm_conv 110 python3 scripts/bench_norm_conv.py --rounds 5
    run_stage ssd_fwd 90 python3 scripts/bench_ssd_fwd.py --rounds 4 --iters 8
    run_stage ab_tp2 70 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape tp2 --rounds 3 --iters 8
    run_stage ab_l4096 70 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape l4096b4 --rounds 3 --iters 8
}

finish_tracks 25
