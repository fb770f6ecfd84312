#!/usr/bin/env bash
# Issue 4 GPU job (one H200, <= 8 minutes): Helion gated RMSNorm + causal conv1d.
#   0. setup   offline install (scripts/gpu_setup.sh), unless SKIP_SETUP=1
#   1. tests   GPU pytest: test_rmsnorm_gated, test_causal_conv1d, test_tuning (vs mamba-ssm, causal-conv1d, fp32 ref)
#   2. tune    scripts/tune_kernels.py rmsnorm_fwd,rmsnorm_bwd,conv1d_fwd,conv1d_bwd at nano, 200 s budget; winners -> kernels/configs/sm90/
#   3. bench   scripts/bench_norm_conv.py (nano, nano_tp2, nano_b4_l4096) -> $OUT/bench_norm_conv.json
# Each stage logs to $OUT/logs/<stage>.log; a failure leaves $OUT/<stage>.FAILED with the traceback and
# the later stages still run.   OUT=benchmarks/results/h200 bash scripts/gpu_issue4.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-470}"
stage_table gpu_issue4_stages.tsv
gpu_stage_setup
run_stage tests 150 python3 -m pytest -q -m gpu --tb=long tests/test_rmsnorm_gated.py tests/test_causal_conv1d.py tests/test_tuning.py
run_stage tune 210 python3 scripts/tune_kernels.py --kernels rmsnorm_fwd,rmsnorm_bwd,conv1d_fwd,conv1d_bwd --shapes nano --budget-s 170
mkdir -p "$OUT/configs" && cp -r kernels/configs/sm* "$OUT/configs/" 2>/dev/null  # winners come back via $OUT: copy to kernels/configs/ and commit
run_stage bench 150 python3 scripts/bench_norm_conv.py --rounds 5 --rep-ms 40
cat "$STAGE_TSV"
