#!/usr/bin/env bash
# Create ./.venv (Python 3.11) and install nano-hybrid with its test extras; sourced by quickstart.sh
# and test.sh. Re-running is cheap: the install is skipped while pyproject.toml is unchanged.
# torch comes first: a torch already in the venv is kept when it satisfies pyproject's range; on a machine without
# an NVIDIA GPU it is PyTorch's CPU build (from PyTorch's CPU index, TORCH_CPU_INDEX, or a wheel folder pip is
# configured with); with a GPU it is the CUDA build from PyPI (several GB).
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
  if "$VENV/bin/python" -c 'import sys, torch; from packaging.version import Version as V; v = V(torch.__version__.split("+")[0]); sys.exit(not V("2.11") <= v <= V("2.13.0"))' >/dev/null 2>&1; then
    echo "keeping the installed torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install --quiet "$TORCH_PIN"
  else
    # the +cpu build sorts above PyPI's CUDA build of the same version; an unreachable index is skipped
    "$VENV/bin/python" -m pip install --quiet "$TORCH_PIN" --retries 0 --timeout 15 \
      --extra-index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
  fi
  "$VENV/bin/python" -m pip install --quiet -e "$ROOT[test]"
  echo "$want" > "$stamp"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
