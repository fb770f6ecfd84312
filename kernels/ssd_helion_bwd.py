"""Helion backward kernels for the Mamba-2 SSD (chunked scan), mamba-ssm 2.3.2 math and layouts.

Forward (per chunk ``c`` of ``chunk_size`` tokens, head ``h`` of group ``g``; S_c = state entering
chunk c, L_c = the chunk's local state):
    out_x[t] = exp(dAcs[t]) C[t] S_c^T  +  sum_{s<=t} CB[t,s] exp(dAcs[t]-dAcs[s]) dt[s] x[s]  +  D x[t]
    out      = out_x * silu(z)
    L_c      = sum_s exp(dAcs[last]-dAcs[s]) dt[s] x[s]^T B[s]  ;   S_{c+1} = exp(dAcs_c[last]) S_c + L_c

The ten mamba-ssm backward kernels (B1..B10 in kernels_facts.md) are fused into five Helion kernels:

==========================  ==========================================================  ==========
kernel                       computes                                                    grid
==========================  ==========================================================  ==========
``ssd_bwd_dz_dstates``       B1 + B2: dout_x = dout*silu(z), dz, dstates = dout_x^T (C e^dAcs)  (b, nc, h)
``ssd_bwd_state_passing``    B3: reverse serial pass over chunks -> dL_c, ddA_chunk, dinit  (b, h, splits)
``ssd_bwd_dx``               B4 (+ intra-chunk part of B9): dx, ddt, dD, ddAcs (row/col)     (b, nc, h)
``ssd_bwd_dbc``              B5 + B6 + B7 + B8 x2 (+ B6's ddAcs_prev): dB, dC (dCB stays    (b, nc, g)
                             in registers, never written to memory)
``ssd_bwd_dt``               B9's cumsum + B10: ddA -> ddt (softplus/clamp), dA, ddt_bias     (b, nc, h)
==========================  ==========================================================  ==========

Reductions across programs (dD, dA, ddt_bias, ddA_chunk over state splits) are written as
per-program partial sums and reduced by ``torch.sum`` in a fixed order; no kernel uses atomics.
So gradients are bitwise repeatable under every config in both modes, and the deterministic mode
(``set_deterministic(True)``, ``kernels.deterministic=true``) costs nothing extra here: it only
additionally asserts that the inputs ran through this atomics-free path. (mamba-ssm's
deterministic mode instead falls back to its cheapest autotune config.)

Input layouts (the same as ``kernels/ssd.py`` and mamba-ssm): x/dout/z/out_x (b, l, h, p),
B/C (b, l, g, n), dt_out/dA_cumsum (b, h, nc, c) fp32, states_in (b, nc, h, p, n) fp32 or x.dtype,
CB (b, nc, g, c, c) fp32, seq_idx (b, l) int. ``seqlen % chunk_size != 0`` is handled by padding.
"""

from __future__ import annotations

import math
import os

import torch

import helion
import helion.language as hl

from kernels import tuning
from kernels.ssd import _pad_len, _pad_seq_idx

_DETERMINISTIC = False
_LOG2E = 1.4426950408889634


def set_deterministic(enabled: bool) -> None:
    """Bitwise-repeatable gradients (``kernels.deterministic``). All kernels here are atomics-free,
    so this is always true; the switch is kept so the backend honours the config key uniformly."""
    global _DETERMINISTIC
    _DETERMINISTIC = bool(enabled)


def is_deterministic() -> bool:
    return _DETERMINISTIC


# ----------------------------------------------------------------------------------------------
# kernels


@helion.kernel(static_shapes=True)
def ssd_bwd_dz_dstates(
    dout: torch.Tensor,  # (b, nc, c, h, p)
    z: torch.Tensor,  # (b, nc, c, h, p)
    out_x: torch.Tensor,  # (b, nc, c, h, p)
    C: torch.Tensor,  # (b, nc, c, g, n)
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    prev_keep: torch.Tensor,  # (b, nc, c) fp32: 1 where the token continues the sequence carried in
    dz: torch.Tensor,  # (b, nc, c, h, p) written (may be a strided view, e.g. of dzxbcdt)
    dstates_like: torch.Tensor,  # empty tensor of dstates' dtype (fp32, or x.dtype with BWD_DSTATES="input")
) -> tuple[torch.Tensor, torch.Tensor]:
    b, nc, c, h, p = dout.shape
    g = C.shape[3]
    n = C.shape[4]
    hpg = h // g
    dout_x = torch.empty_like(dout)
    dstates = torch.empty([b, nc, h, p, n], dtype=dstates_like.dtype, device=dout.device)
    bk = hl.register_block_size(16, 128)
    for ib, ic, ih in hl.grid([b, nc, h]):
        ig = ih // hpg
        acc = hl.zeros([p, n], dtype=torch.float32)
        for tt in hl.tile(c, block_size=bk):
            do = dout[ib, ic, tt, ih, :].to(torch.float32)
            zz = z[ib, ic, tt, ih, :].to(torch.float32)
            ox = out_x[ib, ic, tt, ih, :].to(torch.float32)
            sz = torch.sigmoid(zz)
            dox = do * zz * sz
            dz[ib, ic, tt, ih, :] = (do * ox * sz * (1.0 + zz * (1.0 - sz))).to(dz.dtype)
            dox_c = dox.to(dout.dtype)
            dout_x[ib, ic, tt, ih, :] = dox_c
            scale = torch.exp(dA_cumsum[ib, ih, ic, tt]) * prev_keep[ib, ic, tt]
            cs = (C[ib, ic, tt, ig, :].to(torch.float32) * scale[:, None]).to(C.dtype)
            acc = hl.dot(dox_c.T, cs, acc=acc)
        dstates[ib, ic, ih, :, :] = acc.to(dstates.dtype)
    return dout_x, dstates


@helion.kernel(static_shapes=True)
def ssd_bwd_state_passing(
    dstates: torch.Tensor,  # (b, nc, h, s, blk) fp32 or x.dtype (BWD_DSTATES; p*n split into s blocks)
    states_in: torch.Tensor,  # (b, nc, h, s, blk) fp32 or x.dtype (the fused op's backward: BWD_STATES)
    dA_last: torch.Tensor,  # (b, h, nc) fp32
    keep: torch.Tensor,  # (b, nc) fp32: 0 where the carried state is reset at chunk c
    dfinal: torch.Tensor,  # (b, h, s, blk) fp32
    dl_like: torch.Tensor,  # empty tensor of dL's dtype (x.dtype: every reader of dL rounds it to x.dtype first)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, nc, h, s, blk = dstates.shape
    dL = torch.empty([b, nc, h, s, blk], dtype=dl_like.dtype, device=dstates.device)
    ddA_part = torch.empty([b, h, nc, s], dtype=torch.float32, device=dstates.device)
    dinit = torch.empty_like(dfinal)
    for ib, ih, isp in hl.grid([b, h, s]):
        gacc = dfinal[ib, ih, isp, :]
        for i in hl.grid(nc):
            j = nc - 1 - i
            dL[ib, j, ih, isp, :] = gacc.to(dL.dtype)
            scale = torch.exp(dA_last[ib, ih, j]) * keep[ib, j]
            ddA_part[ib, ih, j, isp] = torch.sum(gacc * states_in[ib, j, ih, isp, :], dim=0) * scale
            gacc = dstates[ib, j, ih, isp, :] + scale * gacc
        dinit[ib, ih, isp, :] = gacc
    return dL, ddA_part, dinit


@helion.kernel(static_shapes=True)
def ssd_bwd_dx(
    x: torch.Tensor,  # (b, nc, c, h, p)
    dout_x: torch.Tensor,  # (b, nc, c, h, p)
    B: torch.Tensor,  # (b, nc, c, g, n)
    CB: torch.Tensor,  # (b, nc, g, c, c) fp32, CB[t, s], zero across sequences
    dt: torch.Tensor,  # (b, h, nc, c) fp32
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    dL: torch.Tensor,  # (b, nc, h, p, n) x.dtype: gradient of the chunk's local state
    last_keep: torch.Tensor,  # (b, nc, c) fp32: 1 where the token is in the chunk's last sequence
    Dw: torch.Tensor,  # (h, p) fp32 (zeros when there is no D)
    dx: torch.Tensor,  # (b, nc, c, h, p) written (may be a strided view)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b, nc, c, h, p = x.shape
    g = B.shape[3]
    hpg = h // g
    ddt = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    ddacs_row = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    ddacs_col = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    dD_part = torch.empty([b, nc, h, p], dtype=torch.float32, device=x.device)
    bk = hl.register_block_size(16, 128)
    for ib, ic, ih in hl.grid([b, nc, h]):
        ig = ih // hpg
        xs = x[ib, ic, :, ih, :]
        dts = dt[ib, ih, ic, :]
        acs = dA_cumsum[ib, ih, ic, :]
        a_last = dA_cumsum[ib, ih, ic, c - 1]
        decay_s = torch.exp(torch.clamp(a_last - acs, max=0.0)) * last_keep[ib, ic, :]
        dls = dL[ib, ic, ih, :, :].to(x.dtype)
        # state part: d(L_c)/dx
        a2 = hl.dot(B[ib, ic, :, ig, :], dls.T) * decay_s[:, None]  # (c, p)
        a1 = hl.zeros([c, p], dtype=torch.float32)
        col = hl.zeros([c], dtype=torch.float32)
        for tt in hl.tile(c, block_size=bk):
            dot_ = dout_x[ib, ic, tt, ih, :]  # (bk, p)
            act = dA_cumsum[ib, ih, ic, tt]
            seg = act[None, :] - acs[:, None]  # (c, bk): dAcs[t] - dAcs[s]
            causal = tt.index[None, :] >= hl.arange(c)[:, None]
            # clamp: valid causal entries are <= 0 already (dA_cumsum does not increase within a chunk); lanes
            # of a tile past the chunk end (block size > chunk, e.g. a config tuned at another shape) load
            # dA_cumsum = 0 and would give exp(-dAcs[s]) = inf for long chunks, and inf * 0 = NaN
            mt = CB[ib, ic, ig, tt, :].T * torch.exp(torch.clamp(torch.where(causal, seg, float("-inf")), max=0.0))
            a1 = hl.dot(mt.to(x.dtype), dot_, acc=a1)
            gt = hl.dot(xs, dot_.T)  # (s, t): x[s] . dout_x[t]
            w = mt * dts[:, None] * gt
            ddacs_row[ib, ih, ic, tt] = torch.sum(w, dim=0)
            col = col + torch.sum(w, dim=1)
        a = a1 + a2
        xf = xs.to(torch.float32)
        dox_s = dout_x[ib, ic, :, ih, :].to(torch.float32)
        dx[ib, ic, :, ih, :] = (a * dts[:, None] + dox_s * Dw[ih, :][None, :]).to(dx.dtype)
        ddt_s = torch.sum(a * xf, dim=1)
        ddt[ib, ih, ic, :] = ddt_s
        st = dts * torch.sum(a2 * xf, dim=1)  # d/d(-dAcs[s]) of the local state term
        last = (hl.arange(c) == c - 1).to(torch.float32)
        ddacs_col[ib, ih, ic, :] = -col - st + last * torch.sum(st, dim=0)
        dD_part[ib, ic, ih, :] = torch.sum(dox_s * xf, dim=0)
    return ddt, ddacs_row, ddacs_col, dD_part


@helion.kernel(static_shapes=True)
def ssd_bwd_dbc(
    x: torch.Tensor,  # (b, nc, c, h, p)
    dout_x: torch.Tensor,  # (b, nc, c, h, p)
    B: torch.Tensor,  # (b, nc, c, g, n)
    C: torch.Tensor,  # (b, nc, c, g, n)
    dt: torch.Tensor,  # (b, h, nc, c) fp32
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    states_in: torch.Tensor,  # (b, nc, h, p, n) fp32
    dL: torch.Tensor,  # (b, nc, h, p, n) x.dtype (read as x.dtype)
    same_seq: torch.Tensor,  # (b, nc, c, c) fp32: 1 where tokens t, s are in the same sequence
    prev_keep: torch.Tensor,  # (b, nc, c) fp32
    last_keep: torch.Tensor,  # (b, nc, c) fp32
    dB: torch.Tensor,  # (b, nc, c, g, n) written (may be a strided view)
    dC: torch.Tensor,  # (b, nc, c, g, n) written (may be a strided view)
) -> torch.Tensor:
    b, nc, c, h, p = x.shape
    g = B.shape[3]
    n = B.shape[4]
    hpg = h // g
    ddacs_prev = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    bk = hl.register_block_size(16, 128)
    for ib, ic, ig in hl.grid([b, nc, g]):
        Cs = C[ib, ic, :, ig, :]
        # dB from the local state: sum_h decay*dt * x_h @ dL_h
        db = hl.zeros([c, n], dtype=torch.float32)
        for hh in hl.grid(hpg):
            ih = ig * hpg + hh
            acs = dA_cumsum[ib, ih, ic, :]
            sc = torch.exp(torch.clamp(dA_cumsum[ib, ih, ic, c - 1] - acs, max=0.0)) * dt[ib, ih, ic, :]
            sc = sc * last_keep[ib, ic, :]
            xsc = (x[ib, ic, :, ih, :].to(torch.float32) * sc[:, None]).to(x.dtype)
            db = hl.dot(xsc, dL[ib, ic, ih, :, :].to(x.dtype), acc=db)
        for tt in hl.tile(c, block_size=bk):
            dc = hl.zeros([tt, n], dtype=torch.float32)
            dcb = hl.zeros([tt, c], dtype=torch.float32)
            for hh in hl.grid(hpg):
                ih = ig * hpg + hh
                dot_ = dout_x[ib, ic, tt, ih, :]
                act = dA_cumsum[ib, ih, ic, tt]
                acs = dA_cumsum[ib, ih, ic, :]
                # state-output term: exp(dAcs[t]) * dout_x[t] @ S
                ds = hl.dot(dot_, states_in[ib, ic, ih, :, :].to(x.dtype))  # (bk, n)
                pscale = torch.exp(act) * prev_keep[ib, ic, tt]
                dc = dc + ds * pscale[:, None]
                ddacs_prev[ib, ih, ic, tt] = torch.sum(ds * C[ib, ic, tt, ig, :].to(torch.float32), dim=1) * pscale
                # dCB[t, s] += exp(dAcs[t] - dAcs[s]) dt[s] (dout_x[t] . x[s]), causal
                gts = hl.dot(dot_, x[ib, ic, :, ih, :].T)  # (bk, c)
                causal = tt.index[:, None] >= hl.arange(c)[None, :]
                seg = torch.clamp(torch.where(causal, act[:, None] - acs[None, :], float("-inf")), max=0.0)  # see ssd_bwd_dx
                dcb = dcb + gts * torch.exp(seg) * dt[ib, ih, ic, :][None, :]
            dcb = dcb * same_seq[ib, ic, tt, :]
            dcb_c = dcb.to(x.dtype)
            dc = hl.dot(dcb_c, B[ib, ic, :, ig, :], acc=dc)
            dC[ib, ic, tt, ig, :] = dc.to(dC.dtype)
            db = hl.dot(dcb_c.T, C[ib, ic, tt, ig, :], acc=db)
        dB[ib, ic, :, ig, :] = db.to(dB.dtype)
    return ddacs_prev


@helion.kernel(static_shapes=True)
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
# variants (selected with ``set_variant`` / ``ssd_backward_helion(..., variant=...)``; default "v1")
#
# Cost model at the Nano shape (b 2, l 8192, h 64, p 64, g 8, n 128, c 128; nc 64; bf16 tensors,
# fp32 states/dL/dstates; H200: ~4.8 TB/s HBM, ~130 SMs, bf16 dense ~700 TFLOP/s peak):
#
# ssd_bwd_dbc (v1, grid b*nc*g = 1024 programs, 743 us tuned; mamba-ssm dB+dC+dCB+2 bmm_bwd = 588 us)
#   FLOPs per (b, c, g): state dB 8 heads * 2*c*p*n = 16.8 M, state dC (dout_x @ S) 16.8 M,
#   dout_x @ x^T over the FULL c x c square (no causal skip) 16.8 M, dCB @ B and dCB^T @ C 8.4 M
#   -> 58.7 M * 1024 = 60 GFLOP (~90 us at 700 TF/s: not compute bound).
#   Bytes (HBM, once): x, dout_x 134 MB each, states_in + dL fp32 268 MB each, B, C 34 MB each,
#   dB, dC writes 34 MB each -> ~0.94 GB (~195 us). Redundant work found in the generated Triton:
#   states_in[h] (32 KB fp32) and x[:, h] are re-loaded for every row tile tt (c / bk times per
#   head), the whole-chunk fp32 dB accumulator (c x n = 64 regs/thread at 8 warps) stays live across
#   the serial tt x head loops together with dc and dcb (register pressure / spills), the upper
#   (non-causal) half of dout_x @ x^T is computed and masked, and only 1024 programs (7.8 per SM)
#   each run a long serial loop (8 heads x (c / bk) tiles).
# ssd_bwd_dbc_v2: grid b*nc*g*(c/bm) (2048 programs at bm 64); each program owns ROWS ti of both dC
#   and dB: state parts once per head (dout_x[ti] @ S_h, x[ti]*decay*dt @ dL_h), then dC rows from
#   the causal tiles k <= i only (dCB[i, k] summed over heads, @ B[k]) and dB rows from the tiles
#   k >= i only (dCB[k, i]^T summed over heads, @ C[k]). FLOPs: state 33.6 M (same), dCB blocks
#   (ntiles+1)/(2 ntiles) of the square twice (= 1.5x of 16.8 M at bm=bk=64, 1.25x at 32) -> 25 M,
#   dCB @ B/C 6.3 M -> ~65 M per (b, c, g), about v1's. Live registers: two (bm x n) fp32
#   accumulators + one (bm x bk) dCB tile instead of (c x n) + (bk x n) + (bk x c). states_in / dL
#   are read in whatever dtype they come in (the v2 wrapper path does not force an fp32 copy of
#   states_in; bf16 halves those 268 MB). Expected: 1.2-1.4x over v1 (-> ~550-620 us, >= 1.0x mamba).


@helion.kernel(static_shapes=True)
def ssd_bwd_dbc_v2(
    x: torch.Tensor,  # (b, nc, c, h, p)
    dout_x: torch.Tensor,  # (b, nc, c, h, p)
    B: torch.Tensor,  # (b, nc, c, g, n)
    C: torch.Tensor,  # (b, nc, c, g, n)
    dt: torch.Tensor,  # (b, h, nc, c) fp32
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    states_in: torch.Tensor,  # (b, nc, h, p, n) fp32 or x.dtype
    dL: torch.Tensor,  # (b, nc, h, p, n) fp32 or x.dtype
    same_seq: torch.Tensor,  # (b, nc, c, c) fp32 (symmetric)
    prev_keep: torch.Tensor,  # (b, nc, c) fp32
    last_keep: torch.Tensor,  # (b, nc, c) fp32
    dB: torch.Tensor,  # (b, nc, c, g, n) written (may be a strided view)
    dC: torch.Tensor,  # (b, nc, c, g, n) written (may be a strided view)
) -> torch.Tensor:
    b, nc, c, h, p = x.shape
    g = B.shape[3]
    n = B.shape[4]
    hpg = h // g
    ddacs_prev = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    bm = hl.register_block_size(16, 128)
    bk = hl.register_block_size(16, 128)
    # row tiles fastest in the launch order: the tiles of one (chunk, group) run together and share
    # x / dout_x / states_in / dL through L2
    for ti, tg, tc, tb in hl.tile([c, g, nc, b], block_size=[bm, 1, 1, 1]):
        ib = tb.begin
        ic = tc.begin
        ig = tg.begin
        C_i = C[ib, ic, ti, ig, :]
        dc = hl.zeros([ti, n], dtype=torch.float32)
        db = hl.zeros([ti, n], dtype=torch.float32)
        # state parts (rows ti): dC += exp(dAcs) dout_x @ S ; dB += decay * dt * x @ dL
        for hh in hl.grid(hpg):
            ih = ig * hpg + hh
            acs_i = dA_cumsum[ib, ih, ic, ti]
            ds = hl.dot(dout_x[ib, ic, ti, ih, :], states_in[ib, ic, ih, :, :].to(x.dtype))  # (bm, n)
            pscale = torch.exp2(acs_i * _LOG2E) * prev_keep[ib, ic, ti]
            dc = dc + ds * pscale[:, None]
            ddacs_prev[ib, ih, ic, ti] = torch.sum(ds * C_i.to(torch.float32), dim=1) * pscale
            a_last = dA_cumsum[ib, ih, ic, c - 1]
            sc = torch.exp2(torch.clamp(a_last - acs_i, max=0.0) * _LOG2E) * dt[ib, ih, ic, ti] * last_keep[ib, ic, ti]
            xsc = (x[ib, ic, ti, ih, :].to(torch.float32) * sc[:, None]).to(x.dtype)
            db = hl.dot(xsc, dL[ib, ic, ih, :, :].to(x.dtype), acc=db)
        # dC rows ti: dCB[t in ti, s in tk] for the causal tiles s <= t only
        for tk in hl.tile(ti.end, block_size=bk):
            dcb = hl.zeros([ti, tk], dtype=torch.float32)
            for hh in hl.grid(hpg):
                ih = ig * hpg + hh
                acs_i = dA_cumsum[ib, ih, ic, ti]
                acs_k = dA_cumsum[ib, ih, ic, tk]
                gts = hl.dot(dout_x[ib, ic, ti, ih, :], x[ib, ic, tk, ih, :].T)  # (bm, bk)
                causal = ti.index[:, None] >= tk.index[None, :]
                seg = torch.clamp(torch.where(causal, acs_i[:, None] - acs_k[None, :], float("-inf")), max=0.0)
                dcb = dcb + gts * torch.exp2(seg * _LOG2E) * dt[ib, ih, ic, tk][None, :]
            dcb = dcb * same_seq[ib, ic, ti, tk]
            dc = hl.dot(dcb.to(x.dtype), B[ib, ic, tk, ig, :], acc=dc)
        dC[ib, ic, ti, ig, :] = dc.to(dC.dtype)
        # dB rows ti (as s): dCB[t in tk, s in ti]^T for the tiles t >= s only
        for tk in hl.tile(ti.begin, c, block_size=bk):
            dcbt = hl.zeros([ti, tk], dtype=torch.float32)  # [s, t]
            for hh in hl.grid(hpg):
                ih = ig * hpg + hh
                acs_i = dA_cumsum[ib, ih, ic, ti]
                acs_k = dA_cumsum[ib, ih, ic, tk]
                gst = hl.dot(x[ib, ic, ti, ih, :], dout_x[ib, ic, tk, ih, :].T)  # (bm, bk): x[s] . dout_x[t]
                causal = tk.index[None, :] >= ti.index[:, None]
                seg = torch.clamp(torch.where(causal, acs_k[None, :] - acs_i[:, None], float("-inf")), max=0.0)
                dcbt = dcbt + gst * torch.exp2(seg * _LOG2E) * dt[ib, ih, ic, ti][:, None]
            dcbt = dcbt * same_seq[ib, ic, ti, tk]
            db = hl.dot(dcbt.to(x.dtype), C[ib, ic, tk, ig, :], acc=db)
        dB[ib, ic, ti, ig, :] = db.to(dB.dtype)
    return ddacs_prev


# ssd_bwd_dz_dstates (v1, grid b*nc*h = 8192, 402 us tuned; mamba-ssm dz 221 + dstates 131 = 352 us)
#   FLOPs: dstates = dout_x^T @ (C * exp(dAcs)) 2*p*c*n = 2.1 M per (b, c, h) -> 17 GFLOP (~25 us).
#   Bytes: read dout, z, out_x 134 MB each, C 34 MB (HBM; 268 MB through L2, re-read per head);
#   write dz, dout_x 134 MB each, dstates fp32 268 MB -> ~0.98 GB (~205 us at 4.8 TB/s). Redundant
#   work: per head and tile, C (bk x n, n = 128) is converted to fp32, scaled by exp(dAcs[t]) and
#   rounded back to bf16 (c*n = 16 K convert-mul-convert per head; the scale belongs to the rows of
#   dout_x, which is already in registers in fp32 and half as wide (p = 64)); tl.exp instead of exp2.
# ssd_bwd_dz_dstates_v2: the row scale is applied to dout_x (c*p = 8 K multiplies per head, folded
#   into the bf16 rounding that dout_x needs anyway), C goes from memory straight into tl.dot, exp2.
#   Same bytes and FLOPs, ~1/3 fewer ALU ops per element and one fewer fp32 (bk x n) live tile.
#   Measured (H200, untuned generic config, scripts/bench_ssd_variants.py, session 3): 365 us vs v1's
#   402 us (1.10x), still 0.96x mamba-ssm's 352 us; the rest of the gap is bytes.


# ssd_bwd_dbc_v3 (opt-in, variant "v3"; not yet timed on a GPU): two kernels with dCB written to memory
#   in between, as mamba-ssm does, instead of v1's one program per (b, chunk, group) that keeps the whole-chunk
#   dB accumulator, dC and dCB tiles live across serial head x tile loops (1024 programs, ~8 per SM, one CTA
#   each: memory latency is not hidden; 813 us against mamba-ssm's 588 us for the four kernels).
#   ssd_bwd_dc_dcb: grid (row tiles of c, g, nc, b), 2048 programs at bm 64. Per head: ds = dout_x[ti] @ S
#     (dC state part, ddacs_prev) and the dCB row block gts * decay * dt over the whole chunk. Then
#     dC[ti] += dCB[ti, :] @ B, and dCB is stored in bf16 (both v1 and v2 round it to bf16 before their
#     dots, so the values are the same): (b, nc, g, c, c) is 34 MB at the Nano shape.
#   ssd_bwd_db_v3: grid (row tiles of c as s, g, nc, b). dB[s] = sum_h decay dt x_h[s] @ dL_h
#     + sum_{t >= s} dCB[t, s]^T C[t]. Registers: (bm x n) fp32 accumulators and one (bm x c) block.
@helion.kernel(static_shapes=True)
def ssd_bwd_dc_dcb(
    x: torch.Tensor,  # (b, nc, c, h, p)
    dout_x: torch.Tensor,  # (b, nc, c, h, p)
    B: torch.Tensor,  # (b, nc, c, g, n)
    C: torch.Tensor,  # (b, nc, c, g, n)
    dt: torch.Tensor,  # (b, h, nc, c) fp32
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    states_in: torch.Tensor,  # (b, nc, h, p, n) fp32 or x.dtype
    same_seq: torch.Tensor,  # (b, nc, c, c) fp32
    prev_keep: torch.Tensor,  # (b, nc, c) fp32
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
            pscale = torch.exp2(acs_i * _LOG2E) * prev_keep[ib, ic, ti]
            dc = dc + ds * pscale[:, None]
            ddacs_prev[ib, ih, ic, ti] = torch.sum(ds * C_i, dim=1) * pscale
            gts = hl.dot(dot_i, x[ib, ic, :, ih, :].T)  # (bm, c): dout_x[t] . x[s]
            causal = ti.index[:, None] >= hl.arange(c)[None, :]
            seg = torch.clamp(torch.where(causal, acs_i[:, None] - acs[None, :], float("-inf")), max=0.0)  # see ssd_bwd_dx
            dcb = dcb + gts * torch.exp2(seg * _LOG2E) * dt[ib, ih, ic, :][None, :]
        dcb_c = (dcb * same_seq[ib, ic, ti, :]).to(x.dtype)
        dCB[ib, ic, ig, ti, :] = dcb_c
        dc = hl.dot(dcb_c, B[ib, ic, :, ig, :], acc=dc)
        dC[ib, ic, ti, ig, :] = dc.to(dC.dtype)
    return ddacs_prev, dCB


@helion.kernel(static_shapes=True)
def ssd_bwd_db_v3(
    x: torch.Tensor,  # (b, nc, c, h, p)
    dCB: torch.Tensor,  # (b, nc, g, c, c) x.dtype, from ssd_bwd_dc_dcb
    C: torch.Tensor,  # (b, nc, c, g, n)
    dt: torch.Tensor,  # (b, h, nc, c) fp32
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    dL: torch.Tensor,  # (b, nc, h, p, n) fp32 or x.dtype
    last_keep: torch.Tensor,  # (b, nc, c) fp32
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
            sc = torch.exp2(torch.clamp(a_last - acs_s, max=0.0) * _LOG2E) * dt[ib, ih, ic, si] * last_keep[ib, ic, si]
            xsc = (x[ib, ic, si, ih, :].to(torch.float32) * sc[:, None]).to(x.dtype)
            db = hl.dot(xsc, dL[ib, ic, ih, :, :].to(x.dtype), acc=db)
        # dCB[t, s] is zero for t < s (causal): only the row tiles from this tile's start on
        for tt in hl.tile(si.begin, c, block_size=bk):
            db = hl.dot(dCB[ib, ic, ig, tt, si].T, C[ib, ic, tt, ig, :], acc=db)
        dB[ib, ic, si, ig, :] = db.to(dB.dtype)
    return dB


def ssd_bwd_dbc_v3(args: tuple, dims: dict) -> torch.Tensor:
    """Variant "v3" of ssd_bwd_dbc: the same arguments and results (dB, dC written, ddacs_prev returned) from
    ssd_bwd_dc_dcb then ssd_bwd_db_v3."""
    x, dout_x, B, C, dt, dA_cumsum, states_in, dL, same_seq, prev_keep, last_keep, dB, dC = args
    ddacs_prev, dCB = _call("ssd_bwd_dc_dcb", (x, dout_x, B, C, dt, dA_cumsum, states_in, same_seq, prev_keep, dC), dims)
    _call("ssd_bwd_db_v3", (x, dCB, C, dt, dA_cumsum, dL, last_keep, dB), dims)
    return ddacs_prev


# ssd_bwd_dx_v2 (backward variant "v7", with v4's kernels): ssd_bwd_dx split over row tiles of the chunk.
#   ssd_bwd_dx (v1) runs one program per (b, chunk, head), 8192 programs, each holding (c x c) fp32 tiles (the
#   decayed CB^T, the causal mask, x . dout^T and their product: 64 registers per thread each at 8 warps) over
#   the whole chunk: 729 us on the H200 against mamba-ssm's dx + ddAcs_stable + cumsum_bwd 720 us, for ~52
#   GFLOP and ~0.8 GB (~75 / ~190 us). Here a program owns the rows s of one tile (bm rows: 16384 programs at
#   bm 64) and walks the column tiles t >= s only (the causal half: 3/4 of the c x c products at bm = bk = c/2),
#   with (bm x bk) tiles. The per-column sums over s (ddacs_row) span the row tiles, so each program writes its
#   partial into its own slot of a (b, h, nc, c / bm, c) buffer (zeros below its diagonal) that the caller sums;
#   the whole-chunk sum of the state term st (v1 adds it to ddacs_col[c - 1]) goes into that partial at
#   t = c - 1, which ssd_bwd_dt adds to the same place. dD is summed per row tile, (b, nc, c / bm, h, p). Row
#   tiles of one (chunk, head) are adjacent program ids, so dL[h] (p x n fp32) and the group's CB tile come
#   from L2 for all but the first.
@helion.kernel(static_shapes=True)
def ssd_bwd_dx_v2(
    x: torch.Tensor,  # (b, nc, c, h, p)
    dout_x: torch.Tensor,  # (b, nc, c, h, p)
    B: torch.Tensor,  # (b, nc, c, g, n)
    CB: torch.Tensor,  # (b, nc, g, c, c) fp32, CB[t, s], zero across sequences
    dt: torch.Tensor,  # (b, h, nc, c) fp32
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    dL: torch.Tensor,  # (b, nc, h, p, n) x.dtype: gradient of the chunk's local state
    last_keep: torch.Tensor,  # (b, nc, c) fp32: 1 where the token is in the chunk's last sequence
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
        decay_s = torch.exp(torch.clamp(a_last - acs, max=0.0)) * last_keep[ib, ic, ts]
        dls = dL[ib, ic, ih, :, :].to(x.dtype)
        # state part: d(L_c)/dx for these rows, and its d/d(-dAcs[s]) term
        a2 = hl.dot(B[ib, ic, ts, ig, :], dls.T) * decay_s[:, None]  # (bm, p)
        st = dts * torch.sum(a2 * xf, dim=1)
        st_sum = torch.sum(st, dim=0)
        a1 = hl.zeros([ts, p], dtype=torch.float32)
        col = hl.zeros([ts], dtype=torch.float32)
        for tt in hl.tile(ts.begin, c, block_size=bk):
            dot_ = dout_x[ib, ic, tt, ih, :]  # (bk, p)
            act = dA_cumsum[ib, ih, ic, tt]
            seg = act[None, :] - acs[:, None]  # (bm, bk): dAcs[t] - dAcs[s]
            causal = tt.index[None, :] >= ts.index[:, None]
            # clamp: as in ssd_bwd_dx (lanes past the chunk end load dA_cumsum = 0)
            mt = CB[ib, ic, ig, tt, ts].T * torch.exp(torch.clamp(torch.where(causal, seg, float("-inf")), max=0.0))
            a1 = hl.dot(mt.to(x.dtype), dot_, acc=a1)
            gt = hl.dot(xs, dot_.T)  # (s, t): x[s] . dout_x[t]
            w = mt * dts[:, None] * gt
            row = torch.sum(w, dim=0) + torch.where(tt.index == c - 1, st_sum, 0.0)
            ddacs_row_part[ib, ih, ic, js, tt] = row
            col = col + torch.sum(w, dim=1)
        a = a1 + a2
        dox_s = dout_x[ib, ic, ts, ih, :].to(torch.float32)
        dx[ib, ic, ts, ih, :] = (a * dts[:, None] + dox_s * Dw[ih, :][None, :]).to(dx.dtype)
        ddt[ib, ih, ic, ts] = torch.sum(a * xf, dim=1)
        ddacs_col[ib, ih, ic, ts] = -col - st
        dD_part[ib, ic, js, ih, :] = torch.sum(dox_s * xf, dim=0)
    return ddt, ddacs_row_part, ddacs_col, dD_part


def ssd_bwd_dx_rows(args: tuple, dims: dict) -> tuple[torch.Tensor, ...]:
    """Variant of ssd_bwd_dx with its arguments and results: ssd_bwd_dx_v2, then the sums of its per-row-tile
    ddacs_row and dD partials (two small torch reductions, 8 MB and 4 MB at the Nano shape)."""
    ddt, row_part, ddacs_col, dD_part = _call("ssd_bwd_dx_v2", args, dims)
    return ddt, row_part.sum(dim=3), ddacs_col, dD_part.sum(dim=2)


@helion.kernel(static_shapes=True)
def ssd_bwd_dz_dstates_v2(
    dout: torch.Tensor,  # (b, nc, c, h, p)
    z: torch.Tensor,  # (b, nc, c, h, p)
    out_x: torch.Tensor,  # (b, nc, c, h, p)
    C: torch.Tensor,  # (b, nc, c, g, n)
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    prev_keep: torch.Tensor,  # (b, nc, c) fp32
    dz: torch.Tensor,  # (b, nc, c, h, p) written (may be a strided view)
    dstates_like: torch.Tensor,  # empty tensor of dstates' dtype (fp32, or x.dtype with BWD_DSTATES="input")
) -> tuple[torch.Tensor, torch.Tensor]:
    b, nc, c, h, p = dout.shape
    g = C.shape[3]
    n = C.shape[4]
    hpg = h // g
    dout_x = torch.empty_like(dout)
    dstates = torch.empty([b, nc, h, p, n], dtype=dstates_like.dtype, device=dout.device)
    bk = hl.register_block_size(16, 128)
    for ib, ic, ih in hl.grid([b, nc, h]):
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
            scale = torch.exp2(dA_cumsum[ib, ih, ic, tt] * _LOG2E) * prev_keep[ib, ic, tt]
            doxs = (dox * scale[:, None]).to(dout.dtype)
            acc = hl.dot(doxs.T, C[ib, ic, tt, ig, :], acc=acc)
        dstates[ib, ic, ih, :, :] = acc.to(dstates.dtype)
    return dout_x, dstates


# ----------------------------------------------------------------------------------------------
# host side


_BLOCK_SEEDS = [[16], [32], [64], [128]]
_DEFAULTS = {
    "ssd_bwd_dz_dstates": helion.Config(block_sizes=[64], num_warps=4, num_stages=2),
    "ssd_bwd_state_passing": helion.Config(block_sizes=[], num_warps=4, num_stages=1),
    "ssd_bwd_dx": helion.Config(block_sizes=[32], num_warps=8, num_stages=2),
    "ssd_bwd_dbc": helion.Config(block_sizes=[32], num_warps=8, num_stages=2),
    "ssd_bwd_dt": helion.Config(block_sizes=[], num_warps=4, num_stages=1),
    "ssd_bwd_dz_dstates_v2": helion.Config(block_sizes=[64], num_warps=4, num_stages=2),
    "ssd_bwd_dbc_v2": helion.Config(block_sizes=[64, 64], num_warps=4, num_stages=2),
    "ssd_bwd_dc_dcb": helion.Config(block_sizes=[64], num_warps=4, num_stages=2),
    "ssd_bwd_db_v3": helion.Config(block_sizes=[64, 64], num_warps=4, num_stages=2),
    "ssd_bwd_dx_v2": helion.Config(block_sizes=[64, 64], num_warps=4, num_stages=2),
}
# block-size seeds of kernels with more than one block size (others use _BLOCK_SEEDS)
_MULTI_BLOCK_SEEDS = {
    "ssd_bwd_dbc_v2": [[64, 64], [32, 32], [32, 64], [64, 32], [128, 64], [64, 128], [32, 128], [16, 64]],
    "ssd_bwd_db_v3": [[64, 64], [32, 32], [32, 64], [64, 32], [128, 64], [64, 128], [32, 128], [16, 64]],
    "ssd_bwd_dx_v2": [[64, 64], [32, 32], [32, 64], [64, 32], [64, 128], [32, 128], [128, 64], [128, 128]],
}
# variant name -> {base kernel: kernel that replaces it}
VARIANTS = {
    "v1": {},
    "v2": {"ssd_bwd_dbc": "ssd_bwd_dbc_v2", "ssd_bwd_dz_dstates": "ssd_bwd_dz_dstates_v2"},
    "v3": {"ssd_bwd_dbc": "ssd_bwd_dbc_v3"},
    # the default since session 5 (H200, Nano shape, bench_ssd_variants): dbc v3 557.9 us vs v1 801.0 us
    # (mamba-ssm's dc+dcb+db: 588.0), dz_dstates v2 324.8 vs v1 405.7 us (mamba-ssm 352.0)
    "v4": {"ssd_bwd_dbc": "ssd_bwd_dbc_v3", "ssd_bwd_dz_dstates": "ssd_bwd_dz_dstates_v2"},
    # v4 with dx over row tiles (ssd_bwd_dx_v2); numbered after the forward's v5 (and a v6 measured and removed), since
    # scripts/bench_ssd_variants.py takes one name for both modules. The default since session 6 (H200, Nano shape):
    # the whole Helion SSD backward 1673.5 us vs v1 2149.0 (v4: 1867.3 vs 2178.8 in another call); in the mixer
    # profile dx_v2 + dt 607.2 us vs mamba-ssm's dx + ddAcs_stable + cumsum_bwd 715.8 (v4's dx + dt: 765.5)
    "v7": {"ssd_bwd_dbc": "ssd_bwd_dbc_v3", "ssd_bwd_dz_dstates": "ssd_bwd_dz_dstates_v2", "ssd_bwd_dx": "ssd_bwd_dx_rows"},
}
# NANO_HELION_SSD_BWD_VARIANT picks the module default for whole processes (benchmarks, training runs);
# an unknown name fails at import with the known names.
# dstates (b, nc, h, p, n), the per-chunk state gradients dz_dstates writes and the backward state passing reads once
# (268 MB per layer in fp32 at the Nano shape): "input" (x's dtype, half the bytes; each chunk's term is rounded
# before the fp32 running sum; the default since session 8) or "fp32" (as mamba-ssm). NANO_HELION_BWD_DSTATES picks
# it for whole processes. H200, Nano shape, bf16 (session 8 call 4): every gradient's relative L2 error against the
# fp32 reference is the same to 4 digits either way (tests/test_mamba_split_helion.py::test_bwd_states_dtype_nano_bf16);
# dz_dstates 283.4 us (1.24x mamba-ssm's two kernels; fp32: 328.3, 1.08x) and the state passing 122.5 us (1.58x; 142.4).
BWD_DSTATES_DTYPES = ("fp32", "input")
BWD_DSTATES = tuning.env_choice("NANO_HELION_BWD_DSTATES", BWD_DSTATES_DTYPES, "input", "dstates dtype")
DEFAULT_VARIANT = "v7"
_VARIANT = os.environ.get("NANO_HELION_SSD_BWD_VARIANT", DEFAULT_VARIANT)
if _VARIANT not in VARIANTS:
    raise ValueError(f"NANO_HELION_SSD_BWD_VARIANT={_VARIANT!r}: unknown SSD backward variant (known: {sorted(VARIANTS)})")


def _variant_map(variant: str | dict | None) -> dict[str, str]:
    """``None`` -> the module default (``set_variant``); "v1"/"v2" or {base kernel: variant kernel}."""
    v = _VARIANT if variant is None else variant
    if isinstance(v, dict):
        for base, k in v.items():
            if (k not in _KERNELS and k not in _COMPOSITE) or base not in _KERNELS:
                raise ValueError(f"unknown kernel in variant map {v!r} (known: {sorted(_KERNELS)})")
        return dict(v)
    if v not in VARIANTS:
        raise ValueError(f"unknown SSD backward variant {v!r} (known: {sorted(VARIANTS)})")
    return dict(VARIANTS[v])


def set_variant(variant: str | dict) -> None:
    """Module-wide default kernel variant for ``ssd_backward_helion`` ("v7" by default, "v1" = session 3's kernels)."""
    global _VARIANT
    _variant_map(variant)  # validate
    _VARIANT = variant


def get_variant() -> str | dict:
    return _VARIANT


_KERNELS = {
    "ssd_bwd_dz_dstates": ssd_bwd_dz_dstates,
    "ssd_bwd_state_passing": ssd_bwd_state_passing,
    "ssd_bwd_dx": ssd_bwd_dx,
    "ssd_bwd_dbc": ssd_bwd_dbc,
    "ssd_bwd_dt": ssd_bwd_dt,
    "ssd_bwd_dz_dstates_v2": ssd_bwd_dz_dstates_v2,
    "ssd_bwd_dbc_v2": ssd_bwd_dbc_v2,
    "ssd_bwd_dc_dcb": ssd_bwd_dc_dcb,
    "ssd_bwd_db_v3": ssd_bwd_db_v3,
    "ssd_bwd_dx_v2": ssd_bwd_dx_v2,
}
# variants made of several kernels: name -> function(args, dims) with the replaced kernel's arguments/results
_COMPOSITE = {"ssd_bwd_dbc_v3": ssd_bwd_dbc_v3, "ssd_bwd_dx_rows": ssd_bwd_dx_rows}


def _block_seeds(name: str) -> list[list[int]]:
    return _MULTI_BLOCK_SEEDS.get(name, _BLOCK_SEEDS)


def _call(name: str, args: tuple, dims: dict):
    return tuning.tuned_call(name, _KERNELS[name], args, dims, _DEFAULTS[name],
                             seeds=[{"block_sizes": bs} for bs in _block_seeds(name)] if _has_blocks(name) else [])


def _has_blocks(name: str) -> bool:
    """Whether kernel ``name`` has a tunable block size (its default config lists one)."""
    return bool(_DEFAULTS[name].config.get("block_sizes"))


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
    """fp32 masks the kernels use: prev_keep/last_keep (b, nc, c), same_seq (b, nc, c, c), keep (b, nc)."""
    L = nc * c
    if seq_idx is None:
        ones = torch.ones(b, nc, c, dtype=torch.float32, device=device)
        return dict(prev_keep=ones, last_keep=ones,
                    same_seq=torch.ones(b, nc, c, c, dtype=torch.float32, device=device),
                    keep=ones[:, :, 0])
    if seq_idx.shape != (b, l):
        raise ValueError(f"seq_idx must be (batch, seqlen) = {(b, l)}, got {tuple(seq_idx.shape)}")
    s = _pad_seq_idx(seq_idx, L).reshape(b, nc, c)
    prev_end = torch.cat([torch.zeros_like(s[:, :1, -1]), s[:, :-1, -1]], dim=1)  # (b, nc)
    return dict(
        prev_keep=(s == prev_end[:, :, None]).float(),
        last_keep=(s == s[:, :, -1:]).float(),
        same_seq=(s[:, :, :, None] == s[:, :, None, :]).float(),
        keep=(s[:, :, -1] == prev_end).float(),
    )


_OUT_SHAPES = {"dx": "x", "dz": "x", "dB": "B", "dC": "B", "ddt": "dt"}


def ssd_backward_helion(
    dout, x, z, out_x, dt, A, B, C, D, dt_bias, dt_out, dA_cumsum, states_in, CB, chunk_size,
    seq_idx=None, dfinal_states=None, dt_softplus=True, dt_limit=(0.0, float("inf")),
    return_dinitial_states=False, out=None, variant=None,
):
    """Gradients of the SSD with z gating from recomputed forward pieces.

    dout/x/z/out_x (b, l, h, p); dt (b, l, h) before bias; B/C (b, l, g, n); D (h) / (h, p) / None;
    dt_out/dA_cumsum (b, h, nc, c); states_in (b, nc, h, p, n); CB (b, nc, g, c, c).
    All of x/z/dt/B/C may be strided views (e.g. slices of zxbcdt / of the conv output): nothing is copied.
    ``out``: optional dict of preallocated result buffers {dx, dz (b,l,h,p), dB, dC (b,l,g,n),
    ddt (b,l,h)} (strided views allowed, e.g. slices of dzxbcdt; ddt may be bf16): the kernels write
    into them directly when seqlen is a multiple of chunk_size (otherwise the padded results are
    copied in).
    ``variant``: a name in ``VARIANTS`` ("v1": session 3's kernels; "v4": ssd_bwd_dbc_v3 and
    ssd_bwd_dz_dstates_v2; "v7", the default: v4 with ssd_bwd_dx over row tiles), a {base kernel: variant kernel}
    dict, or None for ``set_variant``'s default.
    Returns dict: dx, dz (b,l,h,p), ddt (b,l,h) (fp32 unless given), dA (h), dB, dC (b,l,g,n),
    dD (like D or None), ddt_bias (h or None), dinitial_states (b,h,p,n fp32, or None).
    """
    if z is None:
        raise NotImplementedError("ssd_backward_helion needs z (Megatron's path always gates with z)")
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    c = chunk_size
    nc = math.ceil(l / c)
    L = nc * c
    if h % g:
        raise ValueError(f"nheads {h} is not a multiple of ngroups {g}")
    if dt_out.shape != (b, h, nc, c) or states_in.shape != (b, nc, h, p, n) or CB.shape != (b, nc, g, c, c):
        raise ValueError("ssd_backward_helion: forward pieces have unexpected shapes "
                         f"dt_out {tuple(dt_out.shape)}, states_in {tuple(states_in.shape)}, CB {tuple(CB.shape)}")
    out = dict(out or {})
    ref_shape = {"x": x.shape, "B": B.shape, "dt": dt.shape}
    for k, v in out.items():
        if k not in _OUT_SHAPES:
            raise ValueError(f"ssd_backward_helion: unknown out buffer {k!r} (known: {sorted(_OUT_SHAPES)})")
        if v.shape != ref_shape[_OUT_SHAPES[k]]:
            raise ValueError(f"out[{k!r}] must be {tuple(ref_shape[_OUT_SHAPES[k]])}, got {tuple(v.shape)}")
    vmap = _variant_map(variant)
    dev = x.device
    m = seq_masks(seq_idx, b, l, nc, c, dev)
    xc, doc, zc, oxc, Bc, Cc, dtc = (_chunked(_pad_chunks(t, L), nc, c) for t in (x, dout, z, out_x, B, C, dt))
    dims = dict(b=b, l=L, h=h, p=p, g=g, n=n, c=c)
    dA_cumsum = dA_cumsum.contiguous()
    dt_out = dt_out.contiguous()
    # v1's ssd_bwd_dbc was tuned on fp32 states_in; v2 / v3 read states_in in its own dtype
    states_in = states_in.contiguous() if "ssd_bwd_dbc" in vmap else states_in.float().contiguous()

    def buf(name, like_c, dtype=None):
        """Chunked (b, nc, c, ...) result buffer: the caller's when it can be written in place."""
        given = out.get(name)
        if given is not None and L == l:
            return _chunked(given, nc, c)
        return torch.empty(like_c.shape, dtype=dtype or (given.dtype if given is not None else like_c.dtype),
                           device=dev)

    dzc = buf("dz", zc)
    ds_like = torch.empty(0, dtype=x.dtype if BWD_DSTATES == "input" else torch.float32, device=dev)
    doxc, dstates = _call(vmap.get("ssd_bwd_dz_dstates", "ssd_bwd_dz_dstates"),
                          (doc, zc, oxc, Cc, dA_cumsum, m["prev_keep"], dzc, ds_like), dims)

    blk = _state_split(p * n)
    ns = p * n // blk
    dfin = (torch.zeros(b, h, p, n, dtype=torch.float32, device=dev) if dfinal_states is None
            else dfinal_states.float().contiguous())
    dA_last = dA_cumsum[..., -1]  # strided view, read in place
    dL, ddA_part, dinit = _call(
        "ssd_bwd_state_passing",
        (dstates.view(b, nc, h, ns, blk), states_in.view(b, nc, h, ns, blk), dA_last, m["keep"],
         dfin.view(b, h, ns, blk), torch.empty(0, dtype=x.dtype, device=dev)),
        dict(dims, blk=blk))
    dL = dL.view(b, nc, h, p, n)
    ddA_chunk = ddA_part.sum(-1)

    if D is None:
        Dw = torch.zeros(h, p, dtype=torch.float32, device=dev)
    elif D.dim() == 1:
        Dw = D.float().view(h, 1).expand(h, p)  # stride-0 view, no copy
    else:
        Dw = D.float()
    dxc = buf("dx", xc)
    dx_name = vmap.get("ssd_bwd_dx", "ssd_bwd_dx")
    dx_args = (xc, doxc, Bc, CB, dt_out, dA_cumsum, dL, m["last_keep"], Dw, dxc)
    ddt_out, ddacs_row, ddacs_col, dD_part = (_COMPOSITE[dx_name](dx_args, dims) if dx_name in _COMPOSITE
                                              else _call(dx_name, dx_args, dims))
    dBc, dCc = buf("dB", Bc), buf("dC", Cc)
    dbc_name = vmap.get("ssd_bwd_dbc", "ssd_bwd_dbc")
    dbc_args = (xc, doxc, Bc, Cc, dt_out, dA_cumsum, states_in, dL, m["same_seq"], m["prev_keep"], m["last_keep"], dBc, dCc)
    ddacs_prev = (_COMPOSITE[dbc_name](dbc_args, dims) if dbc_name in _COMPOSITE else _call(dbc_name, dbc_args, dims))

    ddtc = buf("ddt", dtc, dtype=torch.float32 if "ddt" not in out else None)
    dA_part, ddtb_part = _call(
        "ssd_bwd_dt",
        (ddacs_row, ddacs_col, ddacs_prev, ddA_chunk, ddt_out, dt_out, dtc, dt_bias, A, ddtc, l,
         float(dt_limit[0]), float(dt_limit[1]), bool(dt_softplus)),
        dims)

    def result(name, tc):
        t = tc.reshape(b, L, *tc.shape[3:])[:, :l]
        given = out.get(name)
        if given is None:
            return t
        if L != l:
            given.copy_(t)
        return given

    dD = None
    if D is not None:
        dD = dD_part.sum(dim=(0, 1, 3) if D.dim() == 1 else (0, 1)).to(D.dtype)
    return dict(
        dx=result("dx", dxc), dz=result("dz", dzc), ddt=result("ddt", ddtc), dA=dA_part.sum(dim=(0, 1)).to(A.dtype),
        dB=result("dB", dBc), dC=result("dC", dCc), dD=dD,
        ddt_bias=None if dt_bias is None else ddtb_part.sum(dim=(0, 1)).to(dt_bias.dtype),
        dinitial_states=dinit.view(b, h, p, n) if return_dinitial_states else None,
    )


# ----------------------------------------------------------------------------------------------
# tuning registry (scripts/tune_kernels.py)


def _example_args(name: str, dims: dict, device) -> tuple[tuple, dict]:
    """Random inputs of kernel ``name`` at model dims (b, l, h, p, g, n, c); returns (args, kernel dims)."""
    b, l, h, p, g, n, c = (dims[k] for k in ("b", "l", "h", "p", "g", "n", "c"))
    nc = math.ceil(l / c)
    bf, f32 = torch.bfloat16, torch.float32
    name = name.removesuffix("_v2")  # variants take the arguments of the kernel they replace

    def r(*s, dtype=bf):
        return torch.randn(*s, device=device).to(dtype)

    dt = torch.rand(b, h, nc, c, device=device) * 0.1
    dac = torch.cumsum(-dt, dim=-1)
    ones = torch.ones(b, nc, c, device=device)
    kd = dict(b=b, l=nc * c, h=h, p=p, g=g, n=n, c=c)
    xs = (b, nc, c, h, p)
    if name == "ssd_bwd_dz_dstates":
        return (r(*xs), r(*xs), r(*xs), r(b, nc, c, g, n), dac, ones, r(*xs), torch.empty(0, dtype=bf, device=device)), kd
    if name == "ssd_bwd_state_passing":
        blk = _state_split(p * n)
        ns = p * n // blk
        # dstates, states_in and dL in x.dtype as the fused op's backward passes them by default (session 8)
        return (r(b, nc, h, ns, blk), r(b, nc, h, ns, blk), dac[..., -1].contiguous(),
                torch.ones(b, nc, device=device), r(b, h, ns, blk, dtype=f32), torch.empty(0, dtype=bf, device=device)), \
            dict(kd, blk=blk)
    # states_in and dL (b, nc, h, p, n) in x.dtype, as the fused op's backward passes them since session 8
    if name == "ssd_bwd_dx":
        return (r(*xs), r(*xs), r(b, nc, c, g, n), r(b, nc, g, c, c, dtype=f32), dt, dac, r(b, nc, h, p, n),
                ones, r(h, p, dtype=f32), r(*xs)), kd
    if name == "ssd_bwd_dbc":
        return (r(*xs), r(*xs), r(b, nc, c, g, n), r(b, nc, c, g, n), dt, dac, r(b, nc, h, p, n),
                r(b, nc, h, p, n), torch.ones(b, nc, c, c, device=device), ones, ones, r(b, nc, c, g, n),
                r(b, nc, c, g, n)), kd
    if name == "ssd_bwd_dc_dcb":
        return (r(*xs), r(*xs), r(b, nc, c, g, n), r(b, nc, c, g, n), dt, dac, r(b, nc, h, p, n),
                torch.ones(b, nc, c, c, device=device), ones, r(b, nc, c, g, n)), kd
    if name == "ssd_bwd_db_v3":
        dcb = torch.tril(torch.randn(b, nc, g, c, c, device=device)).to(bf)
        return (r(*xs), dcb, r(b, nc, c, g, n), dt, dac, r(b, nc, h, p, n), ones, r(b, nc, c, g, n)), kd
    if name == "ssd_bwd_dt":
        q = lambda: r(b, h, nc, c, dtype=f32)  # noqa: E731
        return (q(), q(), q(), r(b, h, nc, dtype=f32), q(), dt, r(b, nc, c, h), r(h, dtype=f32),
                -torch.rand(h, device=device), r(b, nc, c, h), l, 0.0, float("inf"), True), kd
    raise KeyError(name)


# argument positions of the result buffers each kernel writes (compared by the tuner)
_OUT_ARGS = {"ssd_bwd_dz_dstates": (6,), "ssd_bwd_dx": (9,), "ssd_bwd_dx_v2": (9,), "ssd_bwd_dbc": (11, 12), "ssd_bwd_dt": (9,),
             "ssd_bwd_dz_dstates_v2": (6,), "ssd_bwd_dbc_v2": (11, 12), "ssd_bwd_dc_dcb": (9,), "ssd_bwd_db_v3": (7,)}


def _tune_builder(name: str):
    def build(dims: dict, device) -> "tuning.TuneCase":
        args, kd = _example_args(name, dims, device)
        seeds = tuning.grid_seeds(block_sizes=_block_seeds(name), num_warps=[4, 8], num_stages=[1, 2, 3]) if _has_blocks(name) \
            else tuning.grid_seeds(num_warps=[1, 2, 4, 8], num_stages=[1, 2])
        out_args = _OUT_ARGS.get(name, ())

        def finalize(raw, a, idx=out_args):  # results written into argument buffers + returned ones
            outs = list(tuning._flatten_outputs(raw))
            if name == "ssd_bwd_dx_v2":
                # its partials have one slot per row tile (the shape depends on the config): compare their sums
                outs[1], outs[3] = outs[1].sum(dim=3), outs[3].sum(dim=2)
            return tuple(a[i] for i in idx) + tuple(outs)

        def prepare(a, idx=out_args):
            for i in idx:
                a[i].fill_(float("nan"))

        return tuning.TuneCase(kernel=_KERNELS[name], args=args, dims=kd, default=_DEFAULTS[name], seeds=seeds,
                               atol=5e-2, rtol=5e-2, n_random=8, finalize=finalize if out_args else None,
                               prepare=prepare if out_args else None)

    return build


TUNABLE_KERNELS = {name: _tune_builder(name) for name in _KERNELS}
