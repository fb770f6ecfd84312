# Shared setup and stage runner for the scripts/gpu_*.sh jobs. Source it from the repository root:
#
#   cd "$(dirname "$0")/.."
#   source scripts/gpu_stages.sh              # REPO, OUT (absolute, exported, $OUT/logs made), START
#   TOTAL_S="${TOTAL_S:-470}"                 # the job's time budget, read by remaining / run_stage
#   stage_table gpu_issueN_stages.tsv         # STAGE_TSV=$OUT/<file>, header "stage rc seconds"
#   gpu_stage_setup                           # scripts/gpu_setup.sh unless SKIP_SETUP=1
#   run_stage NAME CAP_SECONDS CMD...
#
# run_stage runs CMD with a timeout of min(CAP, time left - 10 s), logs to $OUT/logs/NAME.log, appends
# "NAME rc seconds" to $STAGE_TSV and prints the log's tail; a failure (or too little time left) leaves
# $OUT/NAME.FAILED with the exit code, the command and the log's tail, and returns non-zero, so the
# caller's later stages still run (the callers do not use set -e).
set -u
REPO="$PWD"
OUT="${OUT:-benchmarks/results/h200}"
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"
export OUT
START=$(date +%s)

# stage_table FILE: start the stage table $OUT/FILE (STAGE_TSV)
stage_table() {
    STAGE_TSV="$OUT/$1"
    printf 'stage\trc\tseconds\n' > "$STAGE_TSV"
}

# remaining: seconds left of TOTAL_S since START
remaining() { echo $(( TOTAL_S - ($(date +%s) - START) )); }

# gpu_stage_setup [NAME]: source scripts/gpu_setup.sh (offline install, PYTHONPATH) unless SKIP_SETUP=1;
# log $OUT/logs/NAME.log (NAME defaults to setup); on failure $OUT/NAME.FAILED and the log on stdout.
gpu_stage_setup() {
    local name="${1:-setup}"
    [ "${SKIP_SETUP:-0}" = "1" ] && return 0
    set --  # a bare `source` would hand this function's arguments to gpu_setup.sh
    # shellcheck source=gpu_setup.sh
    if ! source scripts/gpu_setup.sh ${WHEELHOUSE:+"$WHEELHOUSE"} > "$OUT/logs/$name.log" 2>&1; then
        cp "$OUT/logs/$name.log" "$OUT/$name.FAILED"
        echo "$name FAILED:"; cat "$OUT/logs/$name.log"
        return 1
    fi
}

# gpu_call_begin: the common start of a scripts/gpu_call_*.sh job: Triton's cache (mamba-ssm autotune results
# kept, TRITON_CACHE_DIR defaults to .triton_cache), the setup stage table and offline install (returns 1 on
# failure), PYTHONPATH (./site:.) and the GPUs' clocks/power in $OUT/logs/nvidia_smi.csv
gpu_call_begin() {
    export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$REPO/.triton_cache}"
    stage_table setup_stages.tsv
    gpu_stage_setup || return 1
    export PYTHONPATH="${PYTHONPATH:-$REPO/site:$REPO}"
    nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv \
        > "$OUT/logs/nvidia_smi.csv" 2>&1
    return 0
}

# run_stage NAME CAP_SECONDS CMD...: run CMD with a timeout of min(CAP, time left - 10 s)
run_stage() {
    local name="$1" cap="$2"; shift 2
    local left lim t0 rc
    left=$(remaining)
    lim=$(( cap < left - 10 ? cap : left - 10 ))
    rm -f "$OUT/$name.FAILED"
    if [ "$lim" -lt 20 ]; then
        echo "[$name] skipped: only ${left}s left" | tee "$OUT/$name.FAILED"
        printf '%s\tskipped\t0\n' "$name" >> "$STAGE_TSV"
        return 1
    fi
    echo "=== [$name] (timeout ${lim}s, ${left}s left): $*"
    t0=$(date +%s)
    timeout --signal=TERM --kill-after=15 "$lim" "$@" > "$OUT/logs/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$STAGE_TSV"
    tail -n 25 "$OUT/logs/$name.log"
    if [ "$rc" -ne 0 ]; then
        { echo "stage $name failed: exit code $rc$( [ "$rc" -eq 124 ] && echo ' (timed out)')"
          echo "command: $*"; echo "--- last 150 lines of logs/$name.log ---"
          tail -n 150 "$OUT/logs/$name.log"; } > "$OUT/$name.FAILED"
        echo "[$name] FAILED (rc $rc): see $OUT/$name.FAILED"
    fi
    return "$rc"
}

# run_tracks: run the caller's shell functions track0 and track1 at once (one GPU each), logging to
# $OUT/logs/track0.out and track1.out, and wait for both
run_tracks() {
    track0 > "$OUT/logs/track0.out" 2>&1 &
    local p0=$!
    track1 > "$OUT/logs/track1.out" 2>&1 &
    local p1=$!
    wait "$p0" "$p1"
}

# finish_tracks [N0] [N1]: the end of a two-track call: run_tracks, save_triton_autotune, the last N0 / N1 lines
# (default 25) of each track's output and the stage tables
finish_tracks() {
    run_tracks
    save_triton_autotune
    tail -n "${1:-25}" "$OUT/logs/track0.out"; echo; tail -n "${2:-${1:-25}}" "$OUT/logs/track1.out"
    cat "$OUT"/track*_stages.tsv
}

# save_triton_autotune: copy mamba-ssm's Triton autotune results (TRITON_CACHE_AUTOTUNING=1) from
# $TRITON_CACHE_DIR to $OUT/triton_autotune/, so the next host can start from them (carry .triton_cache)
save_triton_autotune() {
    mkdir -p "$OUT/triton_autotune" && (cd "$TRITON_CACHE_DIR" 2>/dev/null && \
        find . -name '*.autotune.json' -exec cp --parents {} "$OUT/triton_autotune/" \;)
}
