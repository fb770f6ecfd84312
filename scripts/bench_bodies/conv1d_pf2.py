"""causal_conv1d's forward and backward kernels with the rolling window's loads two rows ahead (the committed ones load
one row ahead): the same arithmetic in the same order, so outputs are bitwise equal; more loads in flight per program.
Arms for scripts/bench_configs.py --body (same arguments and config space as the committed kernels)."""
import torch
import helion
import helion.language as hl
from helion.autotuner import PowerOfTwoFragment

from kernels import tuning


@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def causal_conv1d_bwd_kernel_pf2(
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
        ok1 = r0 + 1 < nl
        xn2 = hl.load(x, [tb.begin, r0 + 1, td], extra_mask=ok1[:, None])
        gn2 = hl.load(dout, [tb.begin, r0 + 1, td], extra_mask=ok1[:, None])
        if seq is not None:
            sn2 = hl.load(seq, [tb.begin, r0 + 1], extra_mask=ok1)
        # main walk: the lane's own rows (dweight/dbias accumulate; rows >= L load dout = 0 -> g' = 0)
        for s in hl.grid(sl):
            r = r0 + s
            x0 = xn.to(torch.float32)
            g0 = gn.to(torch.float32)
            okn = r + 2 < nl
            xn = xn2
            gn = gn2
            xn2 = hl.load(x, [tb.begin, r + 2, td], extra_mask=okn[:, None])
            gn2 = hl.load(dout, [tb.begin, r + 2, td], extra_mask=okn[:, None])
            if seq is not None:
                s0 = sn
                sn = sn2
                sn2 = hl.load(seq, [tb.begin, r + 2], extra_mask=okn)
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
            okn = (r + 2 < nl) & (r + 2 < r1 + 3)
            xn = xn2
            gn = gn2
            xn2 = hl.load(x, [tb.begin, r + 2, td], extra_mask=okn[:, None])
            gn2 = hl.load(dout, [tb.begin, r + 2, td], extra_mask=okn[:, None])
            if seq is not None:
                s0 = sn
                sn = sn2
                sn2 = hl.load(seq, [tb.begin, r + 2], extra_mask=okn)
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


@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def causal_conv1d_fwd_kernel_pf2(
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
        ok1 = (r0 + 1 < nl) & (r0 + 1 < r1)
        xn2 = hl.load(x, [tb.begin, r0 + 1, td], extra_mask=ok1[:, None])
        if seq is not None:
            sn2 = hl.load(seq, [tb.begin, r0 + 1], extra_mask=ok1)
        for s in hl.grid(sl):
            r = r0 + s
            x0 = xn.to(torch.float32)
            okn = (r + 2 < nl) & (r + 2 < r1)
            xn = xn2
            xn2 = hl.load(x, [tb.begin, r + 2, td], extra_mask=okn[:, None])
            if seq is not None:
                s0 = sn
                sn = sn2
                sn2 = hl.load(seq, [tb.begin, r + 2], extra_mask=okn)
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
