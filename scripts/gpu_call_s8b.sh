#!/usr/bin/env bash
# Session 8, call 2 (docs/GPU_RUNBOOK.md, "Session 8"): the helion mixer reading zxbcdt in place (no (l, b, d) ->
# (b, l, d) copy), checked and measured with the call-1 backward and the new cumsum / state_passing configs. Two H200s:
#   GPU 0: GPU test of the strided zxbcdt -> per-layer A/B (mamba_ssm, helion, helion with megatron's copy)
#          -> nano30b_slice step A/B
#   GPU 1: mixer op A/B + per-kernel device time at Nano, TP=2, seqlen 4096 x batch 4 -> 50-step model=tiny loss match
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s8b.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-430}"
gpu_call_begin || exit 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    stage_table track0_stages.tsv
    run_stage gpu_test_strided 100 python3 -m pytest -v -s -m gpu -rA --tb=short tests/test_mamba_split_helion.py -k transposed_view
    run_stage layers 150 python3 scripts/bench_layers.py --backends mamba_ssm,helion,helion:zxbcdt_copy --rounds 3 --iters 4
    run_stage ab_step 160 python3 scripts/ab_step_time.py --backends mamba_ssm,helion,mamba_ssm --warmup 3 --blocks 4 \
        --block-steps 4 --discard 1 --profile-steps 2
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    stage_table track1_stages.tsv
    run_stage ab_nano 90 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape nano --rounds 4 --iters 8
    run_stage ab_tp2 75 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape tp2 --rounds 4 --iters 8
    run_stage ab_l4096b4 75 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape l4096b4 --rounds 4 --iters 8
    run_stage loss_match 130 python3 scripts/backend_loss_match.py --backends torch,helion,mamba_ssm,torch --steps 50 --quiet
}

finish_tracks 25 25
