#!/usr/bin/env bash
# One call on a two-GPU host (<= 9.5 min):
#   phase 1, two single-GPU tracks at once:
#     GPU 0: scripts/ab_step_time.py on nano30b_slice (mamba_ssm, helion, mamba_ssm control)
#     GPU 1: scripts/check_fast_modules_gpu.py (attention/MoE numerics + timing), scripts/bench_kernels.py
#            (nano, mamba_ssm vs helion), scripts/bench_norm_conv.py
#   phase 2, both GPUs: scripts/gpu_2gpu.sh (single, DP2, TP2, EP2 for 50 steps + loss checks)
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_ab_parallel.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-560}"
P1_S="${P1_S:-230}"   # phase 1 budget (s); phase 2 gets the rest
gpu_call_begin || exit 1
SAVED_TOTAL=$TOTAL_S; TOTAL_S=$P1_S   # run_stage caps each stage at what is left of phase 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    stage_table ab_track0_stages.tsv
    run_stage ab_step_time 225 python3 scripts/ab_step_time.py --backends mamba_ssm,helion,mamba_ssm \
        --warmup 3 --blocks 4 --block-steps 4 --discard 1 --profile-steps 2
}
track1() {
    export CUDA_VISIBLE_DEVICES=1
    stage_table ab_track1_stages.tsv
    run_stage fast_modules 80 python3 scripts/check_fast_modules_gpu.py --no-reference-timing --iters 8 --profile-top 25
    run_stage ab_nano 70 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape nano --rounds 4 --iters 8
    run_stage norm_conv 70 python3 scripts/bench_norm_conv.py --shapes nano --rounds 4
}
run_tracks
tail -n 45 "$OUT/logs/track0.out"; echo; tail -n 60 "$OUT/logs/track1.out"
TOTAL_S=$SAVED_TOTAL
echo "=== phase 2 at $(( $(date +%s) - START ))s"
LEFT=$(( SAVED_TOTAL - ($(date +%s) - START) ))
SKIP_SETUP=1 timeout --signal=TERM --kill-after=10 "$LEFT" bash scripts/gpu_2gpu.sh > "$OUT/logs/2gpu.out" 2>&1
echo "gpu_2gpu.sh rc $?"; tail -n 60 "$OUT/logs/2gpu.out"
save_triton_autotune
cat "$OUT"/ab_track*_stages.tsv
echo "total $(( $(date +%s) - START ))s"
