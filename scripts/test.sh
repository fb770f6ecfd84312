#!/usr/bin/env bash
# The README's test command (also what CI runs): set up .venv, then pytest on CPU (GPU tests are
# marked and skipped without CUDA). With no arguments pytest runs tests/ (pyproject testpaths);
# arguments go to pytest, e.g.  bash scripts/test.sh tests/test_data.py -x
# The tests run in min(cores, 4) pytest-xdist worker processes (about half the time of one process on 2 cores);
# a later -n in the arguments wins, e.g.  bash scripts/test.sh -n 0   (one process).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_venv.sh
# the cores this process may use (not nproc: it follows OMP_NUM_THREADS), at most 4; one core: no workers
workers=$(python -c 'import os; print(min(len(os.sched_getaffinity(0)), 4))')
[ "$workers" -lt 2 ] && workers=0
python -m pytest -q -n "$workers" "$@"
