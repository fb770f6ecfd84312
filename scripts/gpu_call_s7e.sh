#!/usr/bin/env bash
# Session 7, call 5 (docs/GPU_RUNBOOK.md, "Session 7"): the searches the forward's largest kernels had left, from their
# committed configs (neighbours + random; call 2's ssd_chunk_scan_cb16 search ended at candidate 62 of 70 on a sticky
# CUDA error), then the whole-forward A/B with whatever they wrote. Two H200s (<= 4.5 min):
#   GPU 0: search ssd_chunk_scan_cb16; GPU 1: search ssd_chunk_state_passing; then bench_ssd_fwd.py on GPU 0
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s7e.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-260}"
gpu_call_begin || exit 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    stage_table track0_stages.tsv
    run_stage tune_scan_cb16 150 python3 scripts/tune_kernels.py --kernels ssd_chunk_scan_cb16 --shapes nano --budget-s 120
    mkdir -p "$OUT/configs0" && cp kernels/configs/sm90/ssd_chunk_scan_cb16.json "$OUT/configs0/"
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    stage_table track1_stages.tsv
    run_stage tune_csp 150 python3 scripts/tune_kernels.py --kernels ssd_chunk_state_passing --shapes nano --budget-s 120
    mkdir -p "$OUT/configs1" && cp kernels/configs/sm90/ssd_chunk_state_passing.json "$OUT/configs1/"
}

finish_tracks 20 10
# after both searches (each may have written its config): the whole forward on GPU 0
export CUDA_VISIBLE_DEVICES=0
run_stage ssd_fwd 80 python3 scripts/bench_ssd_fwd.py --shapes nano --rounds 5 --iters 8
