"""ssd_bwd_dc_dcb over the causal column tiles only (bench_configs.py --body)."""
from __future__ import annotations
import torch
import helion
import helion.language as hl
from kernels import tuning
_LOG2E = 1.4426950408889634


@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def ssd_bwd_dc_dcb_tri(
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
        # state part: dC from the chunk's entering state, per head
        for hh in hl.grid(hpg):
            ih = ig * hpg + hh
            acs_i = dA_cumsum[ib, ih, ic, ti]
            ds = hl.dot(dout_x[ib, ic, ti, ih, :], states_in[ib, ic, ih, :, :].to(x.dtype))  # (bm, n)
            pscale = torch.exp2(acs_i * _LOG2E)
            if prev_keep is not None:
                pscale = pscale * prev_keep[ib, ic, ti]
            dc = dc + ds * pscale[:, None]
            ddacs_prev[ib, ih, ic, ti] = torch.sum(ds * C_i, dim=1) * pscale
        # dCB over the column tiles s < the row tile's end (the causal ones), summed over the group's heads
        for ts in hl.tile(0, ti.end, block_size=64):
            dcb = hl.zeros([ti, ts], dtype=torch.float32)
            for hh in hl.grid(hpg):
                ih = ig * hpg + hh
                acs_i = dA_cumsum[ib, ih, ic, ti]
                acs_s = dA_cumsum[ib, ih, ic, ts]
                gts = hl.dot(dout_x[ib, ic, ti, ih, :], x[ib, ic, ts, ih, :].T)  # (bm, 64): dout_x[t] . x[s]
                causal = ti.index[:, None] >= ts.index[None, :]
                seg = torch.clamp(torch.where(causal, acs_i[:, None] - acs_s[None, :], float("-inf")), max=0.0)
                dcb = dcb + gts * torch.exp2(seg * _LOG2E) * dt[ib, ih, ic, ts][None, :]
            if same_seq is not None:
                dcb = dcb * same_seq[ib, ic, ti, ts]
            dcb_c = dcb.to(x.dtype)
            dCB[ib, ic, ig, ti, ts] = dcb_c
            dc = hl.dot(dcb_c, B[ib, ic, ts, ig, :], acc=dc)
        # the tiles above the diagonal are zero (ssd_bwd_db reads from its own row tile's start)
        for tz in hl.tile(ti.end, c, block_size=64):
            dCB[ib, ic, ig, ti, tz] = hl.zeros([ti, tz], dtype=x.dtype)
        dC[ib, ic, ti, ig, :] = dc.to(dC.dtype)
    return ddacs_prev, dCB
