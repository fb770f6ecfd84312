#!/usr/bin/env bash
# Session 9, call 1 (docs/GPU_RUNBOOK.md, "Session 9"), kind nvidia-h200-x2: the convergence A/B of issue 8 at a 4x
# lower peak learning rate (recipe convergence_ab_h200_2000_lowlr), one GPU per arm, each run SIGTERMed after step
# 1000 and resumed; no checkpoint after the last step.
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s9a.sh
set -u
cd "$(dirname "$0")/.."
RECIPE="${RECIPE:-convergence_ab_h200_2000_lowlr}" RESUME_EXTRA="${RESUME_EXTRA:-checkpoint.save_on_exit=false}" \
    LIMIT_S="${LIMIT_S:-540}" TAG="${TAG:-ab_s9}" exec bash scripts/gpu_call_convergence.sh
