"""ssd_bwd_dx as two kernels: dx_part2 (dx, ddt, dD and the state term) and ddacs_part (the intra-chunk ddA terms)."""
import torch, helion
import helion.language as hl
from kernels import tuning


@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def dx_part2(x, dout_x, B, CB, dt, dA_cumsum, dL, last_keep, Dw, dx):
    """dx, ddt, dD partials and the state term st per row (the a1/a2 path of ssd_bwd_dx)."""
    b, nc, c, h, p = x.shape
    g = B.shape[3]
    hpg = h // g
    bm = hl.register_block_size(16, 128)
    bk = hl.register_block_size(16, 128)
    nst = (c + bm - 1) // bm
    ddt = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    st_out = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    dD_part = torch.empty([b, nc, nst, h, p], dtype=torch.float32, device=x.device)
    for ts, th, tc, tb in hl.tile([c, h, nc, b], block_size=[bm, 1, 1, 1]):
        ib = tb.begin
        ic = tc.begin
        ih = th.begin
        ig = ih // hpg
        js = ts.id
        dts = dt[ib, ih, ic, ts]
        acs = dA_cumsum[ib, ih, ic, ts]
        a_last = dA_cumsum[ib, ih, ic, c - 1]
        decay_s = torch.exp(torch.clamp(a_last - acs, max=0.0))
        if last_keep is not None:
            decay_s = decay_s * last_keep[ib, ic, ts]
        a1 = hl.zeros([ts, p], dtype=torch.float32)
        for tt in hl.tile(ts.begin, c, block_size=bk):
            dot_ = dout_x[ib, ic, tt, ih, :]
            act = dA_cumsum[ib, ih, ic, tt]
            seg = act[None, :] - acs[:, None]
            causal = tt.index[None, :] >= ts.index[:, None]
            mt = CB[ib, ic, ig, tt, ts].T * torch.exp(torch.clamp(torch.where(causal, seg, float("-inf")), max=0.0))
            a1 = hl.dot(mt.to(x.dtype), dot_, acc=a1)
        dls = dL[ib, ic, ih, :, :].to(x.dtype)
        a2 = hl.dot(B[ib, ic, ts, ig, :], dls.T) * decay_s[:, None]
        xf = x[ib, ic, ts, ih, :].to(torch.float32)
        st_out[ib, ih, ic, ts] = dts * torch.sum(a2 * xf, dim=1)
        a = a1 + a2
        dox_s = dout_x[ib, ic, ts, ih, :].to(torch.float32)
        dx[ib, ic, ts, ih, :] = (a * dts[:, None] + dox_s * Dw[ih, :][None, :]).to(dx.dtype)
        ddt[ib, ih, ic, ts] = torch.sum(a * xf, dim=1)
        dD_part[ib, ic, js, ih, :] = torch.sum(dox_s * xf, dim=0)
    return ddt, st_out, dD_part

@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def ddacs_part(x, dout_x, CB, dt, dA_cumsum, st_in):
    """the intra-chunk ddA terms of ssd_bwd_dx: per row tile, w = decay-weighted C.B^T * dt * (x . dout_x) over the
    causal column tiles; row partials (with the whole-chunk state term at t = c - 1) and -col - st."""
    b, nc, c, h, p = x.shape
    g = CB.shape[2]
    hpg = h // g
    bm = hl.register_block_size(16, 128)
    bk = hl.register_block_size(16, 128)
    nst = (c + bm - 1) // bm
    ddacs_row_part = torch.zeros([b, h, nc, nst, c], dtype=torch.float32, device=x.device)
    ddacs_col = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    for ts, th, tc, tb in hl.tile([c, h, nc, b], block_size=[bm, 1, 1, 1]):
        ib = tb.begin
        ic = tc.begin
        ih = th.begin
        ig = ih // hpg
        js = ts.id
        xs = x[ib, ic, ts, ih, :]
        dts = dt[ib, ih, ic, ts]
        acs = dA_cumsum[ib, ih, ic, ts]
        st = st_in[ib, ih, ic, ts]
        st_sum = torch.sum(st, dim=0)
        col = hl.zeros([ts], dtype=torch.float32)
        for tt in hl.tile(ts.begin, c, block_size=bk):
            dot_ = dout_x[ib, ic, tt, ih, :]
            act = dA_cumsum[ib, ih, ic, tt]
            seg = act[None, :] - acs[:, None]
            causal = tt.index[None, :] >= ts.index[:, None]
            mt = CB[ib, ic, ig, tt, ts].T * torch.exp(torch.clamp(torch.where(causal, seg, float("-inf")), max=0.0))
            gt = hl.dot(xs, dot_.T)
            w = mt * dts[:, None] * gt
            row = torch.sum(w, dim=0) + torch.where(tt.index == c - 1, st_sum, 0.0)
            ddacs_row_part[ib, ih, ic, js, tt] = row
            col = col + torch.sum(w, dim=1)
        ddacs_col[ib, ih, ic, ts] = -col - st
    return ddacs_row_part, ddacs_col
