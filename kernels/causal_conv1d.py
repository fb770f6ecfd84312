"""Causal depthwise conv1d (+SiLU) as the fused Mamba-2 path uses it.

Semantics follow causal-conv1d 1.7.0 ``causal_conv1d_fn``: ``x`` is (batch, dim, seqlen) — in the
fused path a channel-last view of zxBCdt (``x.stride(1) == 1``) — ``weight`` is (dim, width),
``out[b, d, t] = act(bias[d] + sum_k weight[d, k] * x[b, d, t - (width - 1) + k])`` with zero
left padding. With ``seq_idx`` (batch, seqlen) (packed sequences), inputs from a position whose
``seq_idx`` differs from the output position's contribute zero.

This module holds the torch reference first, then the Helion kernels and autograd wiring.
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
    return out.to(dtype)


# ================================================================================================
# Helion kernels
#
# Tensors are used as (batch, seqlen, dim) views (``x.transpose(1, 2)``): for the channel-last x of
# the fused Mamba path that view has unit stride over channels, so each program loads contiguous
# channel vectors. Widths 2..4 (what causal-conv1d supports) run as width 4 with zero-padded
# leading taps, so one kernel body serves all widths. With seq_idx an input at position s contributes
# to output t only if seq_idx[s] == seq_idx[t]; without it (``seq is None``, specialised at compile
# time) the kernels skip the seq loads.
#
# Forward grid: (batch, seqlen tiles, channel tiles), both block sizes tuned.
# Backward grid: (batch, `l_per_program` positions, channel tiles); each program walks its positions
# in tiles, recomputes the pre-activation at t..t+3 from x (no stored activations), writes dx, and
# accumulates dweight (4 taps) and dbias in fp32 registers; the per-program partials
# (batch * cdiv(seqlen, l_per_program), ...) are summed in fp32 by torch afterwards.
# Forward v2 (opt-in, set_fwd_variant("v2")): the same rolling-window walk for the forward, each x
# element loaded about once (see causal_conv1d_fwd_kernel_v2).
# Backward v3 (opt-in): a per-row rolling-window walk that loads each x / dout element about once
# (see causal_conv1d_bwd_kernel_v3).
# ================================================================================================

import helion  # noqa: E402
import helion.language as hl  # noqa: E402
from helion.autotuner import PowerOfTwoFragment  # noqa: E402

from kernels import tuning  # noqa: E402


@helion.kernel(static_shapes=True)
def causal_conv1d_fwd_kernel(
    x: torch.Tensor,  # (B, L, D) view
    w4: torch.Tensor,  # (D, 4) any float dtype (the weight itself for width 4)
    bias: torch.Tensor | None,  # (D,) any float dtype
    seq: torch.Tensor | None,  # (B, L) int32
    silu: hl.constexpr,
) -> torch.Tensor:
    nb, nl, nd = x.size()
    out = torch.empty([nb, nl, nd], dtype=x.dtype, device=x.device)
    for tb, tt, td in hl.tile([nb, nl, nd], block_size=[1, None, None]):
        t = tt.index
        acc = hl.zeros([tt, td], dtype=torch.float32)
        if bias is not None:
            acc = acc + bias[td].to(torch.float32)[None, :]
        if seq is not None:
            s0 = seq[tb.begin, tt]
        for k in hl.static_range(4):
            src = t - (3 - k)
            ok = src >= 0
            if seq is not None:
                sk = hl.load(seq, [tb.begin, src], extra_mask=ok)
                ok = ok & (sk == s0)
            xv = hl.load(x, [tb.begin, src, td], extra_mask=ok[:, None])
            acc = acc + xv.to(torch.float32) * w4[td, k].to(torch.float32)[None, :]
        if silu:
            acc = acc * torch.sigmoid(acc)
        out[tb.begin, tt, td] = acc.to(out.dtype)
    return out


@helion.kernel(static_shapes=True)
def causal_conv1d_bwd_kernel(
    x: torch.Tensor,  # (B, L, D) view
    w4: torch.Tensor,  # (D, 4) any float dtype (the weight itself for width 4)
    bias: torch.Tensor | None,  # (D,) any float dtype
    dout: torch.Tensor,  # (B, L, D) view
    seq: torch.Tensor | None,  # (B, L) int32
    dx: torch.Tensor,  # (B, L, D) view, written
    silu: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor]:
    nb, nl, nd = x.size()
    lp = hl.register_tunable("l_per_program", PowerOfTwoFragment(16, 16384, 512))
    nlp = helion.cdiv(nl, lp)
    dw_part = torch.empty([nb, nlp, 4, nd], dtype=torch.float32, device=x.device)
    db_part = torch.empty([nb, nlp, nd], dtype=torch.float32, device=x.device)
    for tb, tp, td in hl.tile([nb, nl, nd], block_size=[1, lp, None]):
        w0 = w4[td, 0].to(torch.float32)[None, :]
        w1 = w4[td, 1].to(torch.float32)[None, :]
        w2 = w4[td, 2].to(torch.float32)[None, :]
        w3 = w4[td, 3].to(torch.float32)[None, :]
        if bias is not None:
            bb = bias[td].to(torch.float32)[None, :]
        else:
            bb = hl.zeros([td], dtype=torch.float32)[None, :]
        dw0 = hl.zeros([td], dtype=torch.float32)
        dw1 = hl.zeros([td], dtype=torch.float32)
        dw2 = hl.zeros([td], dtype=torch.float32)
        dw3 = hl.zeros([td], dtype=torch.float32)
        db = hl.zeros([td], dtype=torch.float32)
        for tt in hl.tile(tp.begin, tp.end):
            t = tt.index
            # seq ids and x at offsets -3..+3 around t (zero outside [0, L))
            okm3, okm2, okm1 = t >= 3, t >= 2, t >= 1
            okp1, okp2, okp3 = t + 1 < nl, t + 2 < nl, t + 3 < nl
            if seq is not None:
                sm3 = hl.load(seq, [tb.begin, t - 3], extra_mask=okm3)
                sm2 = hl.load(seq, [tb.begin, t - 2], extra_mask=okm2)
                sm1 = hl.load(seq, [tb.begin, t - 1], extra_mask=okm1)
                s00 = seq[tb.begin, tt]
                sp1 = hl.load(seq, [tb.begin, t + 1], extra_mask=okp1)
                sp2 = hl.load(seq, [tb.begin, t + 2], extra_mask=okp2)
                sp3 = hl.load(seq, [tb.begin, t + 3], extra_mask=okp3)
            else:  # one sequence: every same-sequence mask below is 1 (no seq loads)
                sm3 = hl.zeros([tt], dtype=torch.int32)
                sm2 = hl.zeros([tt], dtype=torch.int32)
                sm1 = hl.zeros([tt], dtype=torch.int32)
                s00 = hl.zeros([tt], dtype=torch.int32)
                sp1 = hl.zeros([tt], dtype=torch.int32)
                sp2 = hl.zeros([tt], dtype=torch.int32)
                sp3 = hl.zeros([tt], dtype=torch.int32)
            xm3 = hl.load(x, [tb.begin, t - 3, td], extra_mask=okm3[:, None]).to(torch.float32)
            xm2 = hl.load(x, [tb.begin, t - 2, td], extra_mask=okm2[:, None]).to(torch.float32)
            xm1 = hl.load(x, [tb.begin, t - 1, td], extra_mask=okm1[:, None]).to(torch.float32)
            x00 = x[tb.begin, tt, td].to(torch.float32)
            xp1 = hl.load(x, [tb.begin, t + 1, td], extra_mask=okp1[:, None]).to(torch.float32)
            xp2 = hl.load(x, [tb.begin, t + 2, td], extra_mask=okp2[:, None]).to(torch.float32)
            xp3 = hl.load(x, [tb.begin, t + 3, td], extra_mask=okp3[:, None]).to(torch.float32)
            g0 = hl.load(dout, [tb.begin, t, td], extra_mask=(t < nl)[:, None]).to(torch.float32)
            g1 = hl.load(dout, [tb.begin, t + 1, td], extra_mask=okp1[:, None]).to(torch.float32)
            g2 = hl.load(dout, [tb.begin, t + 2, td], extra_mask=okp2[:, None]).to(torch.float32)
            g3 = hl.load(dout, [tb.begin, t + 3, td], extra_mask=okp3[:, None]).to(torch.float32)
            # same-sequence masks e(a, b) as floats, columns broadcast over channels
            e_m3_0 = (sm3 == s00).to(torch.float32)[:, None]
            e_m2_0 = (sm2 == s00).to(torch.float32)[:, None]
            e_m1_0 = (sm1 == s00).to(torch.float32)[:, None]
            e_p1_0 = (sp1 == s00).to(torch.float32)[:, None]
            e_p2_0 = (sp2 == s00).to(torch.float32)[:, None]
            e_p3_0 = (sp3 == s00).to(torch.float32)[:, None]
            if silu:
                e_m2_1 = (sm2 == sp1).to(torch.float32)[:, None]
                e_m1_1 = (sm1 == sp1).to(torch.float32)[:, None]
                e_0_1 = e_p1_0
                e_m1_2 = (sm1 == sp2).to(torch.float32)[:, None]
                e_0_2 = e_p2_0
                e_1_2 = (sp1 == sp2).to(torch.float32)[:, None]
                e_0_3 = e_p3_0
                e_1_3 = (sp1 == sp3).to(torch.float32)[:, None]
                e_2_3 = (sp2 == sp3).to(torch.float32)[:, None]
                a0 = bb + w0 * xm3 * e_m3_0 + w1 * xm2 * e_m2_0 + w2 * xm1 * e_m1_0 + w3 * x00
                a1 = bb + w0 * xm2 * e_m2_1 + w1 * xm1 * e_m1_1 + w2 * x00 * e_0_1 + w3 * xp1
                a2 = bb + w0 * xm1 * e_m1_2 + w1 * x00 * e_0_2 + w2 * xp1 * e_1_2 + w3 * xp2
                a3 = bb + w0 * x00 * e_0_3 + w1 * xp1 * e_1_3 + w2 * xp2 * e_2_3 + w3 * xp3
                sg0 = torch.sigmoid(a0)
                sg1 = torch.sigmoid(a1)
                sg2 = torch.sigmoid(a2)
                sg3 = torch.sigmoid(a3)
                g0 = g0 * sg0 * (1.0 + a0 * (1.0 - sg0))
                g1 = g1 * sg1 * (1.0 + a1 * (1.0 - sg1))
                g2 = g2 * sg2 * (1.0 + a2 * (1.0 - sg2))
                g3 = g3 * sg3 * (1.0 + a3 * (1.0 - sg3))
            dxt = w3 * g0 + w2 * g1 * e_p1_0 + w1 * g2 * e_p2_0 + w0 * g3 * e_p3_0
            hl.store(dx, [tb.begin, t, td], dxt.to(dx.dtype), extra_mask=(t < nl)[:, None])
            dw0 = dw0 + torch.sum(g0 * xm3 * e_m3_0, dim=0)
            dw1 = dw1 + torch.sum(g0 * xm2 * e_m2_0, dim=0)
            dw2 = dw2 + torch.sum(g0 * xm1 * e_m1_0, dim=0)
            dw3 = dw3 + torch.sum(g0 * x00, dim=0)
            db = db + torch.sum(g0, dim=0)
        dw_part[tb.begin, tp.id, 0, td] = dw0
        dw_part[tb.begin, tp.id, 1, td] = dw1
        dw_part[tb.begin, tp.id, 2, td] = dw2
        dw_part[tb.begin, tp.id, 3, td] = dw3
        db_part[tb.begin, tp.id, td] = db
    return dw_part, db_part


# v3 (the default backward): a rolling-window walk that reads each x / dout element about
# once. v1 loads 7 shifted x and 4 shifted dout tiles per row tile and recomputes the
# pre-activation (and its sigmoid) at 4 positions per row; v3 computes it once per row.
#
# Grid: (batch, tiles of `block_sizes[0]` lanes, channel tiles `block_sizes[1]`). A lane is a run of
# `l_per_lane` consecutive rows [r0, r0 + l_per_lane); a program walks all its lanes together, one row
# per step, as (lanes, channels) tensors (so each step still moves lanes x channels elements). At
# step r it has x[r-3..r-1] and g'[r-3..r-1] in loop-carried registers (g' = dout * silu'(a), a the
# pre-activation), loads x[r] and dout[r] (prefetched one step ahead), computes
#   a[r]    = bias + w0 x[r-3] + w1 x[r-2] + w2 x[r-1] + w3 x[r]           (out[t] = act(a[t]))
#   dx[r-3] = w3 g'[r-3] + w2 g'[r-2] + w1 g'[r-1] + w0 g'[r]
#   dw_k   += g'[r] x[r-3+k],  db += g'[r]                                  (fp32, elementwise)
# and shifts the window. The walk starts with x[r0-3..r0-1] (zero before row 0) and runs 3 rows past
# the lane (rows of the next lane: dx of the last 3 rows needs their g'; no dweight/dbias there).
# Loads per element: x (l_per_lane + 6) / l_per_lane, dout (l_per_lane + 3) / l_per_lane; halo rows
# are the neighbour lane's, mostly cache hits. dweight/dbias: one reduction over lanes per program,
# partials (batch, programs along seqlen, ...) summed by torch as for v1. With seq_idx the carried
# window also holds the seq ids and every term above is masked by same-sequence; without seq_idx
# (``seq is None``, specialised at compile time) there is no mask math at all.
@helion.kernel(static_shapes=True)
def causal_conv1d_bwd_kernel_v3(
    x: torch.Tensor,  # (B, L, D) view
    w4: torch.Tensor,  # (D, 4) any float dtype (the weight itself for width 4)
    bias: torch.Tensor | None,  # (D,) any float dtype
    dout: torch.Tensor,  # (B, L, D) view
    seq: torch.Tensor | None,  # (B, L) int32
    dx: torch.Tensor,  # (B, L, D) view, written
    silu: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor]:
    nb, nl, nd = x.size()
    sl = hl.register_tunable("l_per_lane", PowerOfTwoFragment(16, 4096, 64))  # rows per lane (>= 3)
    nlane = helion.cdiv(nl, sl)
    nr = hl.register_block_size(1, 64)  # lanes per program
    nlp = helion.cdiv(nlane, nr)
    dw_part = torch.empty([nb, nlp, 4, nd], dtype=torch.float32, device=x.device)
    db_part = torch.empty([nb, nlp, nd], dtype=torch.float32, device=x.device)
    for tb, tj, td in hl.tile([nb, nlane, nd], block_size=[1, nr, None]):
        w0 = w4[td, 0].to(torch.float32)[None, :]
        w1 = w4[td, 1].to(torch.float32)[None, :]
        w2 = w4[td, 2].to(torch.float32)[None, :]
        w3 = w4[td, 3].to(torch.float32)[None, :]
        if bias is not None:
            bb = bias[td].to(torch.float32)[None, :]
        r0 = tj.index * sl  # first row of each lane
        r1 = r0 + sl  # first row past each lane
        # window before the first step: x[r0-3..r0-1] (zero before row 0); g' of those rows is
        # only used for dx rows before the lane, which are not written
        xm3 = hl.load(x, [tb.begin, r0 - 3, td], extra_mask=(r0 >= 3)[:, None]).to(torch.float32)
        xm2 = hl.load(x, [tb.begin, r0 - 2, td], extra_mask=(r0 >= 2)[:, None]).to(torch.float32)
        xm1 = hl.load(x, [tb.begin, r0 - 1, td], extra_mask=(r0 >= 1)[:, None]).to(torch.float32)
        gm3 = hl.zeros([tj, td], dtype=torch.float32)
        gm2 = hl.zeros([tj, td], dtype=torch.float32)
        gm1 = hl.zeros([tj, td], dtype=torch.float32)
        if seq is not None:
            sm3 = hl.load(seq, [tb.begin, r0 - 3], extra_mask=r0 >= 3)
            sm2 = hl.load(seq, [tb.begin, r0 - 2], extra_mask=r0 >= 2)
            sm1 = hl.load(seq, [tb.begin, r0 - 1], extra_mask=r0 >= 1)
            sn = hl.load(seq, [tb.begin, r0], extra_mask=r0 < nl)
        dw0 = hl.zeros([tj, td], dtype=torch.float32)
        dw1 = hl.zeros([tj, td], dtype=torch.float32)
        dw2 = hl.zeros([tj, td], dtype=torch.float32)
        dw3 = hl.zeros([tj, td], dtype=torch.float32)
        db = hl.zeros([tj, td], dtype=torch.float32)
        # row r0 prefetched; each step loads the next row before computing the current one
        xn = hl.load(x, [tb.begin, r0, td], extra_mask=(r0 < nl)[:, None])
        gn = hl.load(dout, [tb.begin, r0, td], extra_mask=(r0 < nl)[:, None])
        # main walk: the lane's own rows (dweight/dbias accumulate; rows >= L load dout = 0 -> g' = 0)
        for s in hl.grid(sl):
            r = r0 + s
            x0 = xn.to(torch.float32)
            g0 = gn.to(torch.float32)
            okn = r + 1 < nl
            xn = hl.load(x, [tb.begin, r + 1, td], extra_mask=okn[:, None])
            gn = hl.load(dout, [tb.begin, r + 1, td], extra_mask=okn[:, None])
            if seq is not None:
                s0 = sn
                sn = hl.load(seq, [tb.begin, r + 1], extra_mask=okn)
                xe3 = xm3 * (sm3 == s0).to(torch.float32)[:, None]  # x[r-3+k] if in row r's sequence
                xe2 = xm2 * (sm2 == s0).to(torch.float32)[:, None]
                xe1 = xm1 * (sm1 == s0).to(torch.float32)[:, None]
            else:
                xe3, xe2, xe1 = xm3, xm2, xm1
            if silu:
                a = w0 * xe3 + w1 * xe2 + w2 * xe1 + w3 * x0
                if bias is not None:
                    a = a + bb
                sg = torch.sigmoid(a)
                g0 = g0 * sg * (1.0 + a * (1.0 - sg))
            dw0 = dw0 + g0 * xe3
            dw1 = dw1 + g0 * xe2
            dw2 = dw2 + g0 * xe1
            dw3 = dw3 + g0 * x0
            db = db + g0
            t = r - 3
            if seq is not None:
                dxt = w3 * gm3 + (w2 * gm2) * (sm2 == sm3).to(torch.float32)[:, None] + (w1 * gm1) * (
                    sm1 == sm3
                ).to(torch.float32)[:, None] + (w0 * g0) * (s0 == sm3).to(torch.float32)[:, None]
                sm3, sm2, sm1 = sm2, sm1, s0
            else:
                dxt = w3 * gm3 + w2 * gm2 + w1 * gm1 + w0 * g0
            hl.store(dx, [tb.begin, t, td], dxt.to(dx.dtype), extra_mask=((t >= r0) & (t < nl))[:, None])
            xm3, xm2, xm1 = xm2, xm1, x0
            gm3, gm2, gm1 = gm2, gm1, g0
        # tail: 3 rows past the lane (the next lane's), for dx of the lane's last 3 rows only
        for s in hl.grid(sl, sl + 3):
            r = r0 + s
            x0 = xn.to(torch.float32)
            g0 = gn.to(torch.float32)
            okn = (r + 1 < nl) & (r + 1 < r1 + 3)
            xn = hl.load(x, [tb.begin, r + 1, td], extra_mask=okn[:, None])
            gn = hl.load(dout, [tb.begin, r + 1, td], extra_mask=okn[:, None])
            if seq is not None:
                s0 = sn
                sn = hl.load(seq, [tb.begin, r + 1], extra_mask=okn)
                xe3 = xm3 * (sm3 == s0).to(torch.float32)[:, None]  # x[r-3+k] if in row r's sequence
                xe2 = xm2 * (sm2 == s0).to(torch.float32)[:, None]
                xe1 = xm1 * (sm1 == s0).to(torch.float32)[:, None]
            else:
                xe3, xe2, xe1 = xm3, xm2, xm1
            if silu:
                a = w0 * xe3 + w1 * xe2 + w2 * xe1 + w3 * x0
                if bias is not None:
                    a = a + bb
                sg = torch.sigmoid(a)
                g0 = g0 * sg * (1.0 + a * (1.0 - sg))
            t = r - 3
            if seq is not None:
                dxt = w3 * gm3 + (w2 * gm2) * (sm2 == sm3).to(torch.float32)[:, None] + (w1 * gm1) * (
                    sm1 == sm3
                ).to(torch.float32)[:, None] + (w0 * g0) * (s0 == sm3).to(torch.float32)[:, None]
                sm3, sm2, sm1 = sm2, sm1, s0
            else:
                dxt = w3 * gm3 + w2 * gm2 + w1 * gm1 + w0 * g0
            hl.store(dx, [tb.begin, t, td], dxt.to(dx.dtype), extra_mask=(t < nl)[:, None])
            xm3, xm2, xm1 = xm2, xm1, x0
            gm3, gm2, gm1 = gm2, gm1, g0
        # one cross-lane reduction per program
        dw_part[tb.begin, tj.id, 0, td] = torch.sum(dw0, dim=0)
        dw_part[tb.begin, tj.id, 1, td] = torch.sum(dw1, dim=0)
        dw_part[tb.begin, tj.id, 2, td] = torch.sum(dw2, dim=0)
        dw_part[tb.begin, tj.id, 3, td] = torch.sum(dw3, dim=0)
        db_part[tb.begin, tj.id, td] = torch.sum(db, dim=0)
    return dw_part, db_part


# fwd v2 (the default forward): the forward as a rolling-window walk like the backward v3.
# v1 loads 4 shifted x tiles per (rows, channels) tile; v2 loads each x element about once.
#
# Grid: (batch, tiles of `block_sizes[0]` lanes, channel tiles `block_sizes[1]`). A lane is a run of
# `l_per_lane` consecutive rows [r0, r0 + l_per_lane); a program walks all its lanes together, one row
# per step, as (lanes, channels) tensors. At step r it has x[r-3..r-1] in loop-carried registers,
# takes x[r] (prefetched one step ahead: Triton does not pipeline a loop whose carried values are
# yielded straight back), computes
#   out[r] = act(bias + w0 x[r-3] + w1 x[r-2] + w2 x[r-1] + w3 x[r])
# stores it and shifts the window. The walk starts with x[r0-3..r0-1] (zero before row 0; the
# previous lane's rows, mostly cache hits). Loads per element: x (l_per_lane + 3) / l_per_lane, one
# store. With seq_idx the window also carries the seq ids and x[r-k] counts only where
# seq[r-k] == seq[r]; without it (``seq is None``, specialised at compile time) there is no mask math.
@helion.kernel(static_shapes=True)
def causal_conv1d_fwd_kernel_v2(
    x: torch.Tensor,  # (B, L, D) view
    w4: torch.Tensor,  # (D, 4) any float dtype (the weight itself for width 4)
    bias: torch.Tensor | None,  # (D,) any float dtype
    seq: torch.Tensor | None,  # (B, L) int32
    silu: hl.constexpr,
) -> torch.Tensor:
    nb, nl, nd = x.size()
    sl = hl.register_tunable("l_per_lane", PowerOfTwoFragment(16, 4096, 64))  # rows per lane (>= 3)
    nlane = helion.cdiv(nl, sl)
    nr = hl.register_block_size(1, 64)  # lanes per program
    out = torch.empty([nb, nl, nd], dtype=x.dtype, device=x.device)
    for tb, tj, td in hl.tile([nb, nlane, nd], block_size=[1, nr, None]):
        w0 = w4[td, 0].to(torch.float32)[None, :]
        w1 = w4[td, 1].to(torch.float32)[None, :]
        w2 = w4[td, 2].to(torch.float32)[None, :]
        w3 = w4[td, 3].to(torch.float32)[None, :]
        if bias is not None:
            bb = bias[td].to(torch.float32)[None, :]
        r0 = tj.index * sl  # first row of each lane
        r1 = r0 + sl  # first row past each lane
        # halo: x[r0-3..r0-1] (zero before row 0)
        xm3 = hl.load(x, [tb.begin, r0 - 3, td], extra_mask=(r0 >= 3)[:, None]).to(torch.float32)
        xm2 = hl.load(x, [tb.begin, r0 - 2, td], extra_mask=(r0 >= 2)[:, None]).to(torch.float32)
        xm1 = hl.load(x, [tb.begin, r0 - 1, td], extra_mask=(r0 >= 1)[:, None]).to(torch.float32)
        if seq is not None:
            sm3 = hl.load(seq, [tb.begin, r0 - 3], extra_mask=r0 >= 3)
            sm2 = hl.load(seq, [tb.begin, r0 - 2], extra_mask=r0 >= 2)
            sm1 = hl.load(seq, [tb.begin, r0 - 1], extra_mask=r0 >= 1)
            sn = hl.load(seq, [tb.begin, r0], extra_mask=r0 < nl)
        # row r0 prefetched; each step loads the next row of the lane before computing the current one
        xn = hl.load(x, [tb.begin, r0, td], extra_mask=(r0 < nl)[:, None])
        for s in hl.grid(sl):
            r = r0 + s
            x0 = xn.to(torch.float32)
            okn = (r + 1 < nl) & (r + 1 < r1)
            xn = hl.load(x, [tb.begin, r + 1, td], extra_mask=okn[:, None])
            if seq is not None:
                s0 = sn
                sn = hl.load(seq, [tb.begin, r + 1], extra_mask=okn)
                xe3 = xm3 * (sm3 == s0).to(torch.float32)[:, None]  # x[r-3+k] if in row r's sequence
                xe2 = xm2 * (sm2 == s0).to(torch.float32)[:, None]
                xe1 = xm1 * (sm1 == s0).to(torch.float32)[:, None]
                sm3, sm2, sm1 = sm2, sm1, s0
            else:
                xe3, xe2, xe1 = xm3, xm2, xm1
            a = w0 * xe3 + w1 * xe2 + w2 * xe1 + w3 * x0
            if bias is not None:
                a = a + bb
            if silu:
                a = a * torch.sigmoid(a)
            hl.store(out, [tb.begin, r, td], a.to(out.dtype), extra_mask=(r < nl)[:, None])
            xm3, xm2, xm1 = xm2, xm1, x0
    return out


CONV_FWD_DEFAULT = helion.Config(block_sizes=[64, 64], num_warps=4)  # [seqlen, channels]
# fwd v2: [lanes per program, channels]; 4 lanes x 128 channels per step, 4 x 64 rows per program ->
# 3072 programs at the Nano shape; the walk unrolled 2x (range_unroll_factors: [grid, walk]), as the
# bwd v3 default. The sm90 search kept it (133 us at the Nano shape; kernels/configs/sm90/conv1d_fwd_v2.json).
CONV_FWD_V2_DEFAULT = helion.Config(block_sizes=[4, 128], num_warps=4, l_per_lane=64, range_unroll_factors=[0, 2])
CONV_BWD_DEFAULT = helion.Config(block_sizes=[64, 32], num_warps=4, l_per_program=512)  # [channels, seqlen]
# v3: [lanes per program, channels]; 4 lanes x 128 channels = 512 elements per step (4 per thread),
# 4 x 64 rows per program -> 2 x 32 x 48 = 3072 programs at the Nano shape (b 2, l 8192, d 6144);
# the main walk unrolled 2x (range_unroll_factors: [grid, main walk, 3-row tail]). The generic default:
# 250 us at the Nano shape on an H200, where the committed sm90 config takes 224 us
# (benchmarks/results/h200/tune_sm90_20261130_040858.json).
CONV_BWD_V3_DEFAULT = helion.Config(block_sizes=[4, 128], num_warps=4, l_per_lane=64, range_unroll_factors=[0, 2, 0])

# backward kernel variant: "v3" (causal_conv1d_bwd_kernel_v3, rolling window; the default: 0.24 ms
# against causal-conv1d's 0.30 ms at the Nano shape on an H200, kernels_mamba_ssm_vs_helion_nano.md,
# and v1's 1.13 ms in kernels_mamba_ssm_vs_helion_nano_concurrent.md) or "v1" (the first
# kernel, 11 shifted loads per row tile). A v2 (v1 with one reduction per program) was dropped untimed
# once v3 replaced both.
_BWD = tuning.KernelVariants("conv1d backward", {
    "v1": ("conv1d_bwd", causal_conv1d_bwd_kernel, CONV_BWD_DEFAULT),
    "v3": ("conv1d_bwd_v3", causal_conv1d_bwd_kernel_v3, CONV_BWD_V3_DEFAULT),
}, default="v3")
set_bwd_variant = _BWD.set  # module-wide conv1d backward kernel: "v3" (default) or "v1"
get_bwd_variant = _BWD.get


# forward kernel variant: "v2" (causal_conv1d_fwd_kernel_v2, rolling window, one load per x; the
# default: 133 us vs causal-conv1d's 135 us and v1's 143 us at the Nano shape on an H200,
# benchmarks/results/h200/bench_norm_conv.json) or "v1" (causal_conv1d_fwd_kernel, 4 shifted loads per tile)
_FWD = tuning.KernelVariants("conv1d forward", {
    "v1": ("conv1d_fwd", causal_conv1d_fwd_kernel, CONV_FWD_DEFAULT),
    "v2": ("conv1d_fwd_v2", causal_conv1d_fwd_kernel_v2, CONV_FWD_V2_DEFAULT),
}, default="v2")
set_fwd_variant = _FWD.set  # module-wide conv1d forward kernel: "v2" (default) or "v1"
get_fwd_variant = _FWD.get


def _conv_prep(x, weight, bias, seq_idx, activation):
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"expected x (b, d, l) and weight (d, w); got {tuple(x.shape)} and {tuple(weight.shape)}")
    b, d, l = x.shape
    width = weight.shape[1]
    if not 2 <= width <= 4:
        raise ValueError(f"conv width must be 2, 3 or 4 (as causal-conv1d), got {width}")
    if bias is not None and bias.shape != (d,):
        raise ValueError(f"bias must be ({d},), got {tuple(bias.shape)}")
    if x.stride(1) != 1 and x.stride(2) != 1:
        x = x.contiguous()
    # The kernels read weight/bias in their own dtype (fp32 math); widths 2-3 run as width 4 with
    # zero leading taps (one small pad), width 4 passes the weight itself: no copies on the fused path.
    w4 = weight if width == 4 else F.pad(weight, (4 - width, 0))
    seq = None
    if seq_idx is not None:
        if seq_idx.shape != (b, l):
            raise ValueError(f"seq_idx must be (batch, seqlen) = {(b, l)}, got {tuple(seq_idx.shape)}")
        seq = seq_idx.to(torch.int32)  # no-op for Megatron's int32 seq_idx
    silu = activation in ("silu", "swish")
    dims = dict(b=b, l=l, d=d, w=width, cl=int(x.stride(1) == 1), seq=int(seq_idx is not None), act=int(silu),
                dt=str(x.dtype).replace("torch.", ""))
    return x, w4, bias, seq, silu, dims


def causal_conv1d_fwd_helion(x, weight, bias=None, seq_idx=None, activation=None):
    """Forward. x (b, d, l) (channel-last strides welcome), weight (d, w), bias (d,) or None,
    seq_idx (b, l) int or None, activation None/"silu"/"swish". Returns out (b, d, l) in x's dtype,
    channel-last (``out.stride(1) == 1``), like causal-conv1d's channel-last path."""
    x, w4, bias, seq, silu, dims = _conv_prep(x, weight, bias, seq_idx, activation)
    args = (x.transpose(1, 2), w4, bias, seq, silu)
    name, kernel, default = _FWD.current()
    out = tuning.tuned_call(name, kernel, args, dims, default)
    return out.transpose(1, 2)


def causal_conv1d_bwd_helion(x, weight, bias, dout, seq_idx=None, activation=None, dx=None):
    """Backward of ``causal_conv1d_fwd_helion`` (same x/weight/bias/seq_idx/activation) given dout
    (b, d, l). ``dx`` may be a preallocated (b, d, l) output (e.g. a slice of dzxbcdt, as mamba-ssm
    passes to causal_conv1d_bwd_function). Returns ``(dx, dweight, dbias or None)`` with dweight in
    weight's dtype and dbias in bias's dtype."""
    x, w4, bias, seq, silu, dims = _conv_prep(x, weight, bias, seq_idx, activation)
    if dout.shape != x.shape:
        raise ValueError(f"dout must be {tuple(x.shape)}, got {tuple(dout.shape)}")
    if dx is None:
        dx = torch.empty(x.shape[0], x.shape[2], x.shape[1], dtype=x.dtype, device=x.device).transpose(1, 2)
    elif dx.shape != x.shape:
        raise ValueError(f"dx must be {tuple(x.shape)}, got {tuple(dx.shape)}")
    args = (x.transpose(1, 2), w4, bias, dout.transpose(1, 2), seq, dx.transpose(1, 2), silu)
    name, kernel, default = _BWD.current()
    dw_part, db_part = tuning.tuned_call(name, kernel, args, dims, default, finalize=conv_bwd_final, prepare=conv_bwd_poison)
    width = weight.shape[1]
    dweight = dw_part.sum(dim=(0, 1)).t()[:, 4 - width:].to(weight.dtype)
    dbias = None if bias is None else db_part.sum(dim=(0, 1)).to(bias.dtype)
    return dx, dweight, dbias


def conv_bwd_final(out, args):
    """Config-independent results of ``causal_conv1d_bwd_kernel``: (dx (its argument buffer),
    dweight (4, D) fp32, dbias (D,) fp32). ``args`` are the kernel's (x, w4, bias, dout, seq, dx, silu)."""
    dw_part, db_part = out
    return args[5], dw_part.sum(dim=(0, 1)), db_part.sum(dim=(0, 1))


def conv_bwd_poison(args):
    args[5].fill_(float("nan"))


class CausalConv1dHelionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias=None, seq_idx=None, activation=None):
        out = causal_conv1d_fwd_helion(x, weight, bias, seq_idx, activation)
        ctx.save_for_backward(x, weight, bias, seq_idx)
        ctx.activation = activation
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias, seq_idx = ctx.saved_tensors
        dx, dw, db = causal_conv1d_bwd_helion(x, weight, bias, dout, seq_idx, ctx.activation)
        return dx, dw, db, None, None


def causal_conv1d_helion(x, weight, bias=None, seq_idx=None, activation=None):
    """Autograd entry with ``causal_conv1d_fn``'s core signature (no initial/final states)."""
    return CausalConv1dHelionFn.apply(x, weight, bias, seq_idx, activation)


def _conv_case(kind: str, variant: str = "v1"):
    def build(dims: dict, device) -> tuning.TuneCase:
        b, l = dims["b"], dims["l"]
        d = dims["h"] * dims["p"] + 2 * dims["g"] * dims["n"]  # conv channels (x, B, C)
        width_total = 2 * dims["h"] * dims["p"] + 2 * dims["g"] * dims["n"] + dims["h"]  # zxBCdt
        gen = torch.Generator(device="cpu").manual_seed(0)
        zx = torch.randn(b, l, width_total, generator=gen).to(device=device, dtype=torch.bfloat16)
        off = dims["h"] * dims["p"]
        xbc = zx[:, :, off:off + d].transpose(1, 2)  # channel-last strided view, as in the fused path
        w = (0.5 * torch.randn(d, dims["w"], generator=gen)).to(device=device, dtype=torch.bfloat16)
        bias = (0.1 * torch.randn(d, generator=gen)).to(device=device, dtype=torch.bfloat16)
        x, w4, bias, seq, silu, kd = _conv_prep(xbc, w, bias, None, "silu")
        if kind == "fwd":
            args = (x.transpose(1, 2), w4, bias, seq, silu)
            _, kernel, default = _FWD[variant]
            if variant == "v2":  # block_sizes = [lanes per program, channel block]; l_per_lane rows per lane
                seeds = (tuning.grid_seeds(l_per_lane=[32, 64, 128], block_sizes=[[2, 128], [4, 128], [2, 256]],
                                           num_warps=[4])
                         + tuning.grid_seeds(l_per_lane=[64], block_sizes=[[8, 256], [4, 512]], num_warps=[8])
                         # unrolled walk (range_unroll_factors: [grid, walk])
                         + tuning.grid_seeds(l_per_lane=[64, 128], block_sizes=[[4, 128], [2, 256], [8, 64]],
                                             num_warps=[4], range_unroll_factors=[[0, 2], [0, 4]]))
            else:  # block_sizes = [seqlen block, channel block]
                seeds = tuning.grid_seeds(block_sizes=[[16, 128], [32, 128], [64, 64], [64, 128], [128, 64], [32, 256], [16, 256]], num_warps=[4, 8])
            return tuning.TuneCase(kernel, args, kd, default, seeds, atol=2e-2, rtol=2e-2)
        dout = torch.randn(b, l, d, generator=gen).to(device=device, dtype=torch.bfloat16)
        dxb = torch.empty(b, l, d, dtype=torch.bfloat16, device=device)
        args = (x.transpose(1, 2), w4, bias, dout, seq, dxb, silu)
        _, kernel, default = _BWD[variant]
        if variant == "v1":  # block_sizes = [channel block, inner seqlen block]
            bs = [[64, 16], [64, 32], [128, 16], [128, 32], [256, 16]]
        if variant == "v3":  # block_sizes = [lanes per program, channel block]; l_per_lane rows per lane
            seeds = (tuning.grid_seeds(l_per_lane=[32, 64, 128], block_sizes=[[2, 128], [4, 128], [2, 256], [1, 512]],
                                       num_warps=[4])
                     + tuning.grid_seeds(l_per_lane=[64], block_sizes=[[8, 256], [16, 128], [4, 512]], num_warps=[8])
                     # unrolled walk (range_unroll_factors: [grid, main walk, 3-row tail]): the rolling
                     # window's register moves become renames
                     + tuning.grid_seeds(l_per_lane=[64, 128], block_sizes=[[4, 128], [2, 256], [1, 512], [8, 64]],
                                         num_warps=[4], range_unroll_factors=[[0, 2, 0], [0, 4, 0]]))
        else:
            seeds = tuning.grid_seeds(l_per_program=[128, 256, 512, 1024, 2048], block_sizes=bs, num_warps=[4, 8])
        # Compared on the final results (dx written into its buffer, summed dweight/dbias): the
        # partials' count depends on l_per_program. dx is poisoned before each checked run.
        return tuning.TuneCase(kernel, args, kd, default, seeds, atol=2e-2, rtol=2e-2,
                               n_random=16, finalize=conv_bwd_final, prepare=conv_bwd_poison)

    return build


TUNABLE_KERNELS = {"conv1d_fwd": _conv_case("fwd"), "conv1d_fwd_v2": _conv_case("fwd", "v2"),
                   "conv1d_bwd": _conv_case("bwd"), "conv1d_bwd_v3": _conv_case("bwd", "v3")}
