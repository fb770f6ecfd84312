#!/usr/bin/env bash
# The README's default run, from a fresh clone: set up .venv, build the stdlib corpus if absent
# (data/stdlib/), train model=tiny on CPU for 300 steps (recipe tiny_cpu) and print the loss falling.
# Extra arguments are Hydra overrides, e.g.  bash scripts/quickstart.sh train.train_iters=50
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_venv.sh
python -m nano_hybrid.train recipe=tiny_cpu "$@"
