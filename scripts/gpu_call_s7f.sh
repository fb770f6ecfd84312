#!/usr/bin/env bash
# Session 7, call 6 (docs/GPU_RUNBOOK.md, "Session 7"): the chunk_state_passing config that call 5's search found
# (4 warps instead of 8) checked where it also runs: the fused op's backward recompute (fp32 states) at the Nano shape,
# the SSD forward GPU tests, the whole forward at TP=2 and seqlen 4096 x batch 4. Two H200s (<= 3 min).
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s7f.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-165}"
gpu_call_begin || exit 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    stage_table track0_stages.tsv
    run_stage gpu_test_op 130 python3 -m pytest -v -m gpu -rA --tb=short tests/test_mamba_split_helion.py -k vs_mamba_ssm
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    stage_table track1_stages.tsv
    run_stage gpu_test_fwd 55 python3 -m pytest -v -m gpu -rA --tb=short tests/test_ssd_helion.py -k nano_vs_fp32
    run_stage ssd_fwd 80 python3 scripts/bench_ssd_fwd.py --shapes nano_tp2,nano_b4_l4096 --rounds 4 --iters 8
}

finish_tracks 12 25
