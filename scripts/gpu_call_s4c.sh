#!/usr/bin/env bash
# Session 4, call 3 (docs/GPU_RUNBOOK.md, "Session 4"): the final code measured. Two H200s (<= 9.5 min),
# two single-GPU tracks:
#   GPU 0: the GPU test of the block > chunk NaN fix -> 50-step tiny loss match torch, helion, mamba_ssm,
#          torch (went NaN at step 16 in call 2) -> the nano30b_slice training-step A/B
#   GPU 1: RMSNorm side by side with --profile -> mixer op A/B (per-kernel table) -> SSD forward A/B ->
#          per-layer A/B and the 52-layer projection
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s4c.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-420}"
gpu_call_begin || exit 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    stage_table track0_stages.tsv
    run_stage gpu_test_nan_fix 80 python3 -m pytest -v -m gpu -rA --tb=short tests/test_ssd_helion_bwd.py -k block_larger
    run_stage loss_match 160 python3 scripts/backend_loss_match.py --backends torch,helion,mamba_ssm,torch --steps 50 --quiet
    run_stage ab_step 200 python3 scripts/ab_step_time.py --backends mamba_ssm,helion,mamba_ssm --warmup 3 --blocks 4 \
        --block-steps 4 --discard 1 --profile-steps 2
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    stage_table track1_stages.tsv
    run_stage norm_profile 60 python3 scripts/bench_norm_conv.py --ops rmsnorm --shapes nano --rounds 5 --profile
    run_stage ab_nano 100 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape nano --rounds 4 --iters 8
    run_stage ssd_fwd 90 python3 scripts/bench_ssd_fwd.py --rounds 4 --iters 8
    run_stage layers 120 python3 scripts/bench_layers.py --backends mamba_ssm,helion --rounds 3 --iters 4
    run_stage ab_tp2 70 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape tp2 --rounds 3 --iters 8
}

finish_tracks 25
