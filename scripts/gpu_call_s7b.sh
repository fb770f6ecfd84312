#!/usr/bin/env bash
# Session 7, call 2 (docs/GPU_RUNBOOK.md, "Session 7"): the forward variants v8 (CB in bf16 between the bmm and
# chunk_scan), v9 (the cumsum on (heads, chunk) tiles), v10 (both) and the saved cumsum (the fused op's backward no
# longer recomputes it). Two H200s (<= 8 min):
#   GPU 0: GPU tests of v8/v9/v10 at the Nano shape -> tune ssd_chunk_cumsum_t and ssd_chunk_scan_cb16 ->
#          bench_ssd_variants v10 (with the tuned configs) -> mixer profile with v10
#   GPU 1: the fused op's GPU tests (saved cumsum) -> mixer op A/B + per-kernel profile with the defaults (v1 forward,
#          saved cumsum) -> the mixer op at TP=2
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s7b.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-480}"
gpu_call_begin || exit 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    stage_table track0_stages.tsv
    run_stage gpu_test_fwd 100 python3 -m pytest -v -s -m gpu -rA --tb=short tests/test_ssd_helion.py -k "v8_v9_v10"
    run_stage tune_cumsum_t 70 python3 scripts/tune_kernels.py --kernels ssd_chunk_cumsum_t --shapes nano --budget-s 45
    run_stage tune_scan_cb16 120 python3 scripts/tune_kernels.py --kernels ssd_chunk_scan_cb16 --shapes nano --budget-s 90
    mkdir -p "$OUT/configs0" && cp kernels/configs/sm90/ssd_chunk_cumsum_t.json kernels/configs/sm90/ssd_chunk_scan_cb16.json \
        "$OUT/configs0/" 2>/dev/null
    run_stage ssd_v10 70 python3 scripts/bench_ssd_variants.py --shape nano --variant v10 --rounds 4 --iters 8
    run_stage ab_nano_v10 90 env NANO_HELION_SSD_FWD_VARIANT=v10 python3 scripts/bench_kernels.py --backend mamba_ssm \
        --compare helion --shape nano --rounds 3 --iters 8
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    stage_table track1_stages.tsv
    run_stage gpu_test_op 150 python3 -m pytest -v -m gpu -rA --tb=short tests/test_mamba_split_helion.py
    run_stage ab_nano 100 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape nano --rounds 4 --iters 8
    run_stage ab_tp2 150 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape tp2 --rounds 3 --iters 8
}

finish_tracks 14 30
