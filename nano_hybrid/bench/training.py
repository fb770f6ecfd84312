"""The benchmarks' one use of the training API (``nano_hybrid.runconfig``, ``nano_hybrid.trainer``): validate a
config into a run plan, build a Trainer (model, Megatron DDP, optimizer, data), draw and replay its batches, build a
model per arm, take one step (timed or not), tear it down. Every other module of the package reaches training through
these functions.

The Trainer and the run plan (``RunPlan``) they return are read elsewhere by attribute: ``ctx.cfg``, ``ctx.model``,
``ctx.optimizer``, ``ctx.attention_mask``, ``ctx.flops_per_token``; ``plan.device``, ``plan.dtype``,
``plan.dims`` (rank, world size), ``plan.num_microbatches``, ``plan.seq_length``, ``plan.backend_name``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import shutil
import tempfile
import time

from nano_hybrid.bench import stats


def _trainer():
    """``nano_hybrid.trainer``, imported on first use (megatron and the model are heavy imports)."""
    from nano_hybrid import trainer

    return trainer


# --------------------------------------------------------------------------------------- config and run
def validate(cfg):
    """The run plan of ``cfg`` (config, data, first backend, parallel sizes checked): fails early."""
    from nano_hybrid import runconfig

    return runconfig.validate(cfg)


def validate_optim(optim_cfg, train_iters: int) -> None:
    """``optim`` checked as ``validate`` checks the composed config's."""
    from nano_hybrid import runconfig

    runconfig.validate_optim(optim_cfg, train_iters)


def init_distributed(plan, cfg) -> None:
    _trainer().init_distributed(plan, cfg)


def setup(cfg, plan, *, with_optimizer: bool = True):
    """The Trainer: model, Megatron DDP, optimizer (unless ``with_optimizer=False``), data."""
    return _trainer().Trainer.build(cfg, plan, with_optimizer=with_optimizer)


def shutdown(ctx) -> None:
    _trainer().shutdown(ctx)


def train_loop(ctx) -> None:
    """``cfg.train.train_iters`` steps of the training loop (metrics.jsonl in ``cfg.run_dir``)."""
    ctx.fit()


def build_model_and_optimizer(plan, cfg):
    """(model, optimizer, scheduler) for ``cfg`` exactly as training builds them."""
    return _trainer().build_model_and_optimizer(plan, cfg)


def build_arm(plan, cfg):
    """(model, optimizer, scheduler) for an arm's ``cfg`` (its own ``kernels.backend``) under ``plan``."""
    return _trainer().build_model_and_optimizer(plan.for_backend(cfg), cfg)


def causal_mask_for(cfg, seq_length: int, device):
    """The attention mask training passes to the model (None where the attention builds its own)."""
    return _trainer().causal_mask_for(cfg, seq_length, device)


def cpu_compat_mode(plan):
    """The context training runs the optimizer step in (a no-op on CUDA)."""
    return _trainer().cpu_compat_mode(plan)


# ------------------------------------------------------------------------------------------- batches
class ReplayIterator:
    """Yields a fixed list of micro-batches over and over (so every block sees the same batches)."""

    def __init__(self, batches: list):
        if not batches:
            raise ValueError("ReplayIterator needs at least one batch")
        self.batches = batches
        self._it = itertools.cycle(batches)

    def reset(self):
        self._it = itertools.cycle(self.batches)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._it)


def draw_batches(ctx, n: int) -> list:
    """Starts ``ctx``'s data and draws its next ``n`` micro-batches."""
    ctx.start_data()
    return [next(ctx.data_iterator) for _ in range(n)]


def replay(ctx, batches: list) -> ReplayIterator:
    """``ctx`` reads ``batches`` over and over from now on; the iterator (``reset()`` restarts it)."""
    it = ReplayIterator(batches)
    ctx.data_iterator = it
    return it


def drop_model(ctx) -> None:
    """``ctx`` lets go of its model, optimizer and scheduler (an arm builds its own)."""
    ctx.model = ctx.optimizer = ctx.scheduler = None


def bare_context(plan, cfg, model, optimizer, scheduler, data_iterator):
    """A Trainer around a model built outside ``Trainer.build`` (no data loader, no run directory, no attention
    mask): what ``forward_backward`` needs."""
    T = _trainer()
    return T.Trainer(cfg=cfg, plan=plan, run_dir=None, model=model, optimizer=optimizer, scheduler=scheduler,
                     dataset=None, state=T.TrainState(), logger=None, flops_per_token=0.0, attention_mask=None,
                     data_iterator=data_iterator)


def with_parts(ctx, batches: list, **parts):
    """A copy of ``ctx`` reading ``batches`` once, with ``parts`` (cfg, model, optimizer, scheduler) replaced."""
    return dataclasses.replace(ctx, data_iterator=iter(batches), **parts)


# --------------------------------------------------------------------------------------------- steps
def train_step(ctx) -> dict[str, float]:
    """One full optimizer step over one global batch: loss, grad_norm, lr, skipped."""
    return ctx.train_step()


def forward_backward(ctx) -> list:
    """Forward and backward over one global batch (no optimizer step): the per-micro-batch loss reports."""
    return ctx.forward_backward()


def fwd_bwd_step(ctx) -> dict[str, float]:
    """Forward and backward over one global batch, no optimizer step (``--fwd-bwd-only``): the loss only."""
    import torch
    import torch.distributed as dist

    reports = forward_backward(ctx)
    acc = torch.zeros(2, dtype=torch.float64, device=ctx.plan.device)
    for r in reports:
        acc += r["lm loss"].to(torch.float64)
    if dist.is_initialized():
        dist.all_reduce(acc)
    return {"loss": (acc[0] / acc[1].clamp(min=1)).item()}


def timed_step(step_fn, ctx, device) -> tuple[float, dict]:
    """(seconds, output) of ``step_fn(ctx)``, the device synchronized before and after."""
    stats.sync(device)
    t0 = time.perf_counter()
    out = step_fn(ctx)
    stats.sync(device)
    return time.perf_counter() - t0, out


# ------------------------------------------------------------------------------------ run state
def detach_from_run_state(cfg) -> None:
    """No W&B run, no checkpoint loaded, none saved: a measurement must neither read nor touch a real run's state."""
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.logger.wandb.mode = "disabled"
        cfg.checkpoint.load = "none"
        cfg.checkpoint.interval = 0
        cfg.checkpoint.save_on_exit = False


@contextlib.contextmanager
def scratch_run_dir(cfg, prefix: str):
    """A temporary ``cfg.run_dir`` (setup() writes config.yaml there) for the ``with`` block, removed afterwards;
    a run_dir the user set is kept as it is."""
    from omegaconf import open_dict

    own = cfg.run_dir is None
    if own:
        with open_dict(cfg):
            cfg.run_dir = tempfile.mkdtemp(prefix=prefix)
    try:
        yield cfg.run_dir
    finally:
        if own:
            shutil.rmtree(cfg.run_dir, ignore_errors=True)


def unwrap_model(model):
    """The MambaModel inside megatron DDP (and Float16Module on bf16)."""
    m = model
    while hasattr(m, "module"):
        m = m.module
    return m
