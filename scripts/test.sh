#!/usr/bin/env bash
# The README's test command (also what CI runs): set up .venv, then pytest on CPU (GPU tests are
# marked and skipped without CUDA). With no arguments pytest runs tests/ (pyproject testpaths);
# arguments go to pytest, e.g.  bash scripts/test.sh tests/test_data.py -x
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_venv.sh
python -m pytest -q "$@"
