#!/usr/bin/env bash
# Create ./.venv (Python 3.11) and install nano-hybrid with its test extras; sourced by quickstart.sh
# and test.sh. Re-running is cheap: the install is skipped while pyproject.toml is unchanged.
# torch is installed first with an exact pin: an unpinned `pip install torch` pulls GBs of CUDA wheels.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3.11}"
VENV="${NANO_HYBRID_VENV:-$ROOT/.venv}"
TORCH_PIN="torch==2.13.0"

if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "error: $PYTHON not found (nano-hybrid needs Python 3.11; set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.nano_hybrid_installed"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet "$TORCH_PIN"
  "$VENV/bin/python" -m pip install --quiet -e "$ROOT[test]"
  echo "$want" > "$stamp"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
