#!/usr/bin/env bash
# Session 4, call 1 (docs/GPU_RUNBOOK.md, "Where session 4 stopped"; run as scripts/gpu_call_next.sh then). Two H200s (<= 9.5 min), two single-GPU tracks,
# then both GPUs:
#   GPU 0: SSD / fused-op GPU tests (checks tuning.fit_access_lists: the initial-states / seq_idx cases
#          failed in session 3) -> 50-step tiny loss match torch, helion, mamba_ssm, torch -> the 2-GPU
#          check's single-GPU reference run
#   GPU 1: config search starting from the committed winners and their neighbours (TMA indexing,
#          eviction policies, warps/stages +-1) for conv1d_bwd_v3, ssd_bwd_dx, ssd_bwd_dbc, ssd_chunk_scan
#          -> the single-GPU run again (A-vs-A control for the 2-GPU loss check)
#   both:  DP2 and EP2 against this call's single run
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s4a.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-555}"
PHASE2_S="${PHASE2_S:-150}"
gpu_call_begin || exit 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    TOTAL_S=$(( TOTAL_S - PHASE2_S ))
    stage_table track0_stages.tsv
    run_stage gpu_tests_ssd 100 python3 -m pytest -q -m gpu -rf --tb=short tests/test_ssd_helion.py \
        tests/test_ssd_helion_bwd.py tests/test_mamba_split_helion.py
    run_stage loss_match 150 python3 scripts/backend_loss_match.py --backends torch,helion,mamba_ssm,torch --steps 50 --quiet
    run_stage ref_single 90 env RUNS=single CHECKS= SKIP_SETUP=1 bash scripts/gpu_2gpu.sh
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    TOTAL_S=$(( TOTAL_S - PHASE2_S ))
    stage_table track1_stages.tsv
    run_stage tune 300 python3 scripts/tune_kernels.py --kernels conv1d_bwd_v3,ssd_bwd_dx,ssd_bwd_dbc,ssd_chunk_scan \
        --shapes nano --budget-s 250
    mkdir -p "$OUT/configs" && cp -r kernels/configs/sm* "$OUT/configs/"
    run_stage ref_single_b 90 env RUNS=single_b CHECKS= SKIP_SETUP=1 bash scripts/gpu_2gpu.sh
}

run_tracks
stage_table phase2_stages.tsv
run_stage parallel_dp2_ep2 150 env RUNS="dp2 ep2" CHECKS="dp2 ep2 single_b" SKIP_SETUP=1 bash scripts/gpu_2gpu.sh
save_triton_autotune
tail -n 20 "$OUT/logs/track0.out"; echo; tail -n 20 "$OUT/logs/track1.out"
cat "$OUT"/track*_stages.tsv "$OUT/phase2_stages.tsv"
