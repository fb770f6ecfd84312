#!/usr/bin/env bash
# The README's test command (also what CI runs): set up .venv, then pytest over tests/ on CPU
# (GPU tests are marked and skipped without CUDA). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_venv.sh
python -m pytest -q tests "$@"
