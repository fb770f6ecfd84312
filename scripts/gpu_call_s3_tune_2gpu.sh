#!/usr/bin/env bash
# Session-3 call 2 on a two-GPU host (<= 9.5 min):
#   phase 1, two single-GPU tracks at once
#     GPU 0: the step/op gap again, now dumping every compiled Helion kernel's normalized config and
#            Triton source (NANO_HELION_DUMP_DIR) -> config search for conv1d_bwd, conv1d_bwd_v3
#     GPU 1: the single-GPU reference of the 2-GPU check (RUNS=single scripts/gpu_2gpu.sh) -> config
#            search (written as normalized configs) for the kernels that had none: ssd_bwd_state_passing,
#            ssd_bwd_dt, rmsnorm_fwd_v2, ssd_chunk_state, ssd_state_passing (dumping the tuner's code too)
#   phase 2, both GPUs: DP2, TP2, EP2 runs and their checks against the single-GPU run (gpu_2gpu.sh)
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s3_tune_2gpu.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-575}"
gpu_call_begin || exit 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    stage_table track0_stages.tsv
    run_stage ab_diag2 150 env NANO_HELION_DUMP_DIR="$OUT/dump_ab" python3 scripts/ab_step_time.py \
        --backends mamba_ssm,helion --warmup 2 --blocks 2 --block-steps 3 --discard 1 --profile-steps 2 --isolated-op --tag diag2
    run_stage tune_conv 125 python3 scripts/tune_kernels.py --kernels conv1d_bwd_v3 --shapes nano --budget-s 100
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    stage_table track1_stages.tsv
    run_stage parallel_single 150 env RUNS=single SKIP_SETUP=1 bash scripts/gpu_2gpu.sh
    run_stage tune_rest 175 env NANO_HELION_DUMP_DIR="$OUT/dump_tune" python3 scripts/tune_kernels.py \
        --kernels ssd_bwd_state_passing,ssd_bwd_dt,rmsnorm_fwd_v2,ssd_chunk_state,ssd_state_passing --shapes nano --budget-s 150
}

run_tracks
mkdir -p "$OUT/configs" && cp -r kernels/configs/sm* "$OUT/configs/"
stage_table phase2_stages.tsv
run_stage parallel_2gpu 300 env RUNS="dp2 tp2 ep2" SKIP_SETUP=1 bash scripts/gpu_2gpu.sh
save_triton_autotune
tail -n 25 "$OUT/logs/track0.out"; echo; tail -n 25 "$OUT/logs/track1.out"
cat "$OUT"/track*_stages.tsv "$OUT/phase2_stages.tsv"
