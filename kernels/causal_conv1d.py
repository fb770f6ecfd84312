"""Causal depthwise conv1d (+SiLU) as the fused Mamba-2 path uses it.

Semantics follow causal-conv1d 1.7.0 ``causal_conv1d_fn``: ``x`` is (batch, dim, seqlen) — in the
fused path a channel-last view of zxBCdt (``x.stride(1) == 1``) — ``weight`` is (dim, width),
``out[b, d, t] = act(bias[d] + sum_k weight[d, k] * x[b, d, t - (width - 1) + k])`` with zero
left padding. With ``seq_idx`` (batch, seqlen) (packed sequences), inputs from a position whose
``seq_idx`` differs from the output position's contribute zero, and positions with a negative ``seq_idx``
(padding) output 0.

This module holds the torch reference and ``docs_seq_idx`` (the seq_idx of equal packed documents that the tuning
cases and benchmarks use); the Helion kernels and their autograd wiring are in ``kernels/causal_conv1d_helion.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Reference causal depthwise conv1d; computes in fp32 (fp64 for fp64 input), returns ``x.dtype``."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"expected x (b, d, l) and weight (d, w); got {tuple(x.shape)} and {tuple(weight.shape)}")
    dtype = x.dtype
    b, d, l = x.shape
    w = weight.shape[1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    wf = weight.to(acc)
    if seq_idx is None:
        out = F.conv1d(xf, wf.unsqueeze(1), None if bias is None else bias.to(acc), padding=w - 1, groups=d)[..., :l]
    else:
        if seq_idx.shape != (b, l):
            raise ValueError(f"seq_idx must be (batch, seqlen) = {(b, l)}, got {tuple(seq_idx.shape)}")
        xp = F.pad(xf, (w - 1, 0))
        sp = F.pad(seq_idx, (w - 1, 0), value=-1)
        out = torch.zeros(b, d, l, dtype=acc, device=x.device)
        for k in range(w):
            same = (sp[:, k : k + l] == seq_idx).unsqueeze(1)  # (b, 1, l)
            out = out + wf[:, k].view(1, d, 1) * xp[:, :, k : k + l] * same
        if bias is not None:
            out = out + bias.to(acc).view(1, d, 1)
    if activation in ("silu", "swish"):
        out = F.silu(out)
    if seq_idx is not None:
        out = torch.where((seq_idx >= 0).unsqueeze(1), out, 0.0)  # padding positions: 0, as causal-conv1d
    return out.to(dtype)


def docs_seq_idx(b: int, l: int, total: int, docs: int, device=None) -> torch.Tensor | None:
    """(b, total) int32 ids of ``docs`` equal documents in each sequence of length ``l``, the positions past ``l``
    repeating the last id (as the fused op pads seq_idx to whole chunks); None for one document."""
    if docs <= 1:
        return None
    ids = (torch.arange(total).clamp(max=l - 1) * docs // l).to(torch.int32)
    return ids.to(device).expand(b, -1).contiguous()
