"""A parallel=pp2 run (two pipeline stages, gloo) saves a checkpoint and resumes from it: the checkpoint's model
signature covers both stages' layers, so the resumed run loads it and continues to the last step."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OVERRIDES = ["model=tiny", "model.hybrid_override_pattern=M*EM*E", "kernels.backend=torch", "data=mock",
             "model.seq_length=32", "train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=4",
             "train.device=cpu", "optim.warmup_iters=1", "logger.wandb.mode=disabled", "parallel=pp2",
             "checkpoint.interval=2", "checkpoint.save_on_exit=false", "optim.lr_decay_iters=3"]


def _torchrun(run_dir, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "nano_hybrid.train", *OVERRIDES, f"run_dir={run_dir}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_pp2_run_resumes_from_its_checkpoint(tmp_path):
    run = tmp_path / "run"
    r = _torchrun(run, "train.train_iters=2")
    assert r.returncode == 0, r.stderr[-2000:]
    meta = json.loads((run / "checkpoints" / "iter_0000002" / "nano_hybrid_checkpoint.json").read_text())
    layers = {k.split(".")[2] for k in meta["model_signature"] if k.startswith("decoder.layers.")}
    assert layers == {str(i) for i in range(6)}, sorted(layers)  # both stages' layers, global numbering
    r = _torchrun(run, "train.train_iters=3")
    assert r.returncode == 0, r.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
