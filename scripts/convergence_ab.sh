#!/usr/bin/env bash
# Convergence A/B: the same recipe, seed and data once per kernel backend, each run stopped with
# SIGTERM after STOP_AT steps (it finishes the step, saves a checkpoint, exits 0) and resumed with the
# same command; then scripts/compare_runs.py overlays the two loss curves.
#   GPUS="0 1" bash scripts/convergence_ab.sh [extra Hydra overrides]    (both arms at once on two GPUs)
#   GPUS="0"   bash scripts/convergence_ab.sh ...                          (one after the other on one GPU)
# Env: OUT (default runs/), RECIPE (default convergence_ab_h200), BACKENDS (default "mamba_ssm helion"),
#      STOP_AT (default 400; 0: no interruption, no resume), GPUS, COMPARE=0 (skip the comparison). BACKENDS="mamba_ssm mamba_ssm" is the A-vs-A
#      pair: its second run goes to convergence_mamba_ssm_b. RESUME_EXTRA: overrides for the resumed part only,
#      e.g. "checkpoint.save_on_exit=false" (no checkpoint at the end of training: it is deleted afterwards anyway).
#      LABELS="l0 l1": the two arms' run-dir labels (default: the backends).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-runs}"
RECIPE="${RECIPE:-convergence_ab_h200}"
STOP_AT="${STOP_AT:-400}"
read -r -a BACKENDS <<< "${BACKENDS:-mamba_ssm helion}"
read -r -a GPUS <<< "${GPUS:-0}"
PY="${PYTHON:-python3}"

one_arm() {  # one_arm BACKEND LABEL GPU EXTRA...  (LABEL names the run dir and logs)
    local be="$1" label="$2" gpu="$3"; shift 3
    local dir="$OUT/convergence_$label"
    rm -rf "$dir"
    local cmd=("$PY" -m nano_hybrid.train "recipe=$RECIPE" "kernels.backend=$be" "run_dir=$dir" "$@")
    export CUDA_VISIBLE_DEVICES="$gpu"
    if [ "$STOP_AT" = "0" ]; then  # one uninterrupted run (an A-vs-A control needs no resume)
        "${cmd[@]}" > "$OUT/logs/convergence_${label}_part1.log" 2>&1 || { echo "$label: run failed" >&2; return 1; }
        rm -rf "$dir/checkpoints"
        echo "$be: done, $(wc -l < "$dir/metrics.jsonl") metric lines"
        return 0
    fi
    setsid "${cmd[@]}" > "$OUT/logs/convergence_${label}_part1.log" 2>&1 &
    local pid=$!
    steps() { if [ -f "$dir/metrics.jsonl" ]; then wc -l < "$dir/metrics.jsonl"; else echo 0; fi; }
    until [ "$(steps)" -ge "$STOP_AT" ]; do
        kill -0 "$pid" 2>/dev/null || { echo "$be: run ended before step $STOP_AT" >&2; return 1; }
        sleep 0.5
    done
    kill -TERM -- "-$pid"
    wait "$pid" || { echo "$be: stopped run exited non-zero" >&2; return 1; }
    echo "$be: stopped after $(steps) steps; resuming"
    local resume_extra=()
    read -r -a resume_extra <<< "${RESUME_EXTRA:-}"
    "${cmd[@]}" "${resume_extra[@]}" > "$OUT/logs/convergence_${label}_part2.log" 2>&1 \
        || { echo "$label: resumed run failed" >&2; return 1; }
    rm -rf "$dir/checkpoints"
    echo "$be: done, $(steps) metric lines"
}

# labels name the run dirs: the backend, with "_b" for the second arm of an A-vs-A pair (BACKENDS="x x"), or
# LABELS="l0 l1" (e.g. "helion_b mamba_ssm_b": repeats of an earlier pair, compared with it afterwards)
if [ -n "${LABELS:-}" ]; then
    read -r -a LABELS <<< "$LABELS"
    [ "${#LABELS[@]}" -eq 2 ] && [ "${LABELS[0]}" != "${LABELS[1]}" ] || { echo "LABELS needs two different names" >&2; exit 2; }
else
    LABELS=("${BACKENDS[0]}" "${BACKENDS[1]}")
    [ "${LABELS[0]}" = "${LABELS[1]}" ] && LABELS[1]="${LABELS[1]}_b"
fi
mkdir -p "$OUT/logs"
rc=0
if [ "${#GPUS[@]}" -ge 2 ]; then
    one_arm "${BACKENDS[0]}" "${LABELS[0]}" "${GPUS[0]}" "$@" & p0=$!
    one_arm "${BACKENDS[1]}" "${LABELS[1]}" "${GPUS[1]}" "$@" & p1=$!
    wait $p0 || rc=1
    wait $p1 || rc=1
else
    for i in 0 1; do one_arm "${BACKENDS[$i]}" "${LABELS[$i]}" "${GPUS[0]}" "$@" || rc=1; done
fi
[ "${COMPARE:-1}" = "0" ] && exit $rc   # e.g. on a GPU host without matplotlib: compare elsewhere
"$PY" scripts/compare_runs.py "$OUT/convergence_${LABELS[0]}" "$OUT/convergence_${LABELS[1]}" --warmup 10 \
    --out "$OUT/compare_convergence" --json "$OUT/compare_convergence/summary.json" || rc=1
exit $rc
