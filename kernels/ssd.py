"""Mamba-2 SSD (state-space duality) chunked scan: the pure-PyTorch reference.

The computation is split exactly like mamba-ssm 2.3.2's Triton path, with the same tensor
layouts, so each Helion kernel can be checked against its reference piece:

    chunk_cumsum -> chunk_state -> state_passing -> bmm_chunk (C.B^T) -> chunk_scan

Shape letters: b batch, l seqlen, h nheads, p headdim, g ngroups, n dstate, c chunk_size,
nc = ceil(l / c). Tensors are padded internally to nc * c; padded positions get dt = 0.

Everything here is differentiable through autograd and computes in fp32 (or fp64 when given
fp64 inputs): it is the correctness oracle for the other backends. ``ssd_recurrence_fp64`` is
the step-by-step recurrence the chunked form is tested against.

Packed sequences (``seq_idx``): the state is reset where ``seq_idx`` changes. As in mamba-ssm,
``initial_states`` is applied to the sequence with ``seq_idx == 0``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _acc_dtype(*ts: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def _pad_len(t: torch.Tensor, dim: int, total: int, value: float = 0.0) -> torch.Tensor:
    pad = total - t.shape[dim]
    if pad == 0:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_full(shape, value)], dim=dim)


def _pad_seq_idx(seq_idx: torch.Tensor, total: int) -> torch.Tensor:
    """Pad (b, l) seq_idx to (b, total) by repeating the last valid entry."""
    pad = total - seq_idx.shape[1]
    if pad == 0:
        return seq_idx
    return torch.cat([seq_idx, seq_idx[:, -1:].expand(-1, pad)], dim=1)


def _heads_from_groups(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """(b, l, g, n) -> (b, l, h, n), head i reads group i // (h // g)."""
    g = t.shape[2]
    if nheads % g != 0:
        raise ValueError(f"nheads {nheads} is not a multiple of ngroups {g}")
    return t.repeat_interleave(nheads // g, dim=2)


def chunk_cumsum_ref(
    dt: torch.Tensor,
    A: torch.Tensor,
    chunk_size: int,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> tuple[torch.Tensor, torch.Tensor]:
    """dt (b, l, h), A (h) -> (dA_cumsum, dt_out), both (b, h, nc, c) fp32.

    dt_out = clamp(softplus(dt + dt_bias)) (softplus only below 20, as mamba-ssm), zero beyond l;
    dA_cumsum = in-chunk inclusive cumsum of dt_out * A.
    """
    b, l, h = dt.shape
    acc = _acc_dtype(dt, A)
    nc = math.ceil(l / chunk_size)
    d = dt.to(acc)
    if dt_bias is not None:
        d = d + dt_bias.to(acc)
    if dt_softplus:
        d = torch.where(d <= 20.0, F.softplus(d), d)
    if dt_limit != (0.0, float("inf")):
        d = d.clamp(min=dt_limit[0], max=dt_limit[1])
    d = _pad_len(d, 1, nc * chunk_size)
    dt_out = d.reshape(b, nc, chunk_size, h).permute(0, 3, 1, 2)  # (b, h, nc, c)
    dA = dt_out * A.to(acc).view(1, h, 1, 1)
    return torch.cumsum(dA, dim=-1), dt_out


def chunk_state_ref(
    B: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    dA_cumsum: torch.Tensor,
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-chunk final states assuming a zero initial state: (b, nc, h, p, n) fp32.

    states[c] = sum_t exp(dAcs[last] - dAcs[t]) * dt[t] * x[t] (outer) B[t], over tokens t of
    chunk c in the same sequence as the chunk's last token.
    """
    b, l, h, p = x.shape
    _, _, nc, c = dt.shape
    acc = _acc_dtype(x, B, dt)
    L = nc * c
    xc = _pad_len(x.to(acc), 1, L).reshape(b, nc, c, h, p)
    Bc = _pad_len(_heads_from_groups(B, h).to(acc), 1, L).reshape(b, nc, c, h, -1)
    decay = torch.exp(dA_cumsum[..., -1:] - dA_cumsum)  # (b, h, nc, c)
    if seq_idx is not None:
        s = _pad_seq_idx(seq_idx, L).reshape(b, nc, c)
        same = (s == s[..., -1:]).unsqueeze(1)  # (b, 1, nc, c)
        decay = decay * same
    scale = (decay * dt).permute(0, 2, 3, 1)  # (b, nc, c, h)
    return torch.einsum("bclhn,bclh,bclhp->bchpn", Bc, scale, xc)


def state_passing_ref(
    states: torch.Tensor,
    dA_chunk_cumsum: torch.Tensor,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Serial pass over chunks: (states entering each chunk (b, nc, h, p, n), final_states (b, h, p, n)).

    ``dA_chunk_cumsum`` is dA_cumsum[..., -1] (b, h, nc). With ``seq_idx`` (b, l) the carried
    state is dropped when the sequence at a chunk's last token differs from the previous one.
    """
    b, nc, h, p, n = states.shape
    acc = _acc_dtype(states)
    s = torch.zeros(b, h, p, n, dtype=acc, device=states.device) if initial_states is None else initial_states.to(acc)
    if seq_idx is not None:
        if chunk_size is None:
            raise ValueError("state_passing_ref needs chunk_size with seq_idx")
        l = seq_idx.shape[1]
        ends = [min((ci + 1) * chunk_size, l) - 1 for ci in range(nc)]
        seq_end = seq_idx[:, ends]  # (b, nc)
        seq_prev = torch.cat([torch.zeros_like(seq_end[:, :1]), seq_end[:, :-1]], dim=1)
        keep = (seq_end == seq_prev).to(acc)  # (b, nc)
    outs = []
    for ci in range(nc):
        outs.append(s)
        scale = torch.exp(dA_chunk_cumsum[:, :, ci].to(acc))  # (b, h)
        if seq_idx is not None:
            scale = scale * keep[:, ci : ci + 1]
        s = scale[..., None, None] * s + states[:, ci].to(acc)
    return torch.stack(outs, dim=1), s


def bmm_chunk_ref(C: torch.Tensor, B: torch.Tensor, chunk_size: int, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
    """CB[b, nc, g, t, s] = C[t] . B[s] per chunk and group (fp32), zero across sequence boundaries."""
    b, l, g, n = C.shape
    nc = math.ceil(l / chunk_size)
    L = nc * chunk_size
    acc = _acc_dtype(C, B)
    Cc = _pad_len(C.to(acc), 1, L).reshape(b, nc, chunk_size, g, n)
    Bc = _pad_len(B.to(acc), 1, L).reshape(b, nc, chunk_size, g, n)
    CB = torch.einsum("bctgn,bcsgn->bcgts", Cc, Bc)
    if seq_idx is not None:
        s = _pad_seq_idx(seq_idx, L).reshape(b, nc, chunk_size)
        same = (s[:, :, :, None] == s[:, :, None, :]).unsqueeze(2)  # (b, nc, 1, c, c)
        CB = CB * same
    return CB


def chunk_scan_ref(
    CB: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    dA_cumsum: torch.Tensor,
    C: torch.Tensor,
    prev_states: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk outputs: (out, out_x), both (b, l, h, p) in x.dtype; out = out_x * silu(z) when z is given.

    out_x[t] = exp(dAcs[t]) * C[t] . prev_state  (only if t is in the sequence carried in)
             + sum_{s <= t} CB[t, s] * exp(dAcs[t] - dAcs[s]) * dt[s] * x[s]  + D * x[t]
    """
    b, l, h, p = x.shape
    _, _, nc, c = dt.shape
    g = C.shape[2]
    L = nc * c
    acc = _acc_dtype(x, C, dt, prev_states)
    xc = _pad_len(x.to(acc), 1, L).reshape(b, nc, c, h, p)
    Ch = _pad_len(_heads_from_groups(C, h).to(acc), 1, L).reshape(b, nc, c, h, -1)
    # Inter-chunk part: contribution of the state entering the chunk.
    y_off = torch.einsum("bclhn,bchpn->bclhp", Ch, prev_states.to(acc))
    y_off = y_off * torch.exp(dA_cumsum).permute(0, 2, 3, 1).unsqueeze(-1)
    if seq_idx is not None:
        s = _pad_seq_idx(seq_idx, L).reshape(b, nc, c)
        prev_end = torch.cat([torch.zeros_like(s[:, :1, -1]), s[:, :-1, -1]], dim=1)  # (b, nc)
        y_off = y_off * (s == prev_end[:, :, None])[..., None, None]
    # Intra-chunk part: causal, decayed, dt-weighted C.B^T applied to x.
    seg = dA_cumsum[..., :, None] - dA_cumsum[..., None, :]  # (b, h, nc, t, s)
    causal = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(seg.masked_fill(~causal, float("-inf")))
    CBh = CB.to(acc).repeat_interleave(h // g, dim=2)  # (b, nc, h, t, s)
    Mts = CBh * decay.permute(0, 2, 1, 3, 4) * dt.permute(0, 2, 1, 3).unsqueeze(-2)  # (b, nc, h, t, s)
    y_diag = torch.einsum("bchts,bcshp->bcthp", Mts, xc)
    y = (y_off + y_diag).reshape(b, L, h, p)[:, :l]
    if D is not None:
        Dv = D.to(acc)
        y = y + x.to(acc) * (Dv.view(1, 1, h, 1) if Dv.dim() == 1 else Dv.view(1, 1, h, p))
    out_x = y.to(x.dtype)
    if z is None:
        return out_x, out_x
    out = (y * F.silu(z.to(acc))).to(x.dtype)
    return out, out_x


def ssd_forward_ref(
    x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
    dt_softplus=False, dt_limit=(0.0, float("inf")),
):
    """All forward pieces: (out, out_x, dt_out, dA_cumsum, states_in, final_states)."""
    dA_cumsum, dt_out = chunk_cumsum_ref(dt, A, chunk_size, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    states = chunk_state_ref(B, x, dt_out, dA_cumsum, seq_idx=seq_idx)
    states_in, final_states = state_passing_ref(
        states, dA_cumsum[..., -1], initial_states=initial_states, seq_idx=seq_idx, chunk_size=chunk_size
    )
    CB = bmm_chunk_ref(C, B, chunk_size, seq_idx=seq_idx)
    out, out_x = chunk_scan_ref(CB, x, dt_out, dA_cumsum, C, states_in, D=D, z=z, seq_idx=seq_idx)
    return out, out_x, dt_out, dA_cumsum, states_in, final_states


def mamba_chunk_scan_combined_ref(
    x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
    cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
    return_varlen_states=False,
):
    """mamba-ssm ``mamba_chunk_scan_combined`` semantics: x (b,l,h,p), dt (b,l,h), A (h), B/C (b,l,g,n)."""
    if cu_seqlens is not None or return_varlen_states:
        raise NotImplementedError("cu_seqlens / varlen states are not on Megatron's training path and are not supported")
    out, _, _, _, _, final_states = ssd_forward_ref(
        x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
        seq_idx=seq_idx, dt_softplus=dt_softplus, dt_limit=dt_limit,
    )
    return (out, final_states) if return_final_states else out


def ssd_recurrence_fp64(
    x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
    dt_softplus=False, dt_limit=(0.0, float("inf")),
):
    """Step-by-step SSM recurrence in fp64 (the oracle for the chunked form).

    h_t = exp(dt_t A) h_{t-1} [same sequence] + dt_t x_t B_t^T ;  y_t = h_t C_t + D x_t ;  y *= silu(z)
    Returns (y (b, l, h, p) fp64, final_state (b, h, p, n) fp64).
    """
    b, l, h, p = x.shape
    n = B.shape[-1]
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    if dt_bias is not None:
        dt = dt + dt_bias.double()
    if dt_softplus:
        dt = torch.where(dt <= 20.0, F.softplus(dt), dt)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    Bh = _heads_from_groups(B, h)
    Ch = _heads_from_groups(C, h)
    state = torch.zeros(b, h, p, n, dtype=torch.float64, device=x.device) if initial_states is None else initial_states.double().clone()
    prev_seq = torch.zeros(b, dtype=torch.long, device=x.device)
    ys = []
    for t in range(l):
        dA = torch.exp(dt[:, t] * A)  # (b, h)
        if seq_idx is not None:
            cur = seq_idx[:, t].long()
            dA = dA * (cur == prev_seq).double()[:, None]
            prev_seq = cur
        state = dA[..., None, None] * state + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    y = torch.stack(ys, dim=1)
    if D is not None:
        Dv = D.double()
        y = y + x * (Dv.view(1, 1, h, 1) if Dv.dim() == 1 else Dv.view(1, 1, h, p))
    if z is not None:
        y = y * F.silu(z.double())
    return y, state
