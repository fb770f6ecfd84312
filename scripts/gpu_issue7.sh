#!/usr/bin/env bash
# Issue 7 GPU job (one H200, <= 8 minutes): Helion SSD backward + fused op.
#   0. setup   offline install (scripts/gpu_setup.sh), unless SKIP_SETUP=1
#   1. tests   GPU pytest of the backward and the fused op vs mamba-ssm / fp32 reference at the Nano shape
#   2. tune    scripts/tune_kernels.py for the ssd_bwd_* kernels within a budget (if that script exists)
#   3. bench   scripts/bench_ssd_bwd.py (nano, tp2, l4096b4; helion vs mamba_ssm side by side)
# Each stage logs to $OUT/logs/<stage>.log; a failure leaves $OUT/<stage>.FAILED with the traceback and
# the later stages still run.   OUT=benchmarks/results/h200 bash scripts/gpu_issue7.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-470}"
stage_table gpu_issue7_stages.tsv
gpu_stage_setup
run_stage tests 150 python3 -m pytest -q -m gpu -x --tb=long tests/test_ssd_helion_bwd.py tests/test_mamba_split_helion.py
if [ -f scripts/tune_kernels.py ]; then
    run_stage tune 120 python3 scripts/tune_kernels.py --kernels ssd_bwd_dz_dstates,ssd_bwd_state_passing,ssd_bwd_dx,ssd_bwd_dbc,ssd_bwd_dt --shape nano --budget-s 100
else
    echo "scripts/tune_kernels.py missing: tuning skipped (default configs used)" | tee "$OUT/tune.FAILED"
fi
run_stage bench 200 python3 scripts/bench_ssd_bwd.py --rounds 4 --iters 8
cat "$STAGE_TSV"
