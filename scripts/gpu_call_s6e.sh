#!/usr/bin/env bash
# Session 6, call 5 (docs/GPU_RUNBOOK.md, "Session 6"): the new backward default v7 end to end. Two H200s (<= 4 min):
#   GPU 0: the 50-step model=tiny loss match (torch, helion, mamba_ssm, torch) -> the SSD backward GPU test against
#          mamba-ssm and the fp32 reference at the Nano shape
#   GPU 1: per-layer A/B and the 52-layer projection -> nano30b_slice training-step A/B (mamba_ssm, helion, mamba_ssm)
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s6e.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-250}"
gpu_call_begin || exit 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    stage_table track0_stages.tsv
    run_stage loss_match 110 python3 scripts/backend_loss_match.py --backends torch,helion,mamba_ssm,torch --steps 50 --quiet
    run_stage gpu_test_bwd 90 python3 -m pytest -v -m gpu -rA --tb=short tests/test_ssd_helion_bwd.py -k "vs_mamba_ssm"
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    stage_table track1_stages.tsv
    run_stage layers 75 python3 scripts/bench_layers.py --backends mamba_ssm,helion --rounds 3 --iters 4
    run_stage ab_step 125 python3 scripts/ab_step_time.py --backends mamba_ssm,helion,mamba_ssm --warmup 3 --blocks 4 \
        --block-steps 4 --discard 1 --profile-steps 2
}

finish_tracks 12 30
