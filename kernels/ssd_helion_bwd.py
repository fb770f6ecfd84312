"""Helion backward kernels for the Mamba-2 SSD (chunked scan), mamba-ssm 2.3.2 math and layouts.

Forward (per chunk ``c`` of ``chunk_size`` tokens, head ``h`` of group ``g``; S_c = state entering
chunk c, L_c = the chunk's local state):
    out_x[t] = exp(dAcs[t]) C[t] S_c^T  +  sum_{s<=t} CB[t,s] exp(dAcs[t]-dAcs[s]) dt[s] x[s]  +  D x[t]
    out      = out_x * silu(z)
    L_c      = sum_s exp(dAcs[last]-dAcs[s]) dt[s] x[s]^T B[s]  ;   S_{c+1} = exp(dAcs_c[last]) S_c + L_c

The ten mamba-ssm backward kernels (B1..B10 in kernels_facts.md) map onto six Helion kernels (seven with the z-free variant of the first):

==========================  ==========================================================  ================
kernel                       computes                                                    grid
==========================  ==========================================================  ================
``ssd_bwd_dz_dstates``       B1 + B2: dout_x = dout*silu(z), dz, dstates = dout_x^T (C e^dAcs)  (h, nc, b)
``ssd_bwd_dstates``          B2 without z (dout is dout_x): dstates                        (h, nc, b)
``ssd_bwd_state_passing``    B3: reverse serial pass over chunks -> dL_c, ddA_chunk, dinit  (b, h, splits)
``ssd_bwd_dx``               B4 (+ intra-chunk part of B9): dx, ddt, dD, ddAcs (row/col)     (row tiles, h, nc, b)
``ssd_bwd_dc_dcb``           B6 + B7 + B8 (dC): dC, dCB (to memory), B6's ddAcs_prev       (row tiles, g, nc, b)
``ssd_bwd_db``               B5 + B8 (dB): dB from dL and dCB                             (row tiles, g, nc, b)
``ssd_bwd_dt``               B9's cumsum + B10: ddA -> ddt (softplus/clamp), dA, ddt_bias     (b, nc, h)
==========================  ==========================================================  ================

Reductions across programs (dD, dA, ddt_bias, ddA_chunk over state splits) are written as
per-program partial sums and reduced by ``torch.sum`` in a fixed order; no kernel uses atomics.
So gradients are bitwise repeatable under every config, and ``kernels.deterministic=true`` (recorded on the
backend, ``KernelBackend.deterministic``) costs nothing here. (mamba-ssm's deterministic mode instead falls back
to its cheapest autotune config.)

Input layouts (the same as ``kernels/ssd.py`` and mamba-ssm): x/dout/z/out_x (b, l, h, p),
B/C (b, l, g, n), dt_out/dA_cumsum (b, h, nc, c) fp32, states_in (b, nc, h, p, n) x.dtype or fp32,
CB (b, nc, g, c, c) fp32 or x's dtype, seq_idx (b, l) int. A seqlen that is not a multiple of chunk_size is handled by
padding.
"""

from __future__ import annotations

import functools
import math

import torch

import helion
import helion.language as hl

from kernels import first_use, tuning
from kernels import tuner  # noqa: E402
from kernels.derived import derived
from kernels.ssd import _pad_len, _pad_seq_idx
from kernels.shapes import padded_len
from kernels.ssd_helion import _check_lengths

_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------
# kernels


# ssd_bwd_dz_dstates: grid (h, nc, b), heads fastest: the heads of a group, which read the same C chunk, run side by
#   side (batch first puts them b * nc programs apart). dz and dout_x = dout * silu(z) per row tile, and
#   dstates = dout_x^T (C e^dAcs) with the row scale exp(dAcs[t]) applied to dout_x (c*p multiplies per head, folded
#   into the rounding to x's dtype that dout_x needs anyway) so C goes from memory straight into the dot.
@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def ssd_bwd_dz_dstates(
    dout: torch.Tensor,  # (b, nc, c, h, p)
    z: torch.Tensor,  # (b, nc, c, h, p)
    out_x: torch.Tensor,  # (b, nc, c, h, p)
    C: torch.Tensor,  # (b, nc, c, g, n)
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    prev_keep: torch.Tensor | None,  # (b, nc, c) fp32; None without seq_idx (all ones)
    dz: torch.Tensor,  # (b, nc, c, h, p) written (may be a strided view)
    dstates_like: torch.Tensor,  # empty tensor of dstates' dtype (x.dtype, or fp32: dstates_dtype)
) -> tuple[torch.Tensor, torch.Tensor]:
    b, nc, c, h, p = dout.shape
    g = C.shape[3]
    n = C.shape[4]
    hpg = h // g
    dout_x = torch.empty_like(dout)
    dstates = torch.empty([b, nc, h, p, n], dtype=dstates_like.dtype, device=dout.device)
    bk = hl.register_block_size(16, 128)
    for ih, ic, ib in hl.grid([h, nc, b]):
        ig = ih // hpg
        acc = hl.zeros([p, n], dtype=torch.float32)
        for tt in hl.tile(c, block_size=bk):
            do = dout[ib, ic, tt, ih, :].to(torch.float32)
            zz = z[ib, ic, tt, ih, :].to(torch.float32)
            sz = torch.sigmoid(zz)
            dsz = do * sz
            dz[ib, ic, tt, ih, :] = (dsz * out_x[ib, ic, tt, ih, :].to(torch.float32) * (1.0 + zz * (1.0 - sz))).to(dz.dtype)
            dox = dsz * zz
            dout_x[ib, ic, tt, ih, :] = dox.to(dout.dtype)
            scale = torch.exp2(dA_cumsum[ib, ih, ic, tt] * _LOG2E)
            if prev_keep is not None:
                scale = scale * prev_keep[ib, ic, tt]
            doxs = (dox * scale[:, None]).to(dout.dtype)
            acc = hl.dot(doxs.T, C[ib, ic, tt, ig, :], acc=acc)
        dstates[ib, ic, ih, :, :] = acc.to(dstates.dtype)
    return dout_x, dstates


# ssd_bwd_dstates: ssd_bwd_dz_dstates without z, for an SSD whose output is not gated (the gate belongs to a norm that
#   runs after it, which hands this backward dout_x): dstates = dout_x^T (C e^dAcs), the same grid and the same
#   rounding of the scaled rows to x's dtype.
@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def ssd_bwd_dstates(
    dout_x: torch.Tensor,  # (b, nc, c, h, p)
    C: torch.Tensor,  # (b, nc, c, g, n)
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    prev_keep: torch.Tensor | None,  # (b, nc, c) fp32; None without seq_idx (all ones)
    dstates_like: torch.Tensor,  # empty tensor of dstates' dtype (x.dtype, or fp32: dstates_dtype)
) -> torch.Tensor:
    b, nc, c, h, p = dout_x.shape
    g = C.shape[3]
    n = C.shape[4]
    hpg = h // g
    dstates = torch.empty([b, nc, h, p, n], dtype=dstates_like.dtype, device=dout_x.device)
    bk = hl.register_block_size(16, 128)
    for ih, ic, ib in hl.grid([h, nc, b]):
        ig = ih // hpg
        acc = hl.zeros([p, n], dtype=torch.float32)
        for tt in hl.tile(c, block_size=bk):
            scale = torch.exp2(dA_cumsum[ib, ih, ic, tt] * _LOG2E)
            if prev_keep is not None:
                scale = scale * prev_keep[ib, ic, tt]
            doxs = (dout_x[ib, ic, tt, ih, :].to(torch.float32) * scale[:, None]).to(dout_x.dtype)
            acc = hl.dot(doxs.T, C[ib, ic, tt, ig, :], acc=acc)
        dstates[ib, ic, ih, :, :] = acc.to(dstates.dtype)
    return dstates


@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def ssd_bwd_state_passing(
    dstates: torch.Tensor,  # (b, nc, h, s, blk) x.dtype or fp32 (dstates_dtype; p*n split into s blocks)
    states_in: torch.Tensor,  # (b, nc, h, s, blk) x.dtype or fp32 (HelionSettings.bwd_states_dtype)
    dA_last: torch.Tensor,  # (b, h, nc) fp32
    keep: torch.Tensor | None,  # (b, nc) fp32: 0 where the carried state is reset at chunk c; None without seq_idx
    dfinal: torch.Tensor,  # (b, h, s, blk) fp32
    dl_like: torch.Tensor,  # empty tensor of dL's dtype (x.dtype: every reader of dL rounds it to x.dtype first)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, nc, h, s, blk = dstates.shape
    dL = torch.empty([b, nc, h, s, blk], dtype=dl_like.dtype, device=dstates.device)
    ddA_part = torch.empty([b, h, nc, s], dtype=torch.float32, device=dstates.device)
    dinit = torch.empty_like(dfinal)
    # The walk runs from the last chunk to the first; each step loads the next chunk's dstates, states_in and decay
    # before its own arithmetic, so their latency overlaps it (the first chunk's step is peeled after the loop).
    for ib, ih, isp in hl.grid([b, h, s]):
        gacc = dfinal[ib, ih, isp, :]
        ds_next = dstates[ib, nc - 1, ih, isp, :]
        st_next = states_in[ib, nc - 1, ih, isp, :]
        sc_next = torch.exp(dA_last[ib, ih, nc - 1])
        if keep is not None:
            sc_next = sc_next * keep[ib, nc - 1]
        for i in hl.grid(nc - 1):
            j = nc - 1 - i
            ds_j = ds_next
            st_j = st_next
            scale = sc_next
            ds_next = dstates[ib, j - 1, ih, isp, :]
            st_next = states_in[ib, j - 1, ih, isp, :]
            sc_next = torch.exp(dA_last[ib, ih, j - 1])
            if keep is not None:
                sc_next = sc_next * keep[ib, j - 1]
            dL[ib, j, ih, isp, :] = gacc.to(dL.dtype)
            ddA_part[ib, ih, j, isp] = torch.sum(gacc * st_j, dim=0) * scale
            gacc = ds_j + scale * gacc
        dL[ib, 0, ih, isp, :] = gacc.to(dL.dtype)
        ddA_part[ib, ih, 0, isp] = torch.sum(gacc * st_next, dim=0) * sc_next
        gacc = ds_next + sc_next * gacc
        dinit[ib, ih, isp, :] = gacc
    return dL, ddA_part, dinit


# ssd_bwd_dx: dx, ddt, dD and the intra-chunk ddA_cumsum terms over row tiles of the chunk. A program owns the rows s of
#   one tile (bm rows: 16384 programs at bm 64 at the Nano shape) and walks the column tiles t >= s only (the causal
#   half: 3/4 of the c x c products at bm = bk = c/2): a (bm x bm) diagonal tile, then (bm x bk) tiles. The per-column
#   sums over s (ddacs_row) span the row tiles, so each program writes its partial into its own slot of a
#   (b, h, nc, c / bm, c) buffer (zeros below its diagonal) that the caller sums; the whole-chunk sum of the state term
#   st goes into that partial at t = c - 1, which ssd_bwd_dt adds to the same place. dD is summed per row tile,
#   (b, nc, c / bm, h, p). Row tiles of one (chunk, head) are adjacent program ids, so dL[h] (p x n) and the group's CB
#   tile come from L2 for all but the first. The diagonal tile (t in the program's own rows) is computed before the
#   column loop: its causal mask stays out of the loop, and its dout_x rows serve dx's D term as well. Decays are exp2
#   of differences of log2(e)-scaled dA_cumsum.
@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def ssd_bwd_dx(
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
        ddt[ib, ih, ic, ts] = torch.sum(a * xf, dim=1)
        ddacs_col[ib, ih, ic, ts] = -col - st
        dD_part[ib, ic, js, ih, :] = torch.sum(dox_s * xf, dim=0)
    return ddt, ddacs_row_part, ddacs_col, dD_part


# ssd_bwd_dc_dcb + ssd_bwd_db: dB, dC and dCB as two kernels with dCB written to memory in between, as mamba-ssm does
#   (one kernel that keeps the whole-chunk dB accumulator, dC and dCB tiles live across serial head x tile loops runs
#   ~8 programs per SM with one CTA each, and memory latency is not hidden).
#   ssd_bwd_dc_dcb: grid (row tiles of c, g, nc, b), 2048 programs at bm 64 (the Nano config's loop order runs the
#     groups fastest). Per head: ds = dout_x[ti] @ S
#     (dC state part, ddacs_prev) and the dCB row block gts * decay * dt over the whole chunk. Then
#     dC[ti] += dCB[ti, :] @ B, and dCB is stored in x's dtype (the dots round it to that dtype anyway):
#     (b, nc, g, c, c) is 34 MB at the Nano shape.
#   ssd_bwd_db: grid (row tiles of c as s, g, nc, b). dB[s] = sum_h decay dt x_h[s] @ dL_h
#     + sum_{t >= s} dCB[t, s]^T C[t]. Registers: (bm x n) fp32 accumulators and one (bm x c) block.
@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def ssd_bwd_dc_dcb(
    x: torch.Tensor,  # (b, nc, c, h, p)
    dout_x: torch.Tensor,  # (b, nc, c, h, p)
    B: torch.Tensor,  # (b, nc, c, g, n)
    C: torch.Tensor,  # (b, nc, c, g, n)
    dt: torch.Tensor,  # (b, h, nc, c) fp32
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    states_in: torch.Tensor,  # (b, nc, h, p, n) fp32 or x.dtype
    same_seq: torch.Tensor | None,  # (b, nc, c, c) fp32; None without seq_idx (all ones)
    prev_keep: torch.Tensor | None,  # (b, nc, c) fp32; None without seq_idx
    dC: torch.Tensor,  # (b, nc, c, g, n) written (may be a strided view)
) -> tuple[torch.Tensor, torch.Tensor]:
    b, nc, c, h, p = x.shape
    g = B.shape[3]
    n = B.shape[4]
    hpg = h // g
    ddacs_prev = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    dCB = torch.empty([b, nc, g, c, c], dtype=x.dtype, device=x.device)
    bm = hl.register_block_size(16, 128)
    for ti, tg, tc, tb in hl.tile([c, g, nc, b], block_size=[bm, 1, 1, 1]):
        ib = tb.begin
        ic = tc.begin
        ig = tg.begin
        C_i = C[ib, ic, ti, ig, :].to(torch.float32)
        dc = hl.zeros([ti, n], dtype=torch.float32)
        dcb = hl.zeros([ti, c], dtype=torch.float32)
        for hh in hl.grid(hpg):
            ih = ig * hpg + hh
            acs_i = dA_cumsum[ib, ih, ic, ti]
            acs = dA_cumsum[ib, ih, ic, :]
            dot_i = dout_x[ib, ic, ti, ih, :]
            ds = hl.dot(dot_i, states_in[ib, ic, ih, :, :].to(x.dtype))  # (bm, n)
            pscale = torch.exp2(acs_i * _LOG2E)
            if prev_keep is not None:
                pscale = pscale * prev_keep[ib, ic, ti]
            dc = dc + ds * pscale[:, None]
            ddacs_prev[ib, ih, ic, ti] = torch.sum(ds * C_i, dim=1) * pscale
            gts = hl.dot(dot_i, x[ib, ic, :, ih, :].T)  # (bm, c): dout_x[t] . x[s]
            causal = ti.index[:, None] >= hl.arange(c)[None, :]
            seg = torch.clamp(torch.where(causal, acs_i[:, None] - acs[None, :], float("-inf")), max=0.0)  # see ssd_bwd_dx
            dcb = dcb + gts * torch.exp2(seg * _LOG2E) * dt[ib, ih, ic, :][None, :]
        if same_seq is not None:
            dcb = dcb * same_seq[ib, ic, ti, :]
        dcb_c = dcb.to(x.dtype)
        dCB[ib, ic, ig, ti, :] = dcb_c
        dc = hl.dot(dcb_c, B[ib, ic, :, ig, :], acc=dc)
        dC[ib, ic, ti, ig, :] = dc.to(dC.dtype)
    return ddacs_prev, dCB


@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def ssd_bwd_db(
    x: torch.Tensor,  # (b, nc, c, h, p)
    dCB: torch.Tensor,  # (b, nc, g, c, c) x.dtype, from ssd_bwd_dc_dcb
    C: torch.Tensor,  # (b, nc, c, g, n)
    dt: torch.Tensor,  # (b, h, nc, c) fp32
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    dL: torch.Tensor,  # (b, nc, h, p, n) fp32 or x.dtype
    last_keep: torch.Tensor | None,  # (b, nc, c) fp32; None without seq_idx
    dB: torch.Tensor,  # (b, nc, c, g, n) written (may be a strided view)
) -> torch.Tensor:
    b, nc, c, h, p = x.shape
    g = C.shape[3]
    n = C.shape[4]
    hpg = h // g
    bm = hl.register_block_size(16, 128)
    bk = hl.register_block_size(16, 128)
    for si, tg, tc, tb in hl.tile([c, g, nc, b], block_size=[bm, 1, 1, 1]):
        ib = tb.begin
        ic = tc.begin
        ig = tg.begin
        db = hl.zeros([si, n], dtype=torch.float32)
        for hh in hl.grid(hpg):
            ih = ig * hpg + hh
            acs_s = dA_cumsum[ib, ih, ic, si]
            a_last = dA_cumsum[ib, ih, ic, c - 1]
            sc = torch.exp2(torch.clamp(a_last - acs_s, max=0.0) * _LOG2E) * dt[ib, ih, ic, si]
            if last_keep is not None:
                sc = sc * last_keep[ib, ic, si]
            xsc = (x[ib, ic, si, ih, :].to(torch.float32) * sc[:, None]).to(x.dtype)
            db = hl.dot(xsc, dL[ib, ic, ih, :, :].to(x.dtype), acc=db)
        # dCB[t, s] is zero for t < s (causal): only the row tiles from this tile's start on
        for tt in hl.tile(si.begin, c, block_size=bk):
            db = hl.dot(dCB[ib, ic, ig, tt, si].T, C[ib, ic, tt, ig, :], acc=db)
        dB[ib, ic, si, ig, :] = db.to(dB.dtype)
    return dB


@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def ssd_bwd_dt(
    ddacs_row: torch.Tensor,  # (b, h, nc, c) fp32
    ddacs_col: torch.Tensor,  # (b, h, nc, c)
    ddacs_prev: torch.Tensor,  # (b, h, nc, c)
    ddA_chunk: torch.Tensor,  # (b, h, nc): gradient of dA_cumsum[..., -1] from state passing
    ddt_in: torch.Tensor,  # (b, h, nc, c): gradient of dt_out
    dt_out: torch.Tensor,  # (b, h, nc, c): dt after softplus/clamp (0 in padding)
    dt_in: torch.Tensor,  # (b, nc, c, h) any float dtype: dt before bias/softplus (a zxbcdt view)
    dt_bias: torch.Tensor | None,  # (h,)
    A: torch.Tensor,  # (h,)
    ddt_raw: torch.Tensor,  # (b, nc, c, h) written, any float dtype (e.g. the dt slice of dzxbcdt)
    seqlen: int,
    dt_min: float,
    dt_max: float,
    softplus: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, nc, c = ddacs_row.shape
    dA_part = torch.empty([b, nc, h], dtype=torch.float32, device=ddacs_row.device)
    ddtb_part = torch.empty([b, nc, h], dtype=torch.float32, device=ddacs_row.device)
    for ib, ic, ih in hl.grid([b, nc, h]):
        last = (hl.arange(c) == c - 1).to(torch.float32)
        g = ddacs_row[ib, ih, ic, :] + ddacs_col[ib, ih, ic, :] + ddacs_prev[ib, ih, ic, :]
        g = g + last * ddA_chunk[ib, ih, ic]
        # dA_cumsum = cumsum(dA) -> ddA = reverse cumsum of g
        ddA = torch.sum(g, dim=0) - hl.cumsum(g, dim=0) + g
        d = dt_out[ib, ih, ic, :]
        dA_part[ib, ic, ih] = torch.sum(ddA * d, dim=0)
        gdt = ddt_in[ib, ih, ic, :] + ddA * A[ih].to(torch.float32)
        pre = dt_in[ib, ic, :, ih].to(torch.float32)
        if dt_bias is not None:
            pre = pre + dt_bias[ih].to(torch.float32)
        if softplus:
            sp = torch.where(pre <= 20.0, torch.log1p(torch.exp(pre)), pre)
            gdt = torch.where((sp < dt_min) | (sp > dt_max), 0.0, gdt)
            gdt = torch.where(pre <= 20.0, gdt * torch.sigmoid(pre), gdt)
        else:
            gdt = torch.where((pre < dt_min) | (pre > dt_max), 0.0, gdt)
        gdt = torch.where(ic * c + hl.arange(c) < seqlen, gdt, 0.0)  # padded tail tokens
        ddt_raw[ib, ic, :, ih] = gdt.to(ddt_raw.dtype)
        ddtb_part[ib, ic, ih] = torch.sum(gdt, dim=0)
    return dA_part, ddtb_part


# ----------------------------------------------------------------------------------------------
# host side


_BLOCK_SEEDS = [[16], [32], [64], [128]]
_DEFAULTS = {
    "ssd_bwd_dz_dstates": helion.Config(block_sizes=[64], num_warps=4, num_stages=2),
    "ssd_bwd_dstates": helion.Config(block_sizes=[64], num_warps=4, num_stages=2),
    "ssd_bwd_state_passing": helion.Config(block_sizes=[], num_warps=4, num_stages=1),
    "ssd_bwd_dx": helion.Config(block_sizes=[64, 64], num_warps=4, num_stages=2),
    "ssd_bwd_dc_dcb": helion.Config(block_sizes=[64], num_warps=4, num_stages=2),
    "ssd_bwd_db": helion.Config(block_sizes=[64, 64], num_warps=4, num_stages=2),
    "ssd_bwd_dt": helion.Config(block_sizes=[], num_warps=4, num_stages=1),
}
# block-size seeds of kernels with more than one block size (others use _BLOCK_SEEDS)
_MULTI_BLOCK_SEEDS = {
    "ssd_bwd_db": [[64, 64], [32, 32], [32, 64], [64, 32], [128, 64], [64, 128], [32, 128], [16, 64]],
    "ssd_bwd_dx": [[64, 64], [32, 32], [32, 64], [64, 32], [64, 128], [32, 128], [128, 64], [128, 128]],
}
# The dtype of dstates (b, nc, h, p, n), the per-chunk state gradients dz_dstates writes and the backward state passing
# reads once (268 MB per layer in fp32 at the Nano shape): "input" (x's dtype, half the bytes; each chunk's term is
# rounded before the fp32 running sum) or "fp32" (as mamba-ssm); ``HelionSettings.bwd_dstates_dtype``.
DSTATES_DTYPES = ("input", "fp32")

_KERNELS = {
    "ssd_bwd_dz_dstates": ssd_bwd_dz_dstates,
    "ssd_bwd_dstates": ssd_bwd_dstates,
    "ssd_bwd_state_passing": ssd_bwd_state_passing,
    "ssd_bwd_dx": ssd_bwd_dx,
    "ssd_bwd_dc_dcb": ssd_bwd_dc_dcb,
    "ssd_bwd_db": ssd_bwd_db,
    "ssd_bwd_dt": ssd_bwd_dt,
}


def _block_seeds(name: str) -> list[list[int]]:
    return _MULTI_BLOCK_SEEDS.get(name, _BLOCK_SEEDS)


def _has_blocks(name: str) -> bool:
    """Whether kernel ``name`` has a tunable block size (its default config lists one)."""
    return bool(_DEFAULTS[name].config.get("block_sizes"))


# each kernel's first-use search seeds (its block-size seeds; none for a kernel without block sizes)
_CALL_SEEDS = {name: tuple({"block_sizes": bs} for bs in _block_seeds(name)) if _has_blocks(name) else ()
               for name in _KERNELS}


def _call(name: str, args: tuple, dims: dict):
    return first_use.tuned_call(name, _KERNELS[name], args, dims, _DEFAULTS[name], seeds=_CALL_SEEDS[name])


def _pad_chunks(t: torch.Tensor | None, L: int) -> torch.Tensor | None:
    """(b, l, ...) -> (b, L, ...) zero padded (a view when l == L)."""
    return None if t is None else _pad_len(t, 1, L)


def _chunked(t: torch.Tensor, nc: int, c: int) -> torch.Tensor:
    return t.reshape(t.shape[0], nc, c, *t.shape[2:])


def _state_split(dim: int) -> int:
    blk = 512
    while blk > 1 and dim % blk:
        blk //= 2
    return blk


def seq_masks(seq_idx: torch.Tensor | None, b: int, l: int, nc: int, c: int, device) -> dict[str, torch.Tensor]:
    """fp32 masks the kernels use: prev_keep/last_keep (b, nc, c), same_seq (b, nc, c, c), keep (b, nc); all None
    without seq_idx (the kernels are specialised without them: nothing to fill, load or multiply). Built once per
    seq_idx tensor (``kernels.derived``): the first backward that needs them builds them, the step's other layers'
    backwards read the same masks, and they are freed with the seq_idx tensor (same_seq is 4 * b * L * c bytes)."""
    L = nc * c
    if seq_idx is None:
        return dict(prev_keep=None, last_keep=None, same_seq=None, keep=None)
    if seq_idx.shape[0] != b or seq_idx.shape[1] not in (l, L):
        raise ValueError(f"seq_idx must be (batch, seqlen) = {(b, l)}, got {tuple(seq_idx.shape)}")

    def build():
        s = _pad_seq_idx(seq_idx, L).reshape(b, nc, c)
        prev_end = torch.cat([torch.zeros_like(s[:, :1, -1]), s[:, :-1, -1]], dim=1)  # (b, nc)
        return dict(
            prev_keep=(s == prev_end[:, :, None]).float(),
            last_keep=(s == s[:, :, -1:]).float(),
            same_seq=(s[:, :, :, None] == s[:, :, None, :]).float(),
            keep=(s[:, :, -1] == prev_end).float(),
        )

    return dict(derived(seq_idx, ("masks", nc, c), build))  # a copy of the shared dict, the masks themselves shared


_OUT_SHAPES = {"dx": "x", "dz": "x", "dB": "B", "dC": "B", "ddt": "dt"}


def ssd_backward_helion(
    dout, x, z, out_x, dt, A, B, C, D, dt_bias, dt_out, dA_cumsum, states_in, CB, chunk_size,
    seq_idx=None, dfinal_states=None, dt_softplus=True, dt_limit=(0.0, float("inf")),
    return_dinitial_states=False, out=None, dstates_dtype="input",
):
    """Gradients of the SSD (with z gating, or without: z None) from recomputed forward pieces.

    dout/x/z/out_x (b, l, h, p) (z None: the output is out_x, and dout is its gradient; out_x is not read); dt (b, l, h) before bias; B/C (b, l, g, n); D (h) / (h, p) / None;
    dt_out/dA_cumsum (b, h, nc, c); states_in (b, nc, h, p, n); CB (b, nc, g, c, c).
    All of x/z/dt/B/C may be strided views (e.g. slices of zxbcdt / of the conv output): nothing is copied.
    ``out``: optional dict of preallocated result buffers {dx, dz (b,l,h,p), dB, dC (b,l,g,n),
    ddt (b,l,h)} (strided views allowed, e.g. slices of dzxbcdt; ddt may be bf16): the kernels write
    into them directly when they are nc * c long (seqlen a multiple of chunk_size, or buffers already padded);
    otherwise the padded results are copied in.
    l is dt's length; dout, x, z, out_x, B, C, seq_idx and the ``out`` buffers may each have length l or, already
    padded, nc * c (the fused op runs on a zxbcdt padded once); the returned gradients are l long.
    ``dstates_dtype``: "input" (dstates in x's dtype) or "fp32" (``DSTATES_DTYPES``).
    Returns dict: dx, dz (b,l,h,p; None without z), ddt (b,l,h) (fp32 unless given), dA (h), dB, dC (b,l,g,n),
    dD (like D or None), ddt_bias (h or None), dinitial_states (b,h,p,n fp32, or None).
    """
    b, l, h = dt.shape
    p, (g, n) = x.shape[3], B.shape[2:]
    c = chunk_size
    L = padded_len(l, c)
    nc = L // c
    if z is None:
        out_x = None  # the ungated output's gradient is dout itself
        if out is not None and out.get("dz") is not None:
            raise ValueError("ssd_backward_helion: out['dz'] without z")
    _check_lengths(l, L, dout=dout, x=x, z=z, out_x=out_x, B=B, C=C, seq_idx=seq_idx)
    if h % g:
        raise ValueError(f"nheads {h} is not a multiple of ngroups {g}")
    if dt_out.shape != (b, h, nc, c) or states_in.shape != (b, nc, h, p, n) or CB.shape != (b, nc, g, c, c):
        raise ValueError("ssd_backward_helion: forward pieces have unexpected shapes "
                         f"dt_out {tuple(dt_out.shape)}, states_in {tuple(states_in.shape)}, CB {tuple(CB.shape)}")
    out = dict(out or {})
    ref_shape = {"x": (b, h, p), "B": (b, g, n), "dt": (b, h)}
    for k, v in out.items():
        if k not in _OUT_SHAPES:
            raise ValueError(f"ssd_backward_helion: unknown out buffer {k!r} (known: {sorted(_OUT_SHAPES)})")
        want = ref_shape[_OUT_SHAPES[k]]
        if (v.shape[0], *v.shape[2:]) != want or v.shape[1] not in (l, L):
            raise ValueError(f"out[{k!r}] must be {(want[0], l, *want[1:])}, got {tuple(v.shape)}")
    if dstates_dtype not in DSTATES_DTYPES:
        raise ValueError(f"dstates_dtype must be one of {DSTATES_DTYPES}, got {dstates_dtype!r}")
    dev = x.device
    m = seq_masks(seq_idx, b, l, nc, c, dev)
    xc, doc, zc, oxc, Bc, Cc, dtc = (None if t is None else _chunked(_pad_chunks(t, L), nc, c)
                                     for t in (x, dout, z, out_x, B, C, dt))
    dims = dict(b=b, l=L, h=h, p=p, g=g, n=n, c=c)
    dA_cumsum = dA_cumsum.contiguous()
    dt_out = dt_out.contiguous()
    states_in = states_in.contiguous()  # read in its own dtype (x's or fp32)

    def buf(name, like_c, dtype=None):
        """Chunked (b, nc, c, ...) result buffer: the caller's when it can be written in place."""
        given = out.get(name)
        if given is not None and given.shape[1] == L:
            return _chunked(given, nc, c)
        return torch.empty(like_c.shape, dtype=dtype or (given.dtype if given is not None else like_c.dtype),
                           device=dev)

    ds_like = tuning.dtype_marker(x.dtype if dstates_dtype == "input" else torch.float32, dev)
    if z is None:
        dzc = None
        doxc = doc
        dstates = _call("ssd_bwd_dstates", (doc, Cc, dA_cumsum, m["prev_keep"], ds_like), dims)
    else:
        dzc = buf("dz", zc)
        doxc, dstates = _call("ssd_bwd_dz_dstates",
                              (doc, zc, oxc, Cc, dA_cumsum, m["prev_keep"], dzc, ds_like), dims)

    blk = _state_split(p * n)
    ns = p * n // blk
    dfin = (tuning.zeros_input((b, h, p, n), torch.float32, dev) if dfinal_states is None  # read only
            else dfinal_states.float().contiguous())
    dA_last = dA_cumsum[..., -1]  # strided view, read in place
    dL, ddA_part, dinit = _call(
        "ssd_bwd_state_passing",
        (dstates.view(b, nc, h, ns, blk), states_in.view(b, nc, h, ns, blk), dA_last, m["keep"],
         dfin.view(b, h, ns, blk), tuning.dtype_marker(x.dtype, dev)),
        dict(dims, blk=blk))
    dL = dL.view(b, nc, h, p, n)
    ddA_chunk = ddA_part.sum(-1)

    if D is None:
        Dw = tuning.zeros_input((h, p), torch.float32, dev)  # read only
    elif D.dim() == 1:
        Dw = D.float().view(h, 1).expand(h, p)  # stride-0 view, no copy
    else:
        Dw = D.float()
    dxc = buf("dx", xc)
    dx_args = (xc, doxc, Bc, CB, dt_out, dA_cumsum, dL, m["last_keep"], Dw, dxc)
    # dx over row tiles; the per-row-tile ddacs_row partials are summed here (8 MB at the Nano shape), the dD
    # partials (b, nc, row tiles, h, p) at the end, in one reduction
    ddt_out, row_part, ddacs_col, dD_part = _call("ssd_bwd_dx", dx_args, dims)
    ddacs_row = row_part.sum(dim=3)
    dBc, dCc = buf("dB", Bc), buf("dC", Cc)
    ddacs_prev, dCB = _call("ssd_bwd_dc_dcb", (xc, doxc, Bc, Cc, dt_out, dA_cumsum, states_in, m["same_seq"],
                                               m["prev_keep"], dCc), dims)
    _call("ssd_bwd_db", (xc, dCB, Cc, dt_out, dA_cumsum, dL, m["last_keep"], dBc), dims)
    del dCB

    ddtc = buf("ddt", dtc, dtype=torch.float32 if "ddt" not in out else None)
    dA_part, ddtb_part = _call(
        "ssd_bwd_dt",
        (ddacs_row, ddacs_col, ddacs_prev, ddA_chunk, ddt_out, dt_out, dtc, dt_bias, A, ddtc, l,
         float(dt_limit[0]), float(dt_limit[1]), bool(dt_softplus)),
        dims)

    def result(name, tc):
        t = tc.reshape(b, L, *tc.shape[3:])[:, :l]
        given = out.get(name)
        if given is None or given.shape[1] == L:
            return t  # a view of the caller's buffer when it was written in place
        if L != l:
            given.copy_(t)
        return given

    dD = None
    if D is not None:
        dD = dD_part.sum(dim=(0, 1, 2, 4) if D.dim() == 1 else (0, 1, 2)).to(D.dtype)
    return dict(
        dx=result("dx", dxc), dz=None if dzc is None else result("dz", dzc), ddt=result("ddt", ddtc), dA=dA_part.sum(dim=(0, 1)).to(A.dtype),
        dB=result("dB", dBc), dC=result("dC", dCc), dD=dD,
        ddt_bias=None if dt_bias is None else ddtb_part.sum(dim=(0, 1)).to(dt_bias.dtype),
        dinitial_states=dinit.view(b, h, p, n) if return_dinitial_states else None,
    )


# ----------------------------------------------------------------------------------------------
# tuning registry (scripts/tune_kernels.py)


def _example_args(name: str, dims: dict, device) -> tuple[tuple, dict]:
    """Random inputs of kernel ``name`` at model dims (b, l, h, p, g, n, c), without seq_idx (no mask arguments, as
    a training step without packed documents calls them); returns (args, kernel dims)."""
    b, l, h, p, g, n, c = (dims[k] for k in ("b", "l", "h", "p", "g", "n", "c"))
    nc = math.ceil(l / c)
    bf, f32 = torch.bfloat16, torch.float32

    def r(*s, dtype=bf):
        return torch.randn(*s, device=device).to(dtype)

    dt = torch.rand(b, h, nc, c, device=device) * 0.1
    dac = torch.cumsum(-dt, dim=-1)
    kd = dict(b=b, l=nc * c, h=h, p=p, g=g, n=n, c=c)
    xs = (b, nc, c, h, p)
    if name == "ssd_bwd_dz_dstates":
        return (r(*xs), r(*xs), r(*xs), r(b, nc, c, g, n), dac, None, r(*xs), torch.empty(0, dtype=bf, device=device)), kd
    if name == "ssd_bwd_dstates":
        return (r(*xs), r(b, nc, c, g, n), dac, None, torch.empty(0, dtype=bf, device=device)), kd
    if name == "ssd_bwd_state_passing":
        blk = _state_split(p * n)
        ns = p * n // blk
        # dstates, states_in and dL in x.dtype as the fused op's backward passes them by default
        return (r(b, nc, h, ns, blk), r(b, nc, h, ns, blk), dac[..., -1].contiguous(),
                None, r(b, h, ns, blk, dtype=f32), torch.empty(0, dtype=bf, device=device)), \
            dict(kd, blk=blk)
    # states_in and dL (b, nc, h, p, n) in x.dtype, as the fused op's backward passes them by default
    if name == "ssd_bwd_dx":
        return (r(*xs), r(*xs), r(b, nc, c, g, n), r(b, nc, g, c, c, dtype=f32), dt, dac, r(b, nc, h, p, n),
                None, r(h, p, dtype=f32), r(*xs)), kd
    if name == "ssd_bwd_dc_dcb":
        return (r(*xs), r(*xs), r(b, nc, c, g, n), r(b, nc, c, g, n), dt, dac, r(b, nc, h, p, n),
                None, None, r(b, nc, c, g, n)), kd
    if name == "ssd_bwd_db":
        dcb = torch.tril(torch.randn(b, nc, g, c, c, device=device)).to(bf)
        return (r(*xs), dcb, r(b, nc, c, g, n), dt, dac, r(b, nc, h, p, n), None, r(b, nc, c, g, n)), kd
    if name == "ssd_bwd_dt":
        q = lambda: r(b, h, nc, c, dtype=f32)  # noqa: E731
        return (q(), q(), q(), r(b, h, nc, dtype=f32), q(), dt, r(b, nc, c, h), r(h, dtype=f32),
                -torch.rand(h, device=device), r(b, nc, c, h), l, 0.0, float("inf"), True), kd
    raise KeyError(name)


# argument positions of the result buffers each kernel writes (compared by the tuner)
_OUT_ARGS = {"ssd_bwd_dz_dstates": (6,), "ssd_bwd_dx": (9,), "ssd_bwd_dt": (9,), "ssd_bwd_dc_dcb": (9,), "ssd_bwd_db": (7,)}


def _tune_builder(name: str):
    def build(dims: dict, device) -> "tuner.TuneCase":
        args, kd = _example_args(name, dims, device)
        seeds = tuner.grid_seeds(block_sizes=_block_seeds(name), num_warps=[4, 8], num_stages=[1, 2, 3]) if _has_blocks(name) \
            else tuner.grid_seeds(num_warps=[1, 2, 4, 8], num_stages=[1, 2])
        out_args = _OUT_ARGS.get(name, ())

        def finalize(raw, a, idx=out_args):  # results written into argument buffers + returned ones
            outs = list(tuner.flatten_outputs(raw))
            if name == "ssd_bwd_dx":
                # its partials have one slot per row tile (the shape depends on the config): compare their sums
                outs[1], outs[3] = outs[1].sum(dim=3), outs[3].sum(dim=2)
            return tuple(a[i] for i in idx) + tuple(outs)

        def prepare(a, idx=out_args):
            for i in idx:
                a[i].fill_(float("nan"))

        return tuner.TuneCase(kernel=_KERNELS[name], args=args, dims=kd, default=_DEFAULTS[name], seeds=seeds,
                               atol=5e-2, rtol=5e-2, n_random=8, finalize=finalize if out_args else None,
                               prepare=prepare if out_args else None)

    return build


def _kernel_dims(name: str, dims: dict) -> dict:
    """The kernel dims ``_example_args`` gives kernel ``name`` at model dims ``dims`` (nothing allocated)."""
    b, l, h, p, g, n, c = (dims[k] for k in ("b", "l", "h", "p", "g", "n", "c"))
    kd = dict(b=b, l=padded_len(l, c), h=h, p=p, g=g, n=n, c=c)
    if name not in _KERNELS:
        raise KeyError(name)
    return dict(kd, blk=_state_split(p * n)) if name == "ssd_bwd_state_passing" else kd


TUNABLE_KERNELS = {name: tuner.TunableKernel(_tune_builder(name), functools.partial(_kernel_dims, name))
                   for name in _KERNELS}
