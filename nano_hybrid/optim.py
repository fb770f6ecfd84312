"""Which torch AdamW implementation megatron's optimizer steps with (``optim.fused``), and which multi-tensor ops
its gradient norm, clipping and parameter copies run on (``optim.multi_tensor``).

Without Transformer Engine or Apex, megatron-core 0.16.1's ``get_megatron_optimizer`` builds a plain
``torch.optim.AdamW(params, lr=, weight_decay=, betas=, eps=)`` over the fp32 main parameters, so torch
picks its default implementation: ``foreach`` (multi-tensor kernels, several passes over the 2.7B fp32
parameters and states) on CUDA, the per-parameter loop on CPU.

``optim.fused=true`` switches every inner AdamW to torch's ``fused=True`` implementation (one fused
kernel per parameter chunk: the same AdamW update, decoupled weight decay, bias correction), after
megatron built it and again after every ``load_state_dict`` (a checkpoint's saved param groups carry
the implementation flags of the run that wrote them). ``false`` leaves torch's default.

Without apex or transformer-engine, megatron-core 0.16.1 computes the gradient norm, the clipping and the fp32-main to
bf16-model parameter copies with its local fallbacks (``megatron.core.utils.local_multi_tensor_l2_norm`` /
``local_multi_tensor_scale``): one norm per gradient gathered into a host list (a device sync per tensor), one
multiply and one copy per tensor. ``multi_tensor_ops("foreach")`` (the default, ``optim.multi_tensor``) runs the same
operations as torch's ``_foreach_norm`` / ``_foreach_mul_`` / ``_foreach_copy_`` for the duration of an optimizer
step: the same arithmetic (each tensor's norm, then the norm of the norms, in fp32; products by the same fp32 scale;
bitwise equal on CPU, tested; on CUDA the per-tensor norm may sum in another order, a last-bit difference), a few
multi-tensor launches instead of hundreds of ops. Where apex or transformer-engine supplies the kernels,
megatron's own are left in place.
"""

from __future__ import annotations

import contextlib

import torch

MULTI_TENSOR_OPS = ("foreach", "loop")


def inner_torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron optimizer (``ChainedOptimizer`` or a single one)."""
    chain = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    out = []
    for o in chain:
        inner = getattr(o, "optimizer", o)
        if inner is not None:
            out.append(inner)
    return out


def _apply(opt: torch.optim.Optimizer, fused: bool) -> None:
    for group in opt.param_groups:
        group["fused"] = fused
        group["foreach"] = None if not fused else False
    # the fused kernel reads the step counters on the parameters' device; torch's default (not capturable)
    # keeps them on the host (on the device, each .item() of a step counter would synchronize)
    for p, state in opt.state.items():
        step = state.get("step") if isinstance(state, dict) else None
        if not torch.is_tensor(step):
            continue
        want = p.device if fused else torch.device("cpu")
        if step.device != want and not any(g.get("capturable") for g in opt.param_groups):
            state["step"] = step.to(device=want, dtype=torch.float32)


def set_adam_fused(optimizer, fused: bool) -> int:
    """Pin torch's fused (``True``) or default (``False``) AdamW in every inner torch optimizer of the megatron
    ``optimizer``, now and after each ``load_state_dict`` (calling it again switches). Returns the number of torch optimizers set;
    raises ``TypeError`` if one is not ``torch.optim.AdamW``."""
    opts = inner_torch_optimizers(optimizer)
    for opt in opts:
        if not isinstance(opt, torch.optim.AdamW):
            raise TypeError(f"optim.fused applies to torch.optim.AdamW; megatron built {type(opt).__name__}")
        opt.nano_hybrid_adam_fused = fused
        _apply(opt, fused)
        if not getattr(opt, "nano_hybrid_adam_hook", False):  # once per optimizer; reads the current choice
            opt.register_load_state_dict_post_hook(lambda o: _apply(o, o.nano_hybrid_adam_fused))
            opt.nano_hybrid_adam_hook = True
    return len(opts)


# ------------------------------------------------------------------------------------ multi-tensor ops
def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``multi_tensor_l2norm`` for megatron's ``multi_tensor_applier``: (the l2 norm of all tensors of
    ``tensor_lists[0]`` as a 1-element fp32 tensor on their device, None)."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``multi_tensor_scale``: ``tensor_lists[1][i] = tensor_lists[0][i] * scale`` (a cast copy for scale 1)."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if scale == 1.0:
        torch._foreach_copy_(dst, src)
    elif all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


@contextlib.contextmanager
def multi_tensor_ops(kind: str):
    """Within the block, megatron's local multi-tensor fallbacks are torch's foreach ops (``kind="foreach"``) or
    left as they are (``"loop"``); implementations from apex or transformer-engine are never replaced."""
    if kind not in MULTI_TENSOR_OPS:
        raise ValueError(f"multi-tensor ops {kind!r}; choose {' or '.join(MULTI_TENSOR_OPS)}")
    if kind == "loop":
        yield
        return
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    swaps = ((clip_grads, "l2_norm_impl", mcore_utils.local_multi_tensor_l2_norm, foreach_l2_norm),
             (clip_grads, "multi_tensor_scale_impl", mcore_utils.local_multi_tensor_scale, foreach_scale),
             (mcore_optimizer, "multi_tensor_scale_impl", mcore_utils.local_multi_tensor_scale, foreach_scale))
    done = []
    try:
        for module, name, local, ours in swaps:
            if getattr(module, name, None) is local:
                setattr(module, name, ours)
                done.append((module, name, local))
        yield
    finally:
        for module, name, local in done:
            setattr(module, name, local)


# ------------------------------------------------------------------------------------------ the LR schedule
# What the run's OptimizerParamScheduler is built from: each quantity and the config key(s) that set it.
SCHEDULE_KEYS = {
    "init_lr": "optim.init_lr",
    "lr": "optim.lr",
    "min_lr": "optim.min_lr",
    "warmup_iters": "optim.warmup_iters",
    "decay_iters": "decay steps (optim.lr_decay_iters, else train.train_iters)",
    "decay_style": "optim.decay_style",
    "wsd_decay_iters": "WSD decay steps (optim.wsd_decay_fraction of the decay steps)",
    "wsd_decay_style": "optim.wsd_decay_style",
    "weight_decay": "optim.weight_decay",
}


def lr_schedule(cfg) -> dict:
    """The LR / weight-decay schedule of a run config (``cfg.optim`` and ``cfg.train.train_iters``; a mapping or a
    DictConfig, also a checkpoint's saved config from before ``optim.lr_decay_iters`` existed): the values
    ``nano_hybrid.trainer.build_optimizer`` gives megatron's OptimizerParamScheduler, keyed as ``SCHEDULE_KEYS``.
    The decay runs over ``optim.lr_decay_iters`` steps (null: ``train.train_iters``); WSD decays over its final
    ``wsd_decay_fraction``; steps past the decay stay at ``min_lr``."""
    o, t = cfg["optim"], cfg["train"]
    decay = o.get("lr_decay_iters")
    decay = int(t["train_iters"]) if decay is None else int(decay)
    style = str(o["decay_style"])
    wsd = style == "WSD"
    return {
        "init_lr": float(o["init_lr"]), "lr": float(o["lr"]), "min_lr": float(o["min_lr"]),
        "warmup_iters": int(o["warmup_iters"]), "decay_iters": decay, "decay_style": style,
        "wsd_decay_iters": max(1, round(float(o["wsd_decay_fraction"]) * decay)) if wsd else None,
        "wsd_decay_style": str(o["wsd_decay_style"]) if wsd else None,
        "weight_decay": float(o["weight_decay"]),
    }
