#!/usr/bin/env bash
# Session 9, call 2 (docs/GPU_RUNBOOK.md, "Session 9"), kind nvidia-h200-x2: repeats of call 1's two convergence runs
# (recipe convergence_ab_h200_2000_lowlr, same seed and data), without the resume: helion_b on GPU 0, mamba_ssm_b on
# GPU 1. Against call 1's runs they give the two same-backend controls (helion vs helion_b, mamba_ssm vs
# mamba_ssm_b) and three more cross-backend pairs.
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s9b.sh
set -u
cd "$(dirname "$0")/.."
RECIPE="${RECIPE:-convergence_ab_h200_2000_lowlr}" BACKENDS="helion mamba_ssm" LABELS="helion_b mamba_ssm_b" STOP_AT=0 \
    EXTRA="checkpoint.save_on_exit=false" LIMIT_S="${LIMIT_S:-480}" TAG="${TAG:-rep_s9}" \
    exec bash scripts/gpu_call_convergence.sh
