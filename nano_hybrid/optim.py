"""Which torch AdamW implementation megatron's optimizer steps with (``optim.fused``).

Without Transformer Engine or Apex, megatron-core 0.16.1's ``get_megatron_optimizer`` builds a plain
``torch.optim.AdamW(params, lr=, weight_decay=, betas=, eps=)`` over the fp32 main parameters, so torch
picks its default implementation: ``foreach`` (multi-tensor kernels, several passes over the 2.7B fp32
parameters and states) on CUDA, the per-parameter loop on CPU.

``optim.fused=true`` switches every inner AdamW to torch's ``fused=True`` implementation (one fused
kernel per parameter chunk: the same AdamW update, decoupled weight decay, bias correction), after
megatron built it and again after every ``load_state_dict`` (a checkpoint's saved param groups carry
the implementation flags of the run that wrote them). ``false`` leaves torch's default.
"""

from __future__ import annotations

import torch


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
