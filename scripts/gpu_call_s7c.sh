#!/usr/bin/env bash
# Session 7, call 3 (docs/GPU_RUNBOOK.md, "Session 7"): the new forward default v10 (ssd_chunk_cumsum_t with mamba-ssm's
# softplus on fast exp2/log, CB in bf16 between the bmm and chunk_scan) and the saved cumsum, end to end. Two H200s:
#   GPU 0: tune ssd_chunk_cumsum_t (its softplus changed) -> the SSD forward GPU tests (v10 default, v8/v9/v10 vs v1)
#          -> the fused op's GPU tests -> mixer op A/B + per-kernel profile -> whole SSD forward A/B
#   GPU 1: the 50-step model=tiny loss match -> per-layer A/B + 52-layer projection -> nano30b_slice step A/B
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s7c.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-470}"
gpu_call_begin || exit 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    stage_table track0_stages.tsv
    run_stage tune_cumsum_t 70 python3 scripts/tune_kernels.py --kernels ssd_chunk_cumsum_t --shapes nano --budget-s 45 --from-scratch
    mkdir -p "$OUT/configs0" && cp kernels/configs/sm90/ssd_chunk_cumsum_t.json "$OUT/configs0/" 2>/dev/null
    run_stage gpu_test_fwd 100 python3 -m pytest -v -s -m gpu -rA --tb=short tests/test_ssd_helion.py \
        -k "v8_v9_v10 or nano_vs_fp32"
    run_stage gpu_test_op 120 python3 -m pytest -v -m gpu -rA --tb=short tests/test_mamba_split_helion.py
    run_stage ab_nano 90 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape nano --rounds 4 --iters 8
    run_stage ssd_fwd 60 python3 scripts/bench_ssd_fwd.py --rounds 4 --iters 8
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    stage_table track1_stages.tsv
    run_stage loss_match 110 python3 scripts/backend_loss_match.py --backends torch,helion,mamba_ssm,torch --steps 50 --quiet
    run_stage layers 150 python3 scripts/bench_layers.py --backends mamba_ssm,helion --rounds 3 --iters 4
    run_stage ab_step 150 python3 scripts/ab_step_time.py --backends mamba_ssm,helion,mamba_ssm --warmup 3 --blocks 4 \
        --block-steps 4 --discard 1 --profile-steps 2
}

finish_tracks 14 40
