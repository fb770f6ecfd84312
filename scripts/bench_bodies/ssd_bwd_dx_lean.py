"""ssd_bwd_dx with fewer values live across its column loop, for bench_configs.py --body and triton_source-style
register checks: x's rows loaded again after the loop instead of keeping their fp32 copy (``ssd_bwd_dx_xf2``); that
and the state part's B.dL^T starting the dot accumulator (``ssd_bwd_dx_lean``); ``lean`` with x's rows loaded again
inside the loop (``ssd_bwd_dx_lean_xloop``); ``lean`` with the state term joining the column sums
(``ssd_bwd_dx_lean_colst``)."""
from __future__ import annotations

import helion
import helion.language as hl
import torch

from kernels import tuning

_LOG2E = 1.4426950408889634


@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def ssd_bwd_dx_xf2(
    x: torch.Tensor,  # (b, nc, c, h, p)
    dout_x: torch.Tensor,  # (b, nc, c, h, p)
    B: torch.Tensor,  # (b, nc, c, g, n)
    CB: torch.Tensor,  # (b, nc, g, c, c) fp32 or x.dtype, CB[t, s], zero across sequences
    dt: torch.Tensor,  # (b, h, nc, c) fp32
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    dL: torch.Tensor,  # (b, nc, h, p, n) x.dtype: gradient of the chunk's local state
    last_keep: torch.Tensor | None,  # (b, nc, c) fp32: 1 where the token is in the chunk's last sequence; None: all
    Dw: torch.Tensor,  # (h, p) fp32 (zeros when there is no D)
    dx: torch.Tensor,  # (b, nc, c, h, p) written (may be a strided view)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b, nc, c, h, p = x.shape
    g = B.shape[3]
    hpg = h // g
    bm = hl.register_block_size(16, 128)
    bk = hl.register_block_size(16, 128)
    nst = (c + bm - 1) // bm  # row tiles per chunk (1 when a config's bm exceeds the chunk)
    ddt = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    ddacs_row_part = torch.zeros([b, h, nc, nst, c], dtype=torch.float32, device=x.device)
    ddacs_col = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    dD_part = torch.empty([b, nc, nst, h, p], dtype=torch.float32, device=x.device)
    for ts, th, tc, tb in hl.tile([c, h, nc, b], block_size=[bm, 1, 1, 1]):
        ib = tb.begin
        ic = tc.begin
        ih = th.begin
        ig = ih // hpg
        js = ts.id
        xs = x[ib, ic, ts, ih, :]  # (bm, p)
        xf = xs.to(torch.float32)
        dts = dt[ib, ih, ic, ts]
        acs = dA_cumsum[ib, ih, ic, ts]
        a_last = dA_cumsum[ib, ih, ic, c - 1]
        decay_s = torch.exp2(torch.clamp(a_last - acs, max=0.0) * _LOG2E)
        if last_keep is not None:
            decay_s = decay_s * last_keep[ib, ic, ts]
        dls = dL[ib, ic, ih, :, :].to(x.dtype)
        # state part: d(L_c)/dx for these rows, and its d/d(-dAcs[s]) term
        a2 = hl.dot(B[ib, ic, ts, ig, :], dls.T) * decay_s[:, None]  # (bm, p)
        st = dts * torch.sum(a2 * xf, dim=1)
        st_sum = torch.sum(st, dim=0)
        # the diagonal tile (t in ts): dout_x[ts] is read once, for it and for dx's D term
        dox_b = dout_x[ib, ic, ts, ih, :]  # (bm, p)
        causal = ts.index[None, :] >= ts.index[:, None]
        acs2 = acs * _LOG2E
        segd = acs2[None, :] - acs2[:, None]  # (s, t) on the diagonal tile, log2 units
        md = CB[ib, ic, ig, ts, ts].T * torch.exp2(torch.clamp(torch.where(causal, segd, float("-inf")), max=0.0))
        a1 = hl.dot(md.to(x.dtype), dox_b)
        wd = md * dts[:, None] * hl.dot(xs, dox_b.T)
        rowd = torch.sum(wd, dim=0) + torch.where(ts.index == c - 1, st_sum, 0.0)
        ddacs_row_part[ib, ih, ic, js, ts] = rowd
        col = torch.sum(wd, dim=1)
        # the tiles right of it: every (s, t) causal, no mask
        for tt in hl.tile(ts.end, c, block_size=bk):
            dot_ = dout_x[ib, ic, tt, ih, :]  # (bk, p)
            act = dA_cumsum[ib, ih, ic, tt]
            seg = act[None, :] * _LOG2E - acs2[:, None]  # (bm, bk): (dAcs[t] - dAcs[s]) log2(e), <= 0 up to rounding
            # clamp: lanes of a tile past the chunk end (whenever bk does not divide c - ts.end: bm != bk, or a block
            # above the chunk) load dA_cumsum = 0 and would give exp2(-dAcs[s] log2(e)) = inf for long chunks, and
            # inf * 0 = NaN
            mt = CB[ib, ic, ig, tt, ts].T * torch.exp2(torch.clamp(seg, max=0.0))
            a1 = hl.dot(mt.to(x.dtype), dot_, acc=a1)
            gt = hl.dot(xs, dot_.T)  # (s, t): x[s] . dout_x[t]
            w = mt * dts[:, None] * gt
            row = torch.sum(w, dim=0) + torch.where(tt.index == c - 1, st_sum, 0.0)
            ddacs_row_part[ib, ih, ic, js, tt] = row
            col = col + torch.sum(w, dim=1)
        a = a1 + a2
        dox_s = dox_b.to(torch.float32)
        dx[ib, ic, ts, ih, :] = (a * dts[:, None] + dox_s * Dw[ih, :][None, :]).to(dx.dtype)
        xf2 = x[ib, ic, ts, ih, :].to(torch.float32)  # x's rows again: xf is not kept across the column loop
        ddt[ib, ih, ic, ts] = torch.sum(a * xf2, dim=1)
        ddacs_col[ib, ih, ic, ts] = -col - st
        dD_part[ib, ic, js, ih, :] = torch.sum(dox_s * xf2, dim=0)
    return ddt, ddacs_row_part, ddacs_col, dD_part


@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def ssd_bwd_dx_lean(
    x: torch.Tensor,  # (b, nc, c, h, p)
    dout_x: torch.Tensor,  # (b, nc, c, h, p)
    B: torch.Tensor,  # (b, nc, c, g, n)
    CB: torch.Tensor,  # (b, nc, g, c, c) fp32 or x.dtype, CB[t, s], zero across sequences
    dt: torch.Tensor,  # (b, h, nc, c) fp32
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    dL: torch.Tensor,  # (b, nc, h, p, n) x.dtype: gradient of the chunk's local state
    last_keep: torch.Tensor | None,  # (b, nc, c) fp32: 1 where the token is in the chunk's last sequence; None: all
    Dw: torch.Tensor,  # (h, p) fp32 (zeros when there is no D)
    dx: torch.Tensor,  # (b, nc, c, h, p) written (may be a strided view)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b, nc, c, h, p = x.shape
    g = B.shape[3]
    hpg = h // g
    bm = hl.register_block_size(16, 128)
    bk = hl.register_block_size(16, 128)
    nst = (c + bm - 1) // bm  # row tiles per chunk (1 when a config's bm exceeds the chunk)
    ddt = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    ddacs_row_part = torch.zeros([b, h, nc, nst, c], dtype=torch.float32, device=x.device)
    ddacs_col = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    dD_part = torch.empty([b, nc, nst, h, p], dtype=torch.float32, device=x.device)
    for ts, th, tc, tb in hl.tile([c, h, nc, b], block_size=[bm, 1, 1, 1]):
        ib = tb.begin
        ic = tc.begin
        ih = th.begin
        ig = ih // hpg
        js = ts.id
        xs = x[ib, ic, ts, ih, :]  # (bm, p)
        xf = xs.to(torch.float32)
        dts = dt[ib, ih, ic, ts]
        acs = dA_cumsum[ib, ih, ic, ts]
        a_last = dA_cumsum[ib, ih, ic, c - 1]
        decay_s = torch.exp2(torch.clamp(a_last - acs, max=0.0) * _LOG2E)
        if last_keep is not None:
            decay_s = decay_s * last_keep[ib, ic, ts]
        dls = dL[ib, ic, ih, :, :].to(x.dtype)
        # state part: d(L_c)/dx for these rows, and its d/d(-dAcs[s]) term
        a2 = hl.dot(B[ib, ic, ts, ig, :], dls.T) * decay_s[:, None]  # (bm, p)
        st = dts * torch.sum(a2 * xf, dim=1)
        st_sum = torch.sum(st, dim=0)
        # the diagonal tile (t in ts): dout_x[ts] is read once, for it and for dx's D term
        dox_b = dout_x[ib, ic, ts, ih, :]  # (bm, p)
        causal = ts.index[None, :] >= ts.index[:, None]
        acs2 = acs * _LOG2E
        segd = acs2[None, :] - acs2[:, None]  # (s, t) on the diagonal tile, log2 units
        md = CB[ib, ic, ig, ts, ts].T * torch.exp2(torch.clamp(torch.where(causal, segd, float("-inf")), max=0.0))
        a1 = hl.dot(md.to(x.dtype), dox_b, acc=a2)  # the state part's a2 starts the accumulator
        wd = md * dts[:, None] * hl.dot(xs, dox_b.T)
        rowd = torch.sum(wd, dim=0) + torch.where(ts.index == c - 1, st_sum, 0.0)
        ddacs_row_part[ib, ih, ic, js, ts] = rowd
        col = torch.sum(wd, dim=1)
        # the tiles right of it: every (s, t) causal, no mask
        for tt in hl.tile(ts.end, c, block_size=bk):
            dot_ = dout_x[ib, ic, tt, ih, :]  # (bk, p)
            act = dA_cumsum[ib, ih, ic, tt]
            seg = act[None, :] * _LOG2E - acs2[:, None]  # (bm, bk): (dAcs[t] - dAcs[s]) log2(e), <= 0 up to rounding
            # clamp: lanes of a tile past the chunk end (whenever bk does not divide c - ts.end: bm != bk, or a block
            # above the chunk) load dA_cumsum = 0 and would give exp2(-dAcs[s] log2(e)) = inf for long chunks, and
            # inf * 0 = NaN
            mt = CB[ib, ic, ig, tt, ts].T * torch.exp2(torch.clamp(seg, max=0.0))
            a1 = hl.dot(mt.to(x.dtype), dot_, acc=a1)
            gt = hl.dot(xs, dot_.T)  # (s, t): x[s] . dout_x[t]
            w = mt * dts[:, None] * gt
            row = torch.sum(w, dim=0) + torch.where(tt.index == c - 1, st_sum, 0.0)
            ddacs_row_part[ib, ih, ic, js, tt] = row
            col = col + torch.sum(w, dim=1)
        a = a1
        dox_s = dox_b.to(torch.float32)
        dx[ib, ic, ts, ih, :] = (a * dts[:, None] + dox_s * Dw[ih, :][None, :]).to(dx.dtype)
        xf2 = x[ib, ic, ts, ih, :].to(torch.float32)  # x's rows again: xf is not kept across the column loop
        ddt[ib, ih, ic, ts] = torch.sum(a * xf2, dim=1)
        ddacs_col[ib, ih, ic, ts] = -col - st
        dD_part[ib, ic, js, ih, :] = torch.sum(dox_s * xf2, dim=0)
    return ddt, ddacs_row_part, ddacs_col, dD_part


@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def ssd_bwd_dx_lean_xloop(
    x: torch.Tensor,  # (b, nc, c, h, p)
    dout_x: torch.Tensor,  # (b, nc, c, h, p)
    B: torch.Tensor,  # (b, nc, c, g, n)
    CB: torch.Tensor,  # (b, nc, g, c, c) fp32 or x.dtype, CB[t, s], zero across sequences
    dt: torch.Tensor,  # (b, h, nc, c) fp32
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    dL: torch.Tensor,  # (b, nc, h, p, n) x.dtype: gradient of the chunk's local state
    last_keep: torch.Tensor | None,  # (b, nc, c) fp32: 1 where the token is in the chunk's last sequence; None: all
    Dw: torch.Tensor,  # (h, p) fp32 (zeros when there is no D)
    dx: torch.Tensor,  # (b, nc, c, h, p) written (may be a strided view)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b, nc, c, h, p = x.shape
    g = B.shape[3]
    hpg = h // g
    bm = hl.register_block_size(16, 128)
    bk = hl.register_block_size(16, 128)
    nst = (c + bm - 1) // bm  # row tiles per chunk (1 when a config's bm exceeds the chunk)
    ddt = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    ddacs_row_part = torch.zeros([b, h, nc, nst, c], dtype=torch.float32, device=x.device)
    ddacs_col = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    dD_part = torch.empty([b, nc, nst, h, p], dtype=torch.float32, device=x.device)
    for ts, th, tc, tb in hl.tile([c, h, nc, b], block_size=[bm, 1, 1, 1]):
        ib = tb.begin
        ic = tc.begin
        ih = th.begin
        ig = ih // hpg
        js = ts.id
        xs = x[ib, ic, ts, ih, :]  # (bm, p)
        xf = xs.to(torch.float32)
        dts = dt[ib, ih, ic, ts]
        acs = dA_cumsum[ib, ih, ic, ts]
        a_last = dA_cumsum[ib, ih, ic, c - 1]
        decay_s = torch.exp2(torch.clamp(a_last - acs, max=0.0) * _LOG2E)
        if last_keep is not None:
            decay_s = decay_s * last_keep[ib, ic, ts]
        dls = dL[ib, ic, ih, :, :].to(x.dtype)
        # state part: d(L_c)/dx for these rows, and its d/d(-dAcs[s]) term
        a2 = hl.dot(B[ib, ic, ts, ig, :], dls.T) * decay_s[:, None]  # (bm, p)
        st = dts * torch.sum(a2 * xf, dim=1)
        st_sum = torch.sum(st, dim=0)
        # the diagonal tile (t in ts): dout_x[ts] is read once, for it and for dx's D term
        dox_b = dout_x[ib, ic, ts, ih, :]  # (bm, p)
        causal = ts.index[None, :] >= ts.index[:, None]
        acs2 = acs * _LOG2E
        segd = acs2[None, :] - acs2[:, None]  # (s, t) on the diagonal tile, log2 units
        md = CB[ib, ic, ig, ts, ts].T * torch.exp2(torch.clamp(torch.where(causal, segd, float("-inf")), max=0.0))
        a1 = hl.dot(md.to(x.dtype), dox_b, acc=a2)  # the state part's a2 starts the accumulator
        wd = md * dts[:, None] * hl.dot(xs, dox_b.T)
        rowd = torch.sum(wd, dim=0) + torch.where(ts.index == c - 1, st_sum, 0.0)
        ddacs_row_part[ib, ih, ic, js, ts] = rowd
        col = torch.sum(wd, dim=1)
        # the tiles right of it: every (s, t) causal, no mask
        for tt in hl.tile(ts.end, c, block_size=bk):
            dot_ = dout_x[ib, ic, tt, ih, :]  # (bk, p)
            act = dA_cumsum[ib, ih, ic, tt]
            seg = act[None, :] * _LOG2E - acs2[:, None]  # (bm, bk): (dAcs[t] - dAcs[s]) log2(e), <= 0 up to rounding
            # clamp: lanes of a tile past the chunk end (whenever bk does not divide c - ts.end: bm != bk, or a block
            # above the chunk) load dA_cumsum = 0 and would give exp2(-dAcs[s] log2(e)) = inf for long chunks, and
            # inf * 0 = NaN
            mt = CB[ib, ic, ig, tt, ts].T * torch.exp2(torch.clamp(seg, max=0.0))
            a1 = hl.dot(mt.to(x.dtype), dot_, acc=a1)
            gt = hl.dot(x[ib, ic, ts, ih, :], dot_.T)  # (s, t): x[s] . dout_x[t] (x's rows loaded again: not kept across the loop)
            w = mt * dts[:, None] * gt
            row = torch.sum(w, dim=0) + torch.where(tt.index == c - 1, st_sum, 0.0)
            ddacs_row_part[ib, ih, ic, js, tt] = row
            col = col + torch.sum(w, dim=1)
        a = a1
        dox_s = dox_b.to(torch.float32)
        dx[ib, ic, ts, ih, :] = (a * dts[:, None] + dox_s * Dw[ih, :][None, :]).to(dx.dtype)
        xf2 = x[ib, ic, ts, ih, :].to(torch.float32)  # x's rows again: xf is not kept across the column loop
        ddt[ib, ih, ic, ts] = torch.sum(a * xf2, dim=1)
        ddacs_col[ib, ih, ic, ts] = -col - st
        dD_part[ib, ic, js, ih, :] = torch.sum(dox_s * xf2, dim=0)
    return ddt, ddacs_row_part, ddacs_col, dD_part


@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def ssd_bwd_dx_lean_colst(
    x: torch.Tensor,  # (b, nc, c, h, p)
    dout_x: torch.Tensor,  # (b, nc, c, h, p)
    B: torch.Tensor,  # (b, nc, c, g, n)
    CB: torch.Tensor,  # (b, nc, g, c, c) fp32 or x.dtype, CB[t, s], zero across sequences
    dt: torch.Tensor,  # (b, h, nc, c) fp32
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    dL: torch.Tensor,  # (b, nc, h, p, n) x.dtype: gradient of the chunk's local state
    last_keep: torch.Tensor | None,  # (b, nc, c) fp32: 1 where the token is in the chunk's last sequence; None: all
    Dw: torch.Tensor,  # (h, p) fp32 (zeros when there is no D)
    dx: torch.Tensor,  # (b, nc, c, h, p) written (may be a strided view)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b, nc, c, h, p = x.shape
    g = B.shape[3]
    hpg = h // g
    bm = hl.register_block_size(16, 128)
    bk = hl.register_block_size(16, 128)
    nst = (c + bm - 1) // bm  # row tiles per chunk (1 when a config's bm exceeds the chunk)
    ddt = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    ddacs_row_part = torch.zeros([b, h, nc, nst, c], dtype=torch.float32, device=x.device)
    ddacs_col = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    dD_part = torch.empty([b, nc, nst, h, p], dtype=torch.float32, device=x.device)
    for ts, th, tc, tb in hl.tile([c, h, nc, b], block_size=[bm, 1, 1, 1]):
        ib = tb.begin
        ic = tc.begin
        ih = th.begin
        ig = ih // hpg
        js = ts.id
        xs = x[ib, ic, ts, ih, :]  # (bm, p)
        xf = xs.to(torch.float32)
        dts = dt[ib, ih, ic, ts]
        acs = dA_cumsum[ib, ih, ic, ts]
        a_last = dA_cumsum[ib, ih, ic, c - 1]
        decay_s = torch.exp2(torch.clamp(a_last - acs, max=0.0) * _LOG2E)
        if last_keep is not None:
            decay_s = decay_s * last_keep[ib, ic, ts]
        dls = dL[ib, ic, ih, :, :].to(x.dtype)
        # state part: d(L_c)/dx for these rows, and its d/d(-dAcs[s]) term
        a2 = hl.dot(B[ib, ic, ts, ig, :], dls.T) * decay_s[:, None]  # (bm, p)
        st = dts * torch.sum(a2 * xf, dim=1)
        st_sum = torch.sum(st, dim=0)
        # the diagonal tile (t in ts): dout_x[ts] is read once, for it and for dx's D term
        dox_b = dout_x[ib, ic, ts, ih, :]  # (bm, p)
        causal = ts.index[None, :] >= ts.index[:, None]
        acs2 = acs * _LOG2E
        segd = acs2[None, :] - acs2[:, None]  # (s, t) on the diagonal tile, log2 units
        md = CB[ib, ic, ig, ts, ts].T * torch.exp2(torch.clamp(torch.where(causal, segd, float("-inf")), max=0.0))
        a1 = hl.dot(md.to(x.dtype), dox_b, acc=a2)  # the state part's a2 starts the accumulator
        wd = md * dts[:, None] * hl.dot(xs, dox_b.T)
        rowd = torch.sum(wd, dim=0) + torch.where(ts.index == c - 1, st_sum, 0.0)
        ddacs_row_part[ib, ih, ic, js, ts] = rowd
        col = torch.sum(wd, dim=1) + st  # st joins the column sums: one value live across the loop
        # the tiles right of it: every (s, t) causal, no mask
        for tt in hl.tile(ts.end, c, block_size=bk):
            dot_ = dout_x[ib, ic, tt, ih, :]  # (bk, p)
            act = dA_cumsum[ib, ih, ic, tt]
            seg = act[None, :] * _LOG2E - acs2[:, None]  # (bm, bk): (dAcs[t] - dAcs[s]) log2(e), <= 0 up to rounding
            # clamp: lanes of a tile past the chunk end (whenever bk does not divide c - ts.end: bm != bk, or a block
            # above the chunk) load dA_cumsum = 0 and would give exp2(-dAcs[s] log2(e)) = inf for long chunks, and
            # inf * 0 = NaN
            mt = CB[ib, ic, ig, tt, ts].T * torch.exp2(torch.clamp(seg, max=0.0))
            a1 = hl.dot(mt.to(x.dtype), dot_, acc=a1)
            gt = hl.dot(xs, dot_.T)  # (s, t): x[s] . dout_x[t]
            w = mt * dts[:, None] * gt
            row = torch.sum(w, dim=0) + torch.where(tt.index == c - 1, st_sum, 0.0)
            ddacs_row_part[ib, ih, ic, js, tt] = row
            col = col + torch.sum(w, dim=1)
        a = a1
        dox_s = dox_b.to(torch.float32)
        dx[ib, ic, ts, ih, :] = (a * dts[:, None] + dox_s * Dw[ih, :][None, :]).to(dx.dtype)
        xf2 = x[ib, ic, ts, ih, :].to(torch.float32)  # x's rows again: xf is not kept across the column loop
        ddt[ib, ih, ic, ts] = torch.sum(a * xf2, dim=1)
        ddacs_col[ib, ih, ic, ts] = -col
        dD_part[ib, ic, js, ih, :] = torch.sum(dox_s * xf2, dim=0)
    return ddt, ddacs_row_part, ddacs_col, dD_part
