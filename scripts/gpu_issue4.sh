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
OUT="${OUT:-benchmarks/results/h200}"
mkdir -p "$OUT/logs"; OUT="$(cd "$OUT" && pwd)"; export OUT
TOTAL_S="${TOTAL_S:-470}"; START=$(date +%s)
STAGES="$OUT/gpu_issue4_stages.tsv"; printf 'stage\trc\tseconds\n' > "$STAGES"
remaining() { echo $(( TOTAL_S - ($(date +%s) - START) )); }
run_stage() {
    local name="$1" cap="$2"; shift 2
    local left lim t0 rc
    left=$(remaining); lim=$(( cap < left - 10 ? cap : left - 10 ))
    rm -f "$OUT/$name.FAILED"
    if [ "$lim" -lt 20 ]; then echo "[$name] skipped: ${left}s left" | tee "$OUT/$name.FAILED"; printf '%s\tskipped\t0\n' "$name" >> "$STAGES"; return 1; fi
    echo "=== [$name] (timeout ${lim}s): $*"
    t0=$(date +%s)
    timeout --signal=TERM --kill-after=15 "$lim" "$@" > "$OUT/logs/$name.log" 2>&1; rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$STAGES"
    tail -n 25 "$OUT/logs/$name.log"
    if [ "$rc" -ne 0 ]; then
        { echo "stage $name failed: exit code $rc"; echo "command: $*"; tail -n 150 "$OUT/logs/$name.log"; } > "$OUT/$name.FAILED"
    fi
    return "$rc"
}
if [ "${SKIP_SETUP:-0}" != "1" ]; then
    # shellcheck source=gpu_setup.sh
    source scripts/gpu_setup.sh ${WHEELHOUSE:+"$WHEELHOUSE"} > "$OUT/logs/setup.log" 2>&1 || cp "$OUT/logs/setup.log" "$OUT/setup.FAILED"
fi
run_stage tests 150 python3 -m pytest -q -m gpu --tb=long tests/test_rmsnorm_gated.py tests/test_causal_conv1d.py tests/test_tuning.py
run_stage tune 210 python3 scripts/tune_kernels.py --kernels rmsnorm_fwd,rmsnorm_bwd,conv1d_fwd,conv1d_bwd --shapes nano --budget-s 170
mkdir -p "$OUT/configs" && cp -r kernels/configs/sm* "$OUT/configs/" 2>/dev/null  # winners come back via $OUT: copy to kernels/configs/ and commit
run_stage bench 150 python3 scripts/bench_norm_conv.py --rounds 5 --rep-ms 40
cat "$STAGES"
