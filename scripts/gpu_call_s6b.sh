#!/usr/bin/env bash
# Session 6, call 2 (docs/GPU_RUNBOOK.md, "Session 6"). Two H200s (<= 9.5 min), two single-GPU tracks:
#   GPU 0: SSD forward variant v6 (chunk cumsum and C.B^T in one launch): its Nano GPU test -> its config search ->
#          bench_ssd_variants --variant v6 (against v1 and mamba-ssm) -> the first ssd_chunk_scan_v2 search ->
#          bench_ssd_variants --variant v2 with it
#   GPU 1: the attention layer with grads set to None each step (as bench_layers.py) -> config searches of the
#          kernels still slower than mamba-ssm in device time or closest to it: ssd_bwd_state_passing,
#          ssd_bwd_dx, ssd_chunk_scan (from the committed configs)
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s6b.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-545}"
gpu_call_begin || exit 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    stage_table track0_stages.tsv
    run_stage gpu_test_v6 80 python3 -m pytest -v -m gpu -rA --tb=short tests/test_ssd_helion.py -k "variant_matches_v1 and v6"
    run_stage tune_v6 110 python3 scripts/tune_kernels.py --kernels ssd_bmm_chunk_cumsum --shapes nano --budget-s 90
    run_stage ssd_v6 70 python3 scripts/bench_ssd_variants.py --shape nano --variant v6 --rounds 5 --iters 10
    run_stage tune_scan_v2 140 python3 scripts/tune_kernels.py --kernels ssd_chunk_scan_v2 --shapes nano --budget-s 110
    run_stage ssd_v2 90 python3 scripts/bench_ssd_variants.py --shape nano --variant v2 --rounds 4 --iters 8
    mkdir -p "$OUT/configs0" && cp -r kernels/configs/sm* "$OUT/configs0/"
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    stage_table track1_stages.tsv
    run_stage attention 80 python3 scripts/check_fast_modules_gpu.py --kinds attention --profile-top 20 --rounds 9
    run_stage tune_bwd_sp 110 python3 scripts/tune_kernels.py --kernels ssd_bwd_state_passing --shapes nano --budget-s 90
    run_stage tune_bwd_dx 140 python3 scripts/tune_kernels.py --kernels ssd_bwd_dx --shapes nano --budget-s 120
    run_stage tune_scan 130 python3 scripts/tune_kernels.py --kernels ssd_chunk_scan --shapes nano --budget-s 110
    mkdir -p "$OUT/configs1" && cp -r kernels/configs/sm* "$OUT/configs1/"
}

finish_tracks 25
