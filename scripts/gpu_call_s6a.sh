#!/usr/bin/env bash
# Session 6's first GPU call, prepared at the end of session 5 (docs/GPU_RUNBOOK.md, "Where session 5 stopped").
# Two H200s (<= 9.5 min), two single-GPU tracks:
#   GPU 0: the v4 defaults' GPU tests at the Nano shape (fused op vs mamba-ssm, FastLauncher bitwise, SSD backward)
#          -> the 50-step model=tiny loss match torch, helion, mamba_ssm, torch -> the first ssd_bwd_db_v3 search
#   GPU 1: SSD forward v5 (chunk cumsum inside chunk_state_passing): its GPU test -> its config search ->
#          bench_ssd_variants --variant v5 (against v1 and mamba-ssm) -> a chunk_cumsum search that can finish
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s6a.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-545}"
gpu_call_begin || exit 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    stage_table track0_stages.tsv
    run_stage gpu_tests 200 python3 -m pytest -v -m gpu -rA --tb=short tests/test_mamba_split_helion.py tests/test_ssd_helion_bwd.py
    run_stage loss_match 170 python3 scripts/backend_loss_match.py --backends torch,helion,mamba_ssm,torch --steps 50 --quiet
    run_stage tune_db_v3 140 python3 scripts/tune_kernels.py --kernels ssd_bwd_db_v3 --shapes nano --budget-s 100
    mkdir -p "$OUT/configs0" && cp -r kernels/configs/sm* "$OUT/configs0/"
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    stage_table track1_stages.tsv
    run_stage gpu_test_v5 90 python3 -m pytest -v -m gpu -rA --tb=short tests/test_ssd_helion.py -k v5
    run_stage tune_v5 140 python3 scripts/tune_kernels.py --kernels ssd_chunk_cumsum_state_passing --shapes nano --budget-s 100
    run_stage ssd_v5 100 python3 scripts/bench_ssd_variants.py --shape nano --variant v5 --rounds 4 --iters 8
    run_stage tune_cumsum 200 python3 scripts/tune_kernels.py --kernels ssd_chunk_cumsum --shapes nano --budget-s 150 --from-scratch
    mkdir -p "$OUT/configs1" && cp -r kernels/configs/sm* "$OUT/configs1/"
}

finish_tracks 25
