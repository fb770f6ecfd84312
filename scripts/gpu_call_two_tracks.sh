#!/usr/bin/env bash
# One call on a two-GPU host (<= 9.5 min), two independent single-GPU tracks at once:
#   GPU 0: conv1d GPU tests -> host-overhead profile (scripts/profile_host.py) -> config search for
#          conv1d_bwd, conv1d_fwd, rmsnorm_fwd -> side-by-side A/B (scripts/bench_kernels.py, nano; tp2 if time)
#   GPU 1: the 200-step nano30b_slice run (mamba_ssm, bf16, real data) -> scripts/bench_layers.py
#          (mamba_ssm vs helion), started once GPU 0's config search has written its files.
# Each stage logs to $OUT/logs/<stage>.log and appends to $OUT/<track>_stages.tsv.
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_two_tracks.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-560}"
gpu_call_begin || exit 1
DONE="$OUT/.tune_done"; rm -f "$DONE"

track0() {
    export CUDA_VISIBLE_DEVICES=0
    stage_table track0_stages.tsv
    run_stage conv_tests 80 python3 -m pytest -q -m gpu -rf --tb=short tests/test_causal_conv1d.py
    run_stage host_profile 90 python3 scripts/profile_host.py --backends mamba_ssm,helion --shape nano --iters 10
    run_stage tune 190 python3 scripts/tune_kernels.py --kernels conv1d_bwd,conv1d_fwd,rmsnorm_fwd --shapes nano --budget-s 150
    mkdir -p "$OUT/configs" && cp -r kernels/configs/sm* "$OUT/configs/"
    touch "$DONE"
    run_stage ab_nano 150 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape nano --rounds 4 --iters 8
    run_stage ab_tp2 100 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape tp2 --rounds 3 --iters 8 --profile-iters 0
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    stage_table track1_stages.tsv
    run_stage train200 330 python3 -m nano_hybrid.train recipe=nano30b_slice_h200 data=default train.train_iters=200 \
        train.exit_after_minutes=5.3 checkpoint.interval=0 checkpoint.save_on_exit=false checkpoint.load=none \
        logger.wandb.mode=disabled run_dir="$OUT/train200"
    for _ in $(seq 1 60); do [ -f "$DONE" ] && break; sleep 3; done
    run_stage bench_layers 200 python3 scripts/bench_layers.py --backends mamba_ssm,helion --rounds 3 --iters 4
}

run_tracks
rm -rf "$OUT/train200/checkpoints"
save_triton_autotune
tail -n 60 "$OUT/logs/track0.out"; echo; tail -n 40 "$OUT/logs/track1.out"
cat "$OUT"/track*_stages.tsv
