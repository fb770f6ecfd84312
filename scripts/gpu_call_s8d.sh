#!/usr/bin/env bash
# Session 8, call 4 (docs/GPU_RUNBOOK.md, "Session 8"), ONE quiet H200 (kind nvidia-h200): the backward's dstates in
# bf16 (NANO_HELION_BWD_DSTATES=input) checked for accuracy at the Nano shape and measured: mixer op A/B + per-kernel
# device time, per-layer A/B (with helion's zxbcdt copy as a third arm); and a third run of the whole SSD forward A/B.
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s8d.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-340}"
gpu_call_begin || exit 1
export CUDA_VISIBLE_DEVICES=0
stage_table track0_stages.tsv
run_stage gpu_test_acc 110 python3 -m pytest -v -s -m gpu -rA --tb=short tests/test_mamba_split_helion.py -k bwd_states_dtype_nano
run_stage ab_nano 110 env NANO_HELION_BWD_DSTATES=input python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion \
    --shape nano --rounds 6 --iters 8
run_stage ssd_fwd 50 python3 scripts/bench_ssd_fwd.py --shapes nano --rounds 10 --iters 8
run_stage layers 90 env NANO_HELION_BWD_DSTATES=input python3 scripts/bench_layers.py \
    --backends mamba_ssm,helion,helion:zxbcdt_copy --rounds 3 --iters 4
save_triton_autotune
cat "$OUT"/track0_stages.tsv
