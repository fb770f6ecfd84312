"""Causal depthwise conv1d (+SiLU): the Helion kernels and their autograd wiring.

Semantics and the torch reference (``causal_conv1d_ref``): ``kernels/causal_conv1d.py``.
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch
import torch.nn.functional as F
from helion.autotuner import PowerOfTwoFragment

from kernels import first_use, tuner, tuning
from kernels.causal_conv1d import docs_seq_idx
from kernels.shapes import padded_len

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
# Both kernels walk rows as a rolling window (each x / dout element loaded about once): the grid is
# (batch, tiles of lanes, channel tiles), a lane a run of `l_per_lane` consecutive rows; the backward
# writes per-program dweight/dbias partials that torch sums in fp32 (no atomics). Where seq_idx is
# negative (padding in a packed batch) the output is 0, as in causal-conv1d, and the backward gives
# those positions no gradient. Sequences shorter than ``MIN_SEQLEN`` run zero-padded to it on the right
# (a causal conv's outputs do not depend on later positions; padded rows get dout = 0).
# ================================================================================================


# Backward: a rolling-window walk that reads each x / dout element about once and computes the
# pre-activation (and its sigmoid) once per row.
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
# partials (batch, programs along seqlen, ...) summed by torch. With seq_idx the carried
# window also holds the seq ids and every term above is masked by same-sequence; without seq_idx
# (``seq is None``, specialised at compile time) there is no mask math at all.
@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
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
            if seq is not None:
                g0 = torch.where((s0 >= 0)[:, None], g0, 0.0)  # padding rows: their output is 0
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
            if seq is not None:
                g0 = torch.where((s0 >= 0)[:, None], g0, 0.0)  # padding rows: their output is 0
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


# Forward: the same rolling-window walk, each x element loaded about once.
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
@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def causal_conv1d_fwd_kernel(
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
            if seq is not None:
                a = torch.where((s0 >= 0)[:, None], a, 0.0)  # padding (seq_idx < 0): 0, as causal-conv1d
            hl.store(out, [tb.begin, r, td], a.to(out.dtype), extra_mask=(r < nl)[:, None])
            xm3, xm2, xm1 = xm2, xm1, x0
    return out


# [lanes per program, channels]; 4 lanes x 128 channels per step, 4 x 64 rows per program -> 3072 programs at the
# Nano shape; the walk unrolled 2x (range_unroll_factors: [grid, walk]).
CONV_FWD_DEFAULT = helion.Config(block_sizes=[4, 128], num_warps=4, l_per_lane=64, range_unroll_factors=[0, 2])
# [lanes per program, channels]; 4 lanes x 128 channels = 512 elements per step (4 per thread), 4 x 64 rows per
# program -> 2 x 32 x 48 = 3072 programs at the Nano shape (b 2, l 8192, d 6144); the main walk unrolled 2x
# (range_unroll_factors: [grid, main walk, 3-row tail]). 250 us at the Nano shape on an H200, where the tuned sm90
# config takes 224 us.
CONV_BWD_DEFAULT = helion.Config(block_sizes=[4, 128], num_warps=4, l_per_lane=64, range_unroll_factors=[0, 2, 0])
# Sequences shorter than this run zero-padded to it on the right: with a one-row sequence dimension the kernels do
# not compile on the H200 (Triton CompilationError), and rows below the conv width gain nothing from the lane walk.
# The padding is exact: causal outputs do not depend on later rows, and padded rows get dout = 0.
MIN_SEQLEN = 8


def _pad_rows(t: torch.Tensor, length: int, value=0) -> torch.Tensor:
    """(b, d, l) -> (b, d, length) with ``value`` in the new trailing positions, in t's layout (channel-last stays
    channel-last); (b, l) seq ids likewise."""
    if t.dim() == 2:
        return F.pad(t, (0, length - t.shape[1]), value=value)
    b, d, l = t.shape
    out = (t.new_full((b, length, d), value).transpose(1, 2) if t.stride(1) == 1 and t.stride(2) != 1
           else t.new_full((b, d, length), value))
    out[..., :l] = t
    return out


def _conv_prep(x, weight, bias, seq_idx, activation):
    """Checks and kernel arguments: (x, w4, bias, seq, silu, dims, l) with x (and seq) padded to ``MIN_SEQLEN``
    rows when shorter; ``l`` is the caller's sequence length."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"expected x (b, d, l) and weight (d, w); got {tuple(x.shape)} and {tuple(weight.shape)}")
    b, d, l = x.shape
    if l < 1:
        raise ValueError(f"x must have a sequence length >= 1, got {tuple(x.shape)}")
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
    if l < MIN_SEQLEN:
        x = _pad_rows(x, MIN_SEQLEN)
        seq = None if seq is None else _pad_rows(seq, MIN_SEQLEN, value=-1)
    silu = activation in ("silu", "swish")
    dims = dict(b=b, l=x.shape[2], d=d, w=width, cl=int(x.stride(1) == 1), seq=int(seq_idx is not None),
                act=int(silu), dt=str(x.dtype).replace("torch.", ""))
    return x, w4, bias, seq, silu, dims, l


def causal_conv1d_fwd_helion(x, weight, bias=None, seq_idx=None, activation=None):
    """Forward. x (b, d, l) (channel-last strides welcome), weight (d, w), bias (d,) or None,
    seq_idx (b, l) int or None (negative: padding, output 0), activation None/"silu"/"swish". Returns out (b, d, l)
    in x's dtype, channel-last (``out.stride(1) == 1``), like causal-conv1d's channel-last path."""
    x, w4, bias, seq, silu, dims, l = _conv_prep(x, weight, bias, seq_idx, activation)
    args = (x.transpose(1, 2), w4, bias, seq, silu)
    out = first_use.tuned_call("conv1d_fwd", causal_conv1d_fwd_kernel, args, dims, CONV_FWD_DEFAULT)
    out = out.transpose(1, 2)
    return out if out.shape[2] == l else out[..., :l]


def causal_conv1d_bwd_helion(x, weight, bias, dout, seq_idx=None, activation=None, dx=None):
    """Backward of ``causal_conv1d_fwd_helion`` (same x/weight/bias/seq_idx/activation) given dout
    (b, d, l). ``dx`` may be a preallocated (b, d, l) output (e.g. a slice of dzxbcdt, as mamba-ssm
    passes to causal_conv1d_bwd_function). Returns ``(dx, dweight, dbias or None)`` with dweight in
    weight's dtype and dbias in bias's dtype."""
    if dout.shape != x.shape:
        raise ValueError(f"dout must be {tuple(x.shape)}, got {tuple(dout.shape)}")
    if dx is not None and dx.shape != x.shape:
        raise ValueError(f"dx must be {tuple(x.shape)}, got {tuple(dx.shape)}")
    given = dx
    x, w4, bias, seq, silu, dims, l = _conv_prep(x, weight, bias, seq_idx, activation)
    padded = x.shape[2] != l
    if padded:
        dout = _pad_rows(dout, x.shape[2])
    if dx is None or padded:
        dx = torch.empty(x.shape[0], x.shape[2], x.shape[1], dtype=x.dtype, device=x.device).transpose(1, 2)
    args = (x.transpose(1, 2), w4, bias, dout.transpose(1, 2), seq, dx.transpose(1, 2), silu)
    dw_part, db_part = first_use.tuned_call("conv1d_bwd", causal_conv1d_bwd_kernel, args, dims, CONV_BWD_DEFAULT,
                                            finalize=conv_bwd_final, prepare=conv_bwd_poison)
    if padded:
        dx = dx[..., :l]
        if given is not None:
            dx = given.copy_(dx)
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
        ctx.settings = tuning.runtime().settings  # the backward (autograd's thread) runs under the same runtime
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias, seq_idx = ctx.saved_tensors
        with tuning.use(ctx.settings):
            dx, dw, db = causal_conv1d_bwd_helion(x, weight, bias, dout, seq_idx, ctx.activation)
        return dx, dw, db, None, None


def causal_conv1d_helion(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                         final_states_out=None, activation=None):
    """causal-conv1d 1.7.0's ``causal_conv1d_fn`` (same signature and semantics, autograd) on the Helion kernels.

    ``initial_states`` / ``return_final_states`` / ``final_states_out`` (chunked continuation of a sequence) are not
    implemented and raise NotImplementedError naming the argument; everything else is supported."""
    for name, value, unset in (("initial_states", initial_states, None), ("return_final_states", return_final_states, False),
                               ("final_states_out", final_states_out, None)):
        if value is not unset and not (unset is False and value is False):
            raise NotImplementedError(f"causal_conv1d_helion: {name} is not supported (no conv state carry-over)")
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError("activation must be None, silu, or swish")
    return CausalConv1dHelionFn.apply(x, weight, bias, seq_idx, activation)


def causal_conv1d_update_helion(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                                conv_state_indices=None):
    """causal-conv1d's ``causal_conv1d_update`` (decoding with a rolling conv state): not implemented."""
    raise NotImplementedError("causal_conv1d_update (conv_state decoding) is not supported by the helion backend "
                              "(training ops only)")




def _conv_case(kind: str):
    def build(dims: dict, device) -> tuner.TuneCase:
        # the fused op runs the conv over the sequence padded to whole chunks (its zxbcdt is padded once); with
        # packed documents (model dim "docs" > 1) it passes their seq_idx, padded likewise
        b, l = dims["b"], padded_len(dims["l"], dims["c"])
        d = dims["h"] * dims["p"] + 2 * dims["g"] * dims["n"]  # conv channels (x, B, C)
        width_total = 2 * dims["h"] * dims["p"] + 2 * dims["g"] * dims["n"] + dims["h"]  # zxBCdt
        gen = torch.Generator(device="cpu").manual_seed(0)
        zx = torch.randn(b, l, width_total, generator=gen).to(device=device, dtype=torch.bfloat16)
        off = dims["h"] * dims["p"]
        xbc = zx[:, :, off:off + d].transpose(1, 2)  # channel-last strided view, as in the fused path
        w = (0.5 * torch.randn(d, dims["w"], generator=gen)).to(device=device, dtype=torch.bfloat16)
        bias = (0.1 * torch.randn(d, generator=gen)).to(device=device, dtype=torch.bfloat16)
        seq_idx = docs_seq_idx(b, dims["l"], l, dims.get("docs", 1), device)
        x, w4, bias, seq, silu, kd, _ = _conv_prep(xbc, w, bias, seq_idx, "silu")
        if kind == "fwd":
            args = (x.transpose(1, 2), w4, bias, seq, silu)
            # block_sizes = [lanes per program, channel block]; l_per_lane rows per lane
            seeds = (tuner.grid_seeds(l_per_lane=[32, 64, 128], block_sizes=[[2, 128], [4, 128], [2, 256]],
                                       num_warps=[4])
                     + tuner.grid_seeds(l_per_lane=[64], block_sizes=[[8, 256], [4, 512]], num_warps=[8])
                     # unrolled walk (range_unroll_factors: [grid, walk])
                     + tuner.grid_seeds(l_per_lane=[64, 128], block_sizes=[[4, 128], [2, 256], [8, 64]],
                                         num_warps=[4], range_unroll_factors=[[0, 2], [0, 4]]))
            return tuner.TuneCase(causal_conv1d_fwd_kernel, args, kd, CONV_FWD_DEFAULT, seeds, atol=2e-2, rtol=2e-2)
        dout = torch.randn(b, l, d, generator=gen).to(device=device, dtype=torch.bfloat16)
        dxb = torch.empty(b, l, d, dtype=torch.bfloat16, device=device)
        args = (x.transpose(1, 2), w4, bias, dout, seq, dxb, silu)
        # block_sizes = [lanes per program, channel block]; l_per_lane rows per lane
        seeds = (tuner.grid_seeds(l_per_lane=[32, 64, 128], block_sizes=[[2, 128], [4, 128], [2, 256], [1, 512]],
                                   num_warps=[4])
                 + tuner.grid_seeds(l_per_lane=[64], block_sizes=[[8, 256], [16, 128], [4, 512]], num_warps=[8])
                 # unrolled walk (range_unroll_factors: [grid, main walk, 3-row tail]): the rolling
                 # window's register moves become renames
                 + tuner.grid_seeds(l_per_lane=[64, 128], block_sizes=[[4, 128], [2, 256], [1, 512], [8, 64]],
                                     num_warps=[4], range_unroll_factors=[[0, 2, 0], [0, 4, 0]]))
        # Compared on the final results (dx written into its buffer, summed dweight/dbias): the
        # partials' count depends on the lanes per program. dx is poisoned before each checked run.
        return tuner.TuneCase(causal_conv1d_bwd_kernel, args, kd, CONV_BWD_DEFAULT, seeds, atol=2e-2, rtol=2e-2,
                               n_random=16, finalize=conv_bwd_final, prepare=conv_bwd_poison)

    return build


def _conv_dims(dims: dict) -> dict:
    """The kernel dims of ``_conv_case`` at model dims ``dims``: the fused op's channel-last bf16 conv over x, B, C,
    the sequence padded to whole chunks, SiLU, seq_idx where ``dims`` pack documents ("docs" > 1)."""
    return dict(b=dims["b"], l=padded_len(dims["l"], dims["c"]), d=dims["h"] * dims["p"] + 2 * dims["g"] * dims["n"],
                w=dims["w"], cl=1, seq=int(dims.get("docs", 1) > 1), act=1, dt="bfloat16")


TUNABLE_KERNELS = {"conv1d_fwd": tuner.TunableKernel(_conv_case("fwd"), _conv_dims),
                   "conv1d_bwd": tuner.TunableKernel(_conv_case("bwd"), _conv_dims)}
