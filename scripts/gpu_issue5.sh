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
OUT="${OUT:-benchmarks/results/h200}"
mkdir -p "$OUT/logs"; OUT="$(cd "$OUT" && pwd)"; export OUT
TOTAL_S="${TOTAL_S:-470}"; START=$(date +%s)
STAGES="$OUT/gpu_issue5_stages.tsv"; printf 'stage\trc\tseconds\n' > "$STAGES"
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
run_stage tests 120 python3 -m pytest -q -m gpu --tb=long tests/test_ssd_helion.py
if [ -f scripts/tune_kernels.py ]; then
    run_stage tune 150 python3 scripts/tune_kernels.py --kernels ssd_chunk_scan,ssd_chunk_state_passing,ssd_bmm_chunk,ssd_chunk_cumsum,ssd_chunk_state,ssd_state_passing --shape nano --budget-s 130
else
    echo "scripts/tune_kernels.py missing: tuning skipped (default configs used)" | tee "$OUT/tune.FAILED"
fi
run_stage bench 180 python3 scripts/bench_ssd_fwd.py --rounds 4 --iters 8
cat "$STAGES"
