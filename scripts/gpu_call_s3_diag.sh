#!/usr/bin/env bash
# One call on a two-GPU host (<= 9.5 min), two independent single-GPU tracks at once (session 3):
#   GPU 0: the step/op gap diagnosis (scripts/ab_step_time.py --isolated-op --trace-dir: per-kernel
#          device time in the training step, its cross-stream overlap, and the mixer op alone in the
#          same process) -> RMSNorm config search (pipelined seeds) -> scripts/bench_norm_conv.py
#   GPU 1: attention/MoE layer timing (scripts/check_fast_modules_gpu.py, rounds of back-to-back
#          steps) -> scripts/bench_ssd_fwd.py (issue 5 per-kernel table) -> scripts/bench_kernels.py
#          at the l4096b4 shape (not tuned for it)
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s3_diag.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-560}"
gpu_call_begin || exit 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    stage_table track0_stages.tsv
    run_stage ab_diag 200 python3 scripts/ab_step_time.py --backends mamba_ssm,helion --warmup 2 --blocks 2 \
        --block-steps 3 --discard 1 --profile-steps 2 --isolated-op --trace-dir "$OUT/traces" --tag diag
    run_stage tune_norm 230 python3 scripts/tune_kernels.py --kernels rmsnorm_bwd,rmsnorm_fwd --shapes nano --budget-s 200
    mkdir -p "$OUT/configs" && cp -r kernels/configs/sm* "$OUT/configs/"
    run_stage norm_conv 100 python3 scripts/bench_norm_conv.py --shapes nano --rounds 5
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    stage_table track1_stages.tsv
    run_stage fast_modules 120 python3 scripts/check_fast_modules_gpu.py --skip-numerics --no-reference-timing \
        --rounds 7 --iters 10 --profile-top 30
    run_stage ssd_fwd 220 python3 scripts/bench_ssd_fwd.py --rounds 4 --iters 8
    run_stage ab_l4096b4 120 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape l4096b4 \
        --rounds 4 --iters 8
}

finish_tracks 30
