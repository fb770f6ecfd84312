#!/usr/bin/env bash
# The next GPU call, prepared at the end of session 3 (docs/GPU_RUNBOOK.md, "Where session 3 stopped"); not yet run.
# Two H200s (<= 9 min), two single-GPU tracks, then both GPUs:
#   GPU 0: SSD / fused-op GPU tests (checks tuning.fit_access_lists: the initial-states / seq_idx cases failed
#          in session 3) -> 50-step tiny loss match torch, helion, mamba_ssm, torch -> step A/B with the conv1d
#          forward v2 default
#   GPU 1: conv1d_bwd_v3 config search -> bench_norm_conv (all variants) -> mixer op A/B at the Nano shape
#   both:  DP2 and EP2 again against the committed single-GPU run (benchmarks/results/h200/parallel_2gpu/single)
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_next.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-540}"
PHASE2_S="${PHASE2_S:-170}"
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$REPO/.triton_cache}"
stage_table setup_stages.tsv
gpu_stage_setup || exit 1
export PYTHONPATH="${PYTHONPATH:-$REPO/site:$REPO}"

track0() {
    export CUDA_VISIBLE_DEVICES=0
    TOTAL_S=$(( TOTAL_S - PHASE2_S ))
    stage_table track0_stages.tsv
    run_stage gpu_tests_ssd 100 python3 -m pytest -q -m gpu -rf --tb=short tests/test_ssd_helion.py \
        tests/test_ssd_helion_bwd.py tests/test_mamba_split_helion.py
    run_stage loss_match 150 python3 scripts/backend_loss_match.py --backends torch,helion,mamba_ssm,torch --steps 50 --quiet
    run_stage ab_step 160 python3 scripts/ab_step_time.py --backends mamba_ssm,helion,mamba_ssm --warmup 3 --blocks 4 \
        --block-steps 4 --discard 1 --profile-steps 2
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    TOTAL_S=$(( TOTAL_S - PHASE2_S ))
    stage_table track1_stages.tsv
    run_stage tune_conv_bwd 130 python3 scripts/tune_kernels.py --kernels conv1d_bwd_v3 --shapes nano --budget-s 80
    mkdir -p "$OUT/configs" && cp -r kernels/configs/sm* "$OUT/configs/"
    run_stage norm_conv 90 python3 scripts/bench_norm_conv.py --rounds 5 --conv-bwd-variants v1,v3 --conv-fwd-variants v1,v2
    run_stage ab_nano 80 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape nano --rounds 4 --iters 8
}

run_tracks
mkdir -p "$OUT/parallel_single" && cp benchmarks/results/h200/parallel_2gpu/single/metrics.jsonl "$OUT/parallel_single/"
stage_table phase2_stages.tsv
run_stage parallel_dp2_ep2 160 env RUNS="dp2 ep2" SKIP_SETUP=1 bash scripts/gpu_2gpu.sh
save_triton_autotune
tail -n 20 "$OUT/logs/track0.out"; echo; tail -n 20 "$OUT/logs/track1.out"
cat "$OUT"/track*_stages.tsv "$OUT/phase2_stages.tsv"
