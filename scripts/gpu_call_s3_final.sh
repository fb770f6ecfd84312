#!/usr/bin/env bash
# Session-3 call 3 on a two-GPU host (<= 9 min): the side-by-side measurements with the final kernels
# and configs (flat grids for generic configs, conv1d backward v3, normalized sm90 configs).
#   GPU 0: step A/B on nano30b_slice (mamba_ssm, helion, mamba_ssm; with the per-kernel step-vs-op
#          table) -> per-layer A/B and the 52-layer projection -> mixer op at the TP=2 shape -> SSD v1/v2
#          kernel variants (scripts/bench_ssd_variants.py) -> mixer op at l4096b4
#   GPU 1: conv1d forward v2 config search -> mixer op A/B at the Nano shape (per-kernel table) ->
#          RMSNorm/conv1d A/B (all variants) -> SSD forward per-kernel table -> GPU correctness tests (conv1d,
#          RMSNorm) -> 50-step tiny loss match (torch, helion, mamba_ssm, torch)
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s3_final.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-525}"
gpu_call_begin || exit 1
CONV_FWD_VARIANTS="${CONV_FWD_VARIANTS:-v1,v2}"

# the tracks stop starting stages PHASE2_S before the end: phase 2 (both GPUs) needs that much
PHASE2_S="${PHASE2_S:-110}"

track0() {
    export CUDA_VISIBLE_DEVICES=0
    TOTAL_S=$(( TOTAL_S - PHASE2_S ))
    stage_table track0_stages.tsv
    run_stage ab_step 230 python3 scripts/ab_step_time.py --backends mamba_ssm,helion,mamba_ssm --warmup 3 --blocks 4 \
        --block-steps 4 --discard 1 --profile-steps 2 --isolated-op
    run_stage layers 130 python3 scripts/bench_layers.py --backends mamba_ssm,helion --rounds 3 --iters 4
    run_stage ab_tp2 80 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape tp2 --rounds 3 --iters 8
    run_stage ab_l4096b4 70 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape l4096b4 --rounds 3 --iters 8
    run_stage ssd_variants 90 python3 scripts/bench_ssd_variants.py --shape nano --rounds 4 --iters 8
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    TOTAL_S=$(( TOTAL_S - PHASE2_S ))
    stage_table track1_stages.tsv
    run_stage tune_conv_fwd 110 python3 scripts/tune_kernels.py --kernels conv1d_fwd_v2 --shapes nano --budget-s 45
    mkdir -p "$OUT/configs" && cp -r kernels/configs/sm* "$OUT/configs/"
    run_stage ab_nano 80 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape nano --rounds 4 --iters 8
    run_stage norm_conv 120 python3 scripts/bench_norm_conv.py --rounds 5 --conv-bwd-variants v1,v3 \
        --conv-fwd-variants "$CONV_FWD_VARIANTS"
    run_stage ssd_fwd 90 python3 scripts/bench_ssd_fwd.py --rounds 4 --iters 8
    run_stage gpu_tests 110 python3 -m pytest -q -m gpu -rf --tb=short tests/test_causal_conv1d.py tests/test_rmsnorm_gated.py \
        tests/test_ssd_helion.py tests/test_ssd_helion_bwd.py tests/test_mamba_split_helion.py
    run_stage loss_match 110 python3 scripts/backend_loss_match.py --backends torch,helion,mamba_ssm,torch --steps 50 --quiet
}

run_tracks
# phase 2, both GPUs: TP2 again after the expert-gradient fix (4df0b56: experts' grads were not reduced
# across TP ranks), checked against the single-GPU run of call 2 (committed; the fix does not touch it)
mkdir -p "$OUT/parallel_single" && cp benchmarks/results/h200/parallel_2gpu/single/metrics.jsonl "$OUT/parallel_single/"
stage_table phase2_stages.tsv
run_stage parallel_tp2 105 env RUNS=tp2 SKIP_SETUP=1 bash scripts/gpu_2gpu.sh
save_triton_autotune
tail -n 20 "$OUT/logs/track0.out"; echo; tail -n 20 "$OUT/logs/track1.out"
cat "$OUT"/track*_stages.tsv "$OUT/phase2_stages.tsv"
