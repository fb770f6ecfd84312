"""NaN/Inf policy of the optimizer step: a non-finite loss or gradient norm skips the update.

megatron-core's optimizers skip an update only when the fp16 grad scaler finds an inf/NaN; in bf16 and
fp32 (no grad scaler) a NaN gradient is applied and poisons the weights. :func:`guarded_step` runs the
step of any megatron optimizer (one, or a ChainedOptimizer) through the same stages as
``ChainedOptimizer.step`` -- ``prepare_grads`` (its fp16 inf check included), the global gradient norm,
clipping by that norm, ``step_with_ready_grads`` -- and skips the update when the loss or the norm is not
finite. Every rank takes the same decision: the loss is all-reduced before the call and the norm is
reduced over the gradient-statistics group inside megatron. A skipped step leaves weights, optimizer
state and LR schedule untouched and is counted in ``metrics.jsonl`` as ``skipped`` (as Megatron does);
:class:`SkipCounter` stops the run after ``train.max_skipped_steps`` consecutive skips.
"""

from __future__ import annotations

import math

import torch

from nano_hybrid.errors import EXIT_FAILED, RunError


class TrainingDivergedError(RunError):
    """Too many consecutive skipped steps; the last good checkpoint is left as it is."""

    exit_code = EXIT_FAILED


def _finite(x) -> bool:
    if x is None:
        return False
    if isinstance(x, torch.Tensor):
        x = x.item()
    return math.isfinite(float(x))


@torch.no_grad()
def guarded_step(optimizer, loss: float) -> tuple[bool, float]:
    """One optimizer step unless ``loss`` or the gradient norm is non-finite; returns (updated, grad_norm)."""
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    if optimizer.prepare_grads():  # fp16: the grad scaler found inf/NaN (and lowered its scale)
        return False, float("nan")
    grad_norm = optimizer.get_grad_norm()
    grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        return False, grad_norm
    parts = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    for o in parts:
        if getattr(o, "is_stub_optimizer", False):
            continue
        params = o.get_parameters()
        if params and o.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(
                params,
                max_norm=o.config.clip_grad,
                total_norm=grad_norm,
                use_decoupled_grad=o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )
    return bool(optimizer.step_with_ready_grads()), grad_norm


class SkipCounter:
    """Counts consecutive skipped steps; raises TrainingDivergedError at ``limit`` (None: never)."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.consecutive = 0
        self.total = 0

    def update(self, skipped: bool, step: int, rec: dict) -> None:
        if not skipped:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.total += 1
        if self.limit is not None and self.consecutive >= self.limit:
            raise TrainingDivergedError(
                f"{self.consecutive} consecutive steps skipped (non-finite loss or gradient norm; step {step}: "
                f"loss {rec.get('loss')}, grad_norm {rec.get('grad_norm')}); stopping at train.max_skipped_steps="
                f"{self.limit}; the last checkpoint is intact (resume from it with a lower optim.lr or other data)",
                collective=True,
            )
