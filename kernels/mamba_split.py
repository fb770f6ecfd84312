"""The fused op Megatron's MambaMixer calls in training: split -> causal conv1d -> SSD -> gate.

``mamba_split_conv1d_scan_combined_ref`` has mamba-ssm 2.3.2's ``mamba_split_conv1d_scan_combined``
signature and semantics and differentiates through torch autograd (the reference backend).
The Helion autograd Function for the same op lives in ``kernels/mamba_split_helion.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.causal_conv1d import causal_conv1d_ref
from kernels.rmsnorm_gated import rmsnorm_gated_ref
from kernels.ssd import mamba_chunk_scan_combined_ref


def split_dims(zxbcdt: torch.Tensor, conv1d_weight: torch.Tensor, D: torch.Tensor, headdim: int | None, ngroups: int):
    """Infer (nheads, headdim, dim, dstate) from the fused input, as mamba-ssm does; d_nonssm must be 0."""
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("headdim is required when D is per head (1-D)")
        (nheads,) = D.shape
    else:
        nheads, headdim = D.shape
    dim = nheads * headdim
    dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
    d_nonssm = (zxbcdt.shape[-1] - 2 * dim - 2 * ngroups * dstate - nheads) // 2
    if d_nonssm != 0 or dstate <= 0:
        raise ValueError(
            f"zxbcdt width {zxbcdt.shape[-1]} does not match 2*dim + 2*ngroups*dstate + nheads with dim={dim}, "
            f"ngroups={ngroups}, conv channels {conv1d_weight.shape[0]} (extra non-SSM channels are not supported)"
        )
    return nheads, headdim, dim, dstate


def mamba_split_conv1d_scan_combined_ref(
    zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None, seq_idx=None,
    dt_limit=(0.0, float("inf")), return_final_states=False, activation="silu", rmsnorm_weight=None,
    rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None, ngroups=1, norm_before_gate=True,
):
    """zxbcdt (b, l, 2*dim + 2*g*n + h) -> y (b, l, dim) (or (b, l, d_out) with outproj)."""
    nheads, headdim, dim, dstate = split_dims(zxbcdt, conv1d_weight, D, headdim, ngroups)
    b, l, _ = zxbcdt.shape
    z, xBC, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    xBC = causal_conv1d_ref(xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx, activation=activation)
    xBC = xBC.transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    x = x.reshape(b, l, nheads, headdim)
    B = B.reshape(b, l, ngroups, dstate)
    C = C.reshape(b, l, ngroups, dstate)
    zh = z.reshape(b, l, nheads, headdim)
    res = mamba_chunk_scan_combined_ref(
        x, dt, A, B, C, chunk_size, D=D, z=zh if rmsnorm_weight is None else None, dt_bias=dt_bias,
        initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit,
        return_final_states=return_final_states,
    )
    out, final_states = res if return_final_states else (res, None)
    out = out.reshape(b, l, dim)
    if rmsnorm_weight is not None:
        out = rmsnorm_gated_ref(out, rmsnorm_weight, None, z=z, eps=rmsnorm_eps, group_size=dim // ngroups,
                                norm_before_gate=norm_before_gate)
    if outproj_weight is not None:
        out = F.linear(out, outproj_weight, outproj_bias)
    return (out, final_states) if return_final_states else out
