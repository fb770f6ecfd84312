"""Trained model -> Hugging Face export -> transformers: the same next-token losses on a held-out batch.

    python scripts/hf_check.py                                   # one H200: model=nano30b_slice, bf16, 5 steps
    python scripts/hf_check.py model=tiny train.device=cpu       # CPU smoke run (fp32)

Trains ``--steps`` optimizer steps exactly as ``python -m nano_hybrid.train`` (``runconfig.validate`` -> ``Trainer.build`` ->
``train_loop``; mock data, no W&B, no checkpoint), exports the model in memory with the same mapping as
``python -m nano_hybrid.export_hf`` (``nano_hybrid.hf.export_model``, --dtype, default bf16 on GPU), frees
the training state, loads the folder with transformers' ``NemotronHForCausalLM`` (bf16 on GPU; mamba-ssm
kernels when installed, else its PyTorch path) and compares per-token next-token losses on the next,
unseen batch of the data stream with our model's (evaluated before the export, in the training dtype).

Prints one JSON line: mean losses, their absolute/relative difference, max/mean per-token loss difference,
argmax agreement of the logits, timings, and ``pass`` (relative difference of the mean loss <= --rtol,
default 1e-2 for bf16, 1e-4 for fp32). Exit code 0 pass, 1 fail, 2 bad input. Hydra overrides follow the
--flags. Expected on one H200 (nano30b_slice, seq 4096): ~2-3 minutes, most of it start-up and the export.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from nano_hybrid.bench import reporting, training
from nano_hybrid.errors import EXIT_BAD_INPUT


GPU_DEFAULTS = ["model=nano30b_slice", "kernels=mamba_ssm", "parallel=single", "data=mock", "train.device=cuda",
                "train.precision=bf16", "train.seq_length=4096", "train.micro_batch_size=1",
                "train.global_batch_size=4", "optim.warmup_iters=1", "train.log_interval=1"]
CPU_DEFAULTS = ["model=tiny", "kernels=torch", "parallel=single", "data=mock", "train.device=cpu",
                "train.seq_length=128", "train.micro_batch_size=2", "train.global_batch_size=4",
                "optim.warmup_iters=1", "train.log_interval=1"]


def _token_losses(logits, labels):
    import torch

    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="training steps before the export (default 5)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="export dtype (default: the training dtype)")
    ap.add_argument("--rtol", type=float, default=None, help="pass bound on |mean loss difference| / mean loss")
    ap.add_argument("--out", default=None,
                    help="export folder, new or empty (default: a temporary folder, removed afterwards)")
    return reporting.parse_args_with_overrides(ap, argv)


def train_and_export(cfg, plan, out_dir: str, export_dtype: str, res: dict) -> dict:
    """Trains ``cfg.train.train_iters`` steps, evaluates our model on the next (unseen) micro-batch, exports it
    to ``out_dir`` and frees the training state: the batch's tokens, labels, mask, our per-token losses and
    argmax."""
    import torch

    from nano_hybrid.hf import export_model

    ctx = training.setup(cfg, plan)
    ctx.start_data()
    training.train_loop(ctx)
    res["train_losses"] = [json.loads(x)["loss"] for x in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    batch = next(ctx.data_iterator)  # the next micro-batch of the stream: not trained on
    dev = plan.device
    tokens, labels = batch["tokens"].to(dev), batch["labels"].to(dev)
    mask = batch["loss_mask"].to(dev).float()
    fwd = ctx.model.module  # inside DDP: Float16Module (bf16) or the model
    fwd.eval()
    with torch.no_grad():
        ours_logits = fwd(tokens, batch["position_ids"].to(dev), ctx.attention_mask)
    ours = {"tokens": tokens, "labels": labels, "mask": mask, "token_losses": _token_losses(ours_logits, labels),
            "argmax": ours_logits.argmax(-1)}
    del ours_logits
    t0 = time.perf_counter()
    export_model(training.unwrap_model(ctx.model), cfg, out_dir, dtype=export_dtype)
    res["export_s"] = time.perf_counter() - t0
    res["export_gb"] = sum(f.stat().st_size for f in Path(out_dir).glob("*.safetensors")) / 1e9
    training.shutdown(ctx)
    del ctx, fwd
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return ours


def compare_with_transformers(out_dir: str, export_dtype: str, dev, ours: dict, rtol: float, res: dict) -> None:
    """Loads the export with transformers' ``NemotronHForCausalLM`` and records its per-token losses on our
    batch against ours (``res``: the differences, argmax agreement and ``pass``)."""
    import torch
    from transformers import NemotronHForCausalLM

    try:
        import mamba_ssm  # noqa: F401

        kernels = dev.type == "cuda"
    except ImportError:
        kernels = False
    t0 = time.perf_counter()
    hf_dtype = torch.bfloat16 if export_dtype == "bf16" else torch.float32
    hf, info = NemotronHForCausalLM.from_pretrained(out_dir, dtype=hf_dtype, use_mamba_kernels=kernels,
                                                    output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"transformers did not load every tensor: {bad}")
    hf = hf.to(dev).eval()
    res["hf_load_s"] = time.perf_counter() - t0
    res["hf_mamba_kernels"] = kernels
    with torch.no_grad():
        hf_logits = hf(ours["tokens"]).logits
    hf_tok = _token_losses(hf_logits, ours["labels"])
    mask, ours_tok = ours["mask"], ours["token_losses"]
    n = mask.sum()
    ours_mean, hf_mean = float((ours_tok * mask).sum() / n), float((hf_tok * mask).sum() / n)
    d = (ours_tok - hf_tok).abs() * mask
    res.update(
        ours_loss=ours_mean,
        hf_loss=hf_mean,
        abs_diff=abs(ours_mean - hf_mean),
        rel_diff=abs(ours_mean - hf_mean) / abs(ours_mean),
        token_loss_max_abs_diff=float(d.max()),
        token_loss_mean_abs_diff=float(d.sum() / n),
        argmax_agreement=float(((ours["argmax"] == hf_logits.argmax(-1)).float() * mask).sum() / n),
        tokens=int(n),
        rtol=rtol,
    )
    res["pass"] = res["rel_diff"] <= rtol


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    from nano_hybrid.config import ConfigError, compose
    from nano_hybrid.hf.bridge import HFBridgeError, check_out_dir

    if a.steps < 1:
        print("error: --steps must be >= 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    if a.out is not None:
        try:
            check_out_dir(a.out)
        except HFBridgeError as e:
            print(f"error: --out {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
    defaults = GPU_DEFAULTS if torch.cuda.is_available() else CPU_DEFAULTS
    try:
        cfg = compose([*defaults, f"train.train_iters={a.steps}", *a.overrides])
        training.detach_from_run_state(cfg)
        plan = training.validate(cfg)
    except Exception as e:  # noqa: BLE001 - every validation failure is bad input: one line, exit 2
        if isinstance(e, (ConfigError, ValueError)) or type(e).__name__.endswith("Error"):
            print(f"error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        raise
    export_dtype = a.dtype or ("bf16" if plan.dtype == torch.bfloat16 else "fp32")
    rtol = a.rtol if a.rtol is not None else (1e-2 if export_dtype == "bf16" or plan.dtype == torch.bfloat16 else 1e-4)
    out_dir = a.out or tempfile.mkdtemp(prefix="hf_check_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    if a.out is None:
        os.rmdir(out_dir)  # export_model wants a new or empty folder; it creates it
    res: dict = {"model": str(cfg.model.name), "backend": plan.backend_name, "train_dtype": str(plan.dtype).removeprefix("torch."),
                 "export_dtype": export_dtype, "steps": a.steps, "seq_length": plan.seq_length}
    t_all = time.perf_counter()
    with training.scratch_run_dir(cfg, "hf_check_"):
        ours = train_and_export(cfg, plan, out_dir, export_dtype, res)
    try:
        compare_with_transformers(out_dir, export_dtype, plan.device, ours, rtol, res)
    finally:
        if a.out is None:
            shutil.rmtree(out_dir, ignore_errors=True)
    res["total_s"] = time.perf_counter() - t_all
    print(json.dumps(res), flush=True)
    return 0 if res["pass"] else 1
