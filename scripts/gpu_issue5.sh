#!/usr/bin/env bash
# Issue 5 GPU job (one H200, <= 8 minutes): Helion SSD forward.
#   0. setup   offline install (scripts/gpu_setup.sh), unless SKIP_SETUP=1
#   1. tests   GPU pytest of the forward vs fp32 reference and mamba-ssm at the Nano shape
#   2. tune    scripts/tune_kernels.py for the ssd_* forward kernels within a budget (if that script exists)
#   3. bench   scripts/bench_ssd_fwd.py (nano, tp2, l4096b4; helion vs mamba_ssm side by side)
# Each stage logs to $OUT/logs/<stage>.log; a failure leaves $OUT/<stage>.FAILED with the traceback and
# the later stages still run.   OUT=benchmarks/results/h200 bash scripts/gpu_issue5.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-470}"
stage_table gpu_issue5_stages.tsv
gpu_stage_setup
run_stage tests 120 python3 -m pytest -q -m gpu --tb=long tests/test_ssd_helion.py
if [ -f scripts/tune_kernels.py ]; then
    run_stage tune 150 python3 scripts/tune_kernels.py --kernels ssd_chunk_scan,ssd_chunk_state_passing,ssd_bmm_chunk,ssd_chunk_cumsum,ssd_chunk_state,ssd_state_passing --shape nano --budget-s 130
else
    echo "scripts/tune_kernels.py missing: tuning skipped (default configs used)" | tee "$OUT/tune.FAILED"
fi
run_stage bench 180 python3 scripts/bench_ssd_fwd.py --rounds 4 --iters 8
cat "$STAGE_TSV"
