#!/usr/bin/env bash
# Session 8, call 1 (docs/GPU_RUNBOOK.md, "Session 8"): the backward with dL and the recomputed states in x's dtype
# (bf16), checked and measured; the forward's two kernels below mamba-ssm's (chunk cumsum in device time, the unfused
# state_passing) searched again. Two H200s:
#   GPU 0: the fused op's GPU tests (incl. the bf16-states accuracy test) -> mixer op A/B + per-kernel device time
#          -> per-layer A/B + 52-layer projection
#   GPU 1: searches (ssd_chunk_cumsum_t timed from CUDA-graph replays; ssd_state_passing with a pipelined chunk loop;
#          ssd_bwd_state_passing at its new dtypes) -> whole SSD forward A/B -> the 50-step model=tiny loss match
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s8a.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-480}"
gpu_call_begin || exit 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    stage_table track0_stages.tsv
    run_stage gpu_test_op 210 python3 -m pytest -v -s -m gpu -rA --tb=short tests/test_mamba_split_helion.py
    run_stage ab_nano 90 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape nano --rounds 4 --iters 8
    run_stage layers 150 python3 scripts/bench_layers.py --backends mamba_ssm,helion --rounds 3 --iters 4
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    stage_table track1_stages.tsv
    run_stage tune_cumsum_t 75 python3 scripts/tune_kernels.py --kernels ssd_chunk_cumsum_t --shapes nano --budget-s 50 --timer cudagraph
    run_stage tune_sp 150 python3 scripts/tune_kernels.py --kernels ssd_state_passing,ssd_bwd_state_passing --shapes nano --budget-s 100
    mkdir -p "$OUT/configs1" && cp kernels/configs/sm90/ssd_chunk_cumsum_t.json kernels/configs/sm90/ssd_state_passing.json \
        kernels/configs/sm90/ssd_bwd_state_passing.json "$OUT/configs1/" 2>/dev/null
    run_stage ssd_fwd 80 python3 scripts/bench_ssd_fwd.py --rounds 4 --iters 8
    run_stage loss_match 150 python3 scripts/backend_loss_match.py --backends torch,helion,mamba_ssm,torch --steps 50 --quiet
}

finish_tracks 20 30
