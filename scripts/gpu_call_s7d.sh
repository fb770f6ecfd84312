#!/usr/bin/env bash
# Session 7, call 4 (docs/GPU_RUNBOOK.md, "Session 7"): what call 3 left: the whole-forward A/B with its per-kernel rows
# (bench_ssd_fwd.py's chunk_scan row now gives the Helion arm its bf16 CB), the 50-step loss match with a longer
# stage (call 3's wrote PASS, then ran past its 110 s), the mixer op at seqlen 4096 x batch 4. Two H200s (<= 5 min).
#     OUT=/tmp/o WHEELHOUSE=.gpu bash scripts/gpu_call_s7d.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=gpu_stages.sh
source scripts/gpu_stages.sh
TOTAL_S="${TOTAL_S:-300}"
gpu_call_begin || exit 1

track0() {
    export CUDA_VISIBLE_DEVICES=0
    stage_table track0_stages.tsv
    run_stage ssd_fwd 200 python3 scripts/bench_ssd_fwd.py --rounds 5 --iters 8
}

track1() {
    export CUDA_VISIBLE_DEVICES=1
    stage_table track1_stages.tsv
    run_stage loss_match 170 python3 scripts/backend_loss_match.py --backends torch,helion,mamba_ssm,torch --steps 50 --quiet
    run_stage ab_l4096 100 python3 scripts/bench_kernels.py --backend mamba_ssm --compare helion --shape l4096b4 --rounds 3 --iters 8
}

finish_tracks 30 20
