#!/usr/bin/env bash
# Session 9, call 4 (docs/GPU_RUNBOOK.md, "Session 9"), kind nvidia-h200-x2: the control for calls 1-2's convergence
# runs. Repeats of one backend stay within 0.02% of each other (their kernels are bitwise repeatable or nearly), so
# they cannot show what an equally correct but numerically different implementation does to the curve. Two such
# implementations, same recipe (convergence_ab_h200_2000_lowlr), seed and data, no resume:
#   GPU 0: helion with fp32 recomputed states and dstates in its backward (NANO_HELION_BWD_STATES/DSTATES=fp32);
#   GPU 1: torch, the pure-PyTorch kernels (the SSD in fp32), the reference of the op-level tests.
# (The two variables only affect the helion arm.)
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s9d.sh
set -u
cd "$(dirname "$0")/.."
export NANO_HELION_BWD_STATES=fp32 NANO_HELION_BWD_DSTATES=fp32
RECIPE="${RECIPE:-convergence_ab_h200_2000_lowlr}" BACKENDS="helion torch" LABELS="helion_fp32st torch" STOP_AT=0 \
    EXTRA="checkpoint.save_on_exit=false" LIMIT_S="${LIMIT_S:-480}" TAG="${TAG:-ctl_s9}" \
    exec bash scripts/gpu_call_convergence.sh
