"""Gated grouped RMSNorm (the norm Megatron's MambaMixer applies after the SSD).

Semantics follow ``mamba_ssm.ops.triton.layernorm_gated`` (mamba-ssm 2.3.2):
  * ``norm_before_gate=False``: ``y = rmsnorm(x * silu(z)) * weight``
  * ``norm_before_gate=True``:  ``y = rmsnorm(x) * weight * silu(z)``
  * ``group_size``: the RMS statistic is taken over contiguous groups of ``group_size`` channels.

This module holds the torch reference (``rmsnorm_gated_ref`` / ``RMSNormGatedRef``); the Helion kernels and their
autograd wiring are in ``kernels/rmsnorm_gated_helion.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rmsnorm_gated_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    eps: float = 1e-6,
    group_size: int | None = None,
    norm_before_gate: bool = True,
    upcast: bool = True,
) -> torch.Tensor:
    """Reference gated grouped RMSNorm over the last dim; computes in fp32 (fp64 for fp64 input) with ``upcast``."""
    dtype = x.dtype
    n = x.shape[-1]
    if group_size is None:
        group_size = n
    if n % group_size != 0:
        raise ValueError(f"hidden size {n} is not a multiple of group_size {group_size}")
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = weight.to(acc) if upcast else weight
    b = None if bias is None else (bias.to(acc) if upcast else bias)
    if upcast:
        x = x.to(acc)
        z = None if z is None else z.to(acc)
    if z is not None and not norm_before_gate:
        x = x * F.silu(z)
    xg = x.reshape(*x.shape[:-1], n // group_size, group_size)
    rstd = torch.rsqrt(xg.square().mean(dim=-1, keepdim=True) + eps)
    out = (xg * rstd).reshape(x.shape) * w
    if b is not None:
        out = out + b
    if z is not None and norm_before_gate:
        out = out * F.silu(z)
    return out.to(dtype)


class _RMSNormGatedModule(nn.Module):
    """``mamba_ssm.ops.triton.layernorm_gated.RMSNorm``'s constructor, parameter and init; subclasses
    give ``forward(x, z=None)``."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)


class RMSNormGatedRef(_RMSNormGatedModule):
    """Drop-in for ``mamba_ssm.ops.triton.layernorm_gated.RMSNorm`` built on the torch reference."""

    def forward(self, x, z=None):
        return rmsnorm_gated_ref(
            x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
            norm_before_gate=self.norm_before_gate,
        )
