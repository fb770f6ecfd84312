#!/usr/bin/env bash
# Session 6, call 3 (docs/GPU_RUNBOOK.md, "Session 6"). Two H200s (<= 9.5 min), two single-GPU tracks:
#   GPU 0: backward variant v7 (ssd_bwd_dx over row tiles): its GPU tests (block larger than the chunk; the whole
#          backward against mamba-ssm at the Nano shape with NANO_HELION_SSD_BWD_VARIANT=v7) -> its config search
#          -> bench_ssd_variants --variant v7 -> the SSD forward A/B with the new forward default (v6)
#   GPU 1: with the defaults (forward v6, backward v4): the attention layer -> the mixer-op A/B at the Nano shape
#          (per-kernel table), TP=2 and seqlen 4096 x batch 4
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s6c.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-545}"
gpu_call_begin || exit 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    stage_table track0_stages.tsv
    run_stage gpu_test_v7 150 env NANO_HELION_SSD_BWD_VARIANT=v7 python3 -m pytest -v -m gpu -rA --tb=short \
        tests/test_ssd_helion_bwd.py -k "ssd_bwd_dx_v2 or vs_mamba_ssm"
    run_stage tune_dx_v2 130 python3 scripts/tune_kernels.py --kernels ssd_bwd_dx_v2 --shapes nano --budget-s 110
    run_stage ssd_v7 90 python3 scripts/bench_ssd_variants.py --shape nano --variant v7 --rounds 4 --iters 8
    run_stage ssd_fwd 90 python3 scripts/bench_ssd_fwd.py --rounds 4 --iters 8
    mkdir -p "$OUT/configs0" && cp -r kernels/configs/sm* "$OUT/configs0/"
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    stage_table track1_stages.tsv
    run_stage attention 70 python3 scripts/check_fast_modules_gpu.py --kinds attention --rounds 9
    run_stage ab_nano 100 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape nano --rounds 4 --iters 8
    run_stage ab_tp2 70 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape tp2 --rounds 3 --iters 8
    run_stage ab_l4096 70 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape l4096b4 --rounds 3 --iters 8
}

finish_tracks 25
