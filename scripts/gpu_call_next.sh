#!/usr/bin/env bash
# Session 5's first GPU call, prepared at the end of session 4 (docs/GPU_RUNBOOK.md, "Where session 4 stopped").
# Two H200s (<= 9.5 min), two single-GPU tracks:
#   GPU 0: ssd_bwd_dbc v3 (ssd_bwd_dc_dcb + ssd_bwd_db_v3: dCB through memory) -> its GPU test with a block
#          larger than the chunk -> config search for both kernels -> bench_ssd_variants --variant v3 (v1 vs v3
#          and the whole backward) -> chunk_cumsum searched with dt strided as in the fused op -> the mixer-op
#          A/B with v3 (NANO_HELION_SSD_BWD_VARIANT=v3, in $OUT/ab_v3)
#   GPU 1: searches cut by job limits in session 4 (ssd_chunk_scan, rmsnorm_fwd_v2) and the untuned
#          ssd_bwd_dz_dstates_v2 (1.10x v1 untuned in session 3) -> RMSNorm per-call timing and profile, on a GPU
#          whose neighbour is not running a training step -> the opt-in direct Triton launch (FastLauncher):
#          bitwise check and the same RMSNorm timing with it -> the v2 variants tuned, against v1
# Then the convergence pair is a call of its own: scripts/gpu_call_convergence.sh (LIMIT_S=420), and the A-vs-A
# pair another (BACKENDS="mamba_ssm mamba_ssm" TAG=ava).
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_next.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-540}"
gpu_call_begin || exit 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    stage_table track0_stages.tsv
    run_stage gpu_test_v3 90 python3 -m pytest -v -m gpu -rA --tb=short tests/test_ssd_helion_bwd.py -k block_larger
    run_stage tune_v3 170 python3 scripts/tune_kernels.py --kernels ssd_bwd_dc_dcb,ssd_bwd_db_v3 --shapes nano --budget-s 140
    mkdir -p "$OUT/configs" && cp -r kernels/configs/sm* "$OUT/configs/"
    run_stage ssd_v3 100 python3 scripts/bench_ssd_variants.py --shape nano --variant v3 --rounds 4 --iters 8
    # chunk_cumsum with dt read in place from zxBCdt, as the fused op passes it (session 4 tuned it contiguous)
    run_stage tune_cumsum 60 python3 scripts/tune_kernels.py --kernels ssd_chunk_cumsum --shapes nano --budget-s 40 --from-scratch
    cp -r kernels/configs/sm* "$OUT/configs/"
    mkdir -p "$OUT/ab_v3" && run_stage ab_nano_v3 100 env NANO_HELION_SSD_BWD_VARIANT=v3 OUT="$OUT/ab_v3" \
        python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape nano --rounds 4 --iters 8
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    stage_table track1_stages.tsv
    run_stage tune_rest 230 python3 scripts/tune_kernels.py --kernels ssd_chunk_scan,rmsnorm_fwd_v2,ssd_bwd_dz_dstates_v2 \
        --shapes nano --budget-s 180
    mkdir -p "$OUT/configs1" && cp -r kernels/configs/sm* "$OUT/configs1/"
    run_stage norm_profile 60 python3 scripts/bench_norm_conv.py --ops rmsnorm --shapes nano --rounds 5 --profile
    # the opt-in direct Triton launch (tuning.FastLauncher): bitwise check, then the same RMSNorm timing with it
    run_stage fast_launch_test 90 python3 -m pytest -v -m gpu -rA --tb=short tests/test_mamba_split_helion.py -k fast_launch
    mkdir -p "$OUT/fast_launch" && run_stage norm_profile_fast 60 env NANO_HELION_FAST_LAUNCH=1 OUT="$OUT/fast_launch" \
        python3 scripts/bench_norm_conv.py --ops rmsnorm --shapes nano --rounds 5 --profile
    run_stage ssd_v2 100 python3 scripts/bench_ssd_variants.py --shape nano --variant v2 --rounds 4 --iters 8
}

finish_tracks 25
