#!/usr/bin/env bash
# Session 6, call 4 (docs/GPU_RUNBOOK.md, "Session 6"). Two H200s (<= 8 min), two single-GPU tracks:
#   GPU 0: ssd_bwd_dx_v2's config search (its row-tile partials now compared by their sums, so row blocks below
#          the chunk are timed) -> bench_ssd_variants --variant v7 -> the mixer-op A/B with
#          NANO_HELION_SSD_BWD_VARIANT=v7 (per-kernel table)
#   GPU 1: with the defaults: nano30b_slice training-step A/B (mamba_ssm, helion, mamba_ssm) -> per-layer A/B and
#          the 52-layer projection
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s6d.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-470}"
gpu_call_begin || exit 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    stage_table track0_stages.tsv
    run_stage tune_dx_v2 140 python3 scripts/tune_kernels.py --kernels ssd_bwd_dx_v2 --shapes nano --budget-s 120
    run_stage ssd_v7 80 python3 scripts/bench_ssd_variants.py --shape nano --variant v7 --rounds 4 --iters 8
    run_stage ab_nano_v7 100 env NANO_HELION_SSD_BWD_VARIANT=v7 python3 scripts/bench_kernels.py --backend mamba_ssm \
        --compare helion --shape nano --rounds 4 --iters 8 --out "$OUT/v7"
    mkdir -p "$OUT/configs0" && cp -r kernels/configs/sm* "$OUT/configs0/"
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    stage_table track1_stages.tsv
    run_stage ab_step 190 python3 scripts/ab_step_time.py --backends mamba_ssm,helion,mamba_ssm --warmup 3 --blocks 4 \
        --block-steps 4 --discard 1 --profile-steps 2
    run_stage layers 120 python3 scripts/bench_layers.py --backends mamba_ssm,helion --rounds 3 --iters 4
}

finish_tracks 25
