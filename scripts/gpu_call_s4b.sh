#!/usr/bin/env bash
# Session 4, call 2 (docs/GPU_RUNBOOK.md, "Session 4"). Two H200s (<= 9.5 min):
#   GPU 0: RMSNorm config search from the committed winners + the TMA / eviction seeds -> bench_norm_conv
#          (RMSNorm only, with --profile: device vs wall time per call) -> attention layer timing with its
#          device span / busy / idle time per step (check_fast_modules_gpu.py --kinds attention)
#   GPU 1: the SSD / fused-op GPU tests, verbose (the initial-states cases that failed in session 3) ->
#          50-step tiny loss match torch, helion, mamba_ssm, torch
#   both:  TP2 against call 1's single-GPU run (benchmarks/results/h200/parallel_2gpu/session4/single)
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s4b.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-555}"
PHASE2_S="${PHASE2_S:-100}"
gpu_call_begin || exit 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    TOTAL_S=$(( TOTAL_S - PHASE2_S ))
    stage_table track0_stages.tsv
    run_stage tune_norm 190 python3 scripts/tune_kernels.py --kernels rmsnorm_bwd,rmsnorm_fwd,rmsnorm_fwd_v2 \
        --shapes nano --budget-s 150
    mkdir -p "$OUT/configs" && cp -r kernels/configs/sm* "$OUT/configs/"
    run_stage norm_profile 80 python3 scripts/bench_norm_conv.py --ops rmsnorm --shapes nano --rounds 5 --profile
    run_stage attention 90 python3 scripts/check_fast_modules_gpu.py --skip-numerics --no-reference-timing \
        --kinds attention --rounds 7 --iters 10 --profile-top 30
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    TOTAL_S=$(( TOTAL_S - PHASE2_S ))
    stage_table track1_stages.tsv
    run_stage gpu_tests_ssd 200 python3 -m pytest -v -m gpu -rA --tb=short tests/test_ssd_helion.py \
        tests/test_ssd_helion_bwd.py tests/test_mamba_split_helion.py
    run_stage loss_match 250 python3 scripts/backend_loss_match.py --backends torch,helion,mamba_ssm,torch --steps 50 --quiet
}

run_tracks
mkdir -p "$OUT/parallel_single" && cp benchmarks/results/h200/parallel_2gpu/session4/single/metrics.jsonl "$OUT/parallel_single/"
stage_table phase2_stages.tsv
run_stage parallel_tp2 90 env RUNS=tp2 SKIP_SETUP=1 bash scripts/gpu_2gpu.sh
save_triton_autotune
tail -n 20 "$OUT/logs/track0.out"; echo; tail -n 20 "$OUT/logs/track1.out"
cat "$OUT"/track*_stages.tsv "$OUT/phase2_stages.tsv"
