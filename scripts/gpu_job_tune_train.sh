#!/usr/bin/env bash
# One H200 job (~8 min): offline install, Helion config search for the slowest kernels at the Nano
# shape, the attention/MoE fast-module check, and a short nano30b_slice training run on mamba_ssm.
# Everything lands in $OUT/results.tgz (tuned configs under kernels/configs/sm90/, logs, JSON).
#   OUT=/tmp/out WHEELS=.gpu bash scripts/gpu_job_tune_train.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-benchmarks/results/h200}"; mkdir -p "$OUT"
R=/tmp/job; rm -rf "$R"; mkdir -p "$R"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${WHEELS:-.gpu}"/*.whl > "$R/install.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD
OUT="$R" timeout "${TUNE_S:-230}" python3 scripts/tune_kernels.py --shapes nano --budget-s "$(( ${TUNE_S:-230} - 20 ))" \
  --kernels "${TUNE_KERNELS:-ssd_bwd_dbc,ssd_bwd_dx,ssd_chunk_state_passing,ssd_bwd_dz_dstates,ssd_chunk_scan,rmsnorm_bwd,ssd_bmm_chunk,ssd_chunk_cumsum,conv1d_fwd,conv1d_bwd,rmsnorm_fwd}" \
  > "$R/tune.log" 2>&1; echo "tune rc=$?"; grep -i "winner" "$R/tune.log" | tail -12
OUT="$R" timeout 100 python3 scripts/check_fast_modules_gpu.py --no-reference-timing > "$R/fast_modules.log" 2>&1; echo "fast rc=$?"; grep -i "timing\|pass\|fail" "$R/fast_modules.log" | tail -6
timeout "${TRAIN_S:-170}" python3 -m nano_hybrid.train model=nano30b_slice kernels.backend=mamba_ssm data=default \
  train.train_iters=200 optim.warmup_iters=20 train.micro_batch_size=2 train.global_batch_size=2 train.seq_length=8192 \
  train.precision=bf16 train.device=cuda train.log_interval=10 train.exit_after_minutes=$(python3 -c "print(round((${TRAIN_S:-170}-40)/60,2))") \
  checkpoint.interval=0 checkpoint.save_on_exit=false checkpoint.load=none logger.wandb.mode=disabled \
  run_dir="$R/train_nano30b_slice_mamba_ssm" > "$R/train.log" 2>&1; echo "train rc=$?"; tail -4 "$R/train.log"
cp -r kernels/configs "$R/configs_after" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$R" .
ls -la "$OUT"
