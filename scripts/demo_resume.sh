#!/usr/bin/env bash
# The README's "Long runs" plot: the default run (recipe=tiny_cpu) once uninterrupted and once stopped with
# SIGTERM after step 150 and resumed with the same command; compare_runs.py plots both (relative difference 0).
# Usage: bash scripts/demo_resume.sh   (CPU, about 3x the default run's time; writes runs/default-* and
# runs/compare-default/, the plot included)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
STOP_AFTER=${STOP_AFTER:-150}
rm -rf runs/default-uninterrupted runs/default-resumed runs/compare-default
"$PY" -m nano_hybrid.train recipe=tiny_cpu run_dir=runs/default-uninterrupted
# second run in its own process group; SIGTERM the whole group (as Slurm or Ctrl-C do) after STOP_AFTER steps
setsid "$PY" -m nano_hybrid.train recipe=tiny_cpu run_dir=runs/default-resumed &
pid=$!
steps() { if [ -f runs/default-resumed/metrics.jsonl ]; then wc -l < runs/default-resumed/metrics.jsonl; else echo 0; fi; }
until [ "$(steps)" -ge "$STOP_AFTER" ]; do
    kill -0 "$pid" 2>/dev/null || { echo "run ended before step $STOP_AFTER" >&2; exit 1; }
    sleep 0.5
done
kill -TERM -- "-$pid"
wait "$pid"   # exit code 0: it finished the step and saved a checkpoint
"$PY" -m nano_hybrid.train recipe=tiny_cpu run_dir=runs/default-resumed   # resumes from its checkpoint
"$PY" scripts/compare_runs.py runs/default-uninterrupted runs/default-resumed --warmup 10 \
    --out runs/compare-default --json runs/compare-default/summary.json
echo "plot: runs/compare-default/loss.png"
