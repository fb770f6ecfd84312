#!/usr/bin/env bash
# Offline install of nano-hybrid's GPU dependencies from a wheelhouse folder (no package index needed).
#
#   source scripts/gpu_setup.sh [WHEELHOUSE_DIR ...]
#
# Every folder's wheels install together (an argument, or $WHEELHOUSE, may also list folders separated by ':').
# WHEELHOUSE_DIR defaults to $WHEELHOUSE, else the first of shared/wheelhouse/gpu-cp312-torch2.11-cu130
# inside the checkout or ../shared/wheelhouse/gpu-cp312-torch2.11-cu130 beside it
# (wheels for Python 3.12 / torch 2.11.0+cu130 / triton 3.6: mamba-ssm 2.3.2.post1 (Triton kernels only),
# causal-conv1d 1.7.0 (sm_90), megatron-core 0.16.1, helion 1.5.0, hydra-core, omegaconf, ...).
# The host must already have torch, triton, numpy, einops, rich and psutil: nothing here installs torch.
# Wheels go into ./site (git-ignored) with --no-deps; PYTHONPATH is set to ./site:. for this shell.
# mamba-ssm built without CUDA lacks the Mamba-1 `selective_scan_cuda` module: kernels/registry.py
# (import_mamba_ssm) registers a placeholder for it before importing mamba_ssm, nothing else does.
# train.fp8 needs torchao: put torchao-0.17.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl (the
# release paired with torch 2.11) into the wheelhouse folder; it installs with the others (a wheel that SHA256SUMS
# does not list is installed unchecked). Without it train.fp8=none runs and train.fp8=... fails at validation.
# wandb (W&B offline runs) has a wheelhouse of its own (gpu-wandb-cp312): give it as a second folder; without it,
# keep logger.wandb.mode=disabled.
# Run as a script instead of sourcing it to only install and check; then export PYTHONPATH yourself.

_nh_setup() {
    local repo wh py arg part
    local -a whs=() wheels=()
    repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    local -a args=("$@")
    [ "${#args[@]}" -eq 0 ] && [ -n "${WHEELHOUSE:-}" ] && args=("$WHEELHOUSE")
    for arg in "${args[@]}"; do  # each argument may hold several folders, separated by ':'
        IFS=: read -ra part <<< "$arg"
        whs+=("${part[@]}")
    done
    if [ "${#whs[@]}" -eq 0 ]; then
        for wh in "$repo/shared/wheelhouse/gpu-cp312-torch2.11-cu130" "$repo/../shared/wheelhouse/gpu-cp312-torch2.11-cu130"; do
            [ -d "$wh" ] && break
        done
        whs=("$wh")
    fi
    py="${PYTHON:-python3}"
    if ! "$py" -c "import torch, triton" 2>/dev/null; then
        echo "gpu_setup: $py cannot import torch and triton; install the CUDA build of torch first (this script never does)" >&2
        return 1
    fi
    for wh in "${whs[@]}"; do
        if [ ! -d "$wh" ]; then
            echo "gpu_setup: wheelhouse folder not found: $wh" >&2; return 1
        fi
        wh="$(cd "$wh" && pwd)"
        if ! ls "$wh"/*.whl >/dev/null 2>&1; then
            echo "gpu_setup: no .whl files in $wh" >&2; return 1
        fi
        if [ -f "$wh/SHA256SUMS" ]; then
            (cd "$wh" && sha256sum --quiet -c SHA256SUMS) || { echo "gpu_setup: checksum mismatch in $wh" >&2; return 1; }
        fi
        wheels+=("$wh"/*.whl)
    done
    local stamp="$repo/site/.wheelhouse-stamp"
    local want
    want="$(for w in "${wheels[@]}"; do basename "$w"; done | sort | tr '\n' ' ')"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        echo "gpu_setup: $repo/site already holds these wheels"
    else
        rm -rf "$repo/site"
        "$py" -m pip install -q --no-index --no-deps --no-compile --target "$repo/site" "${wheels[@]}" \
            || { echo "gpu_setup: pip install from ${whs[*]} failed" >&2; return 1; }
        echo "$want" > "$stamp"
    fi
    export PYTHONPATH="$repo/site:$repo${PYTHONPATH:+:$PYTHONPATH}"
    (cd "$repo" && "$py" - <<'PY'
import torch
import megatron.core, hydra, omegaconf, helion  # noqa: F401
from kernels.registry import available_backends
print(f"gpu_setup: torch {torch.__version__}, cuda available {torch.cuda.is_available()}, "
      f"megatron-core {megatron.core.__version__}")
try:
    import torchao
    print(f"gpu_setup: torchao {torchao.__version__} (train.fp8)")
except ImportError:
    print("gpu_setup: torchao not installed (train.fp8 needs it)")
for name, why in available_backends().items():
    print(f"gpu_setup: kernel backend {name}: {'ok' if why is None else why}")
PY
    ) || { echo "gpu_setup: import check failed" >&2; return 1; }
    echo "gpu_setup: PYTHONPATH=$PYTHONPATH"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    set -euo pipefail
    _nh_setup "$@"
else
    _nh_setup "$@"
fi
