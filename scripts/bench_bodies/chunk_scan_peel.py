"""The chunk scan with its diagonal tile computed after the column loop (bench_configs.py --body, kernel
ssd_chunk_scan_cb16): the tiles left of the row tile need no causal mask, and the diagonal tile's x rows also give
the D term."""
from __future__ import annotations

import helion
import helion.language as hl
import torch

from kernels import tuning

_LOG2E = 1.4426950408889634


@helion.kernel(static_shapes=True, ignore_warnings=[helion.exc.TensorOperationInWrapper, *tuning.IGNORED_HELION_WARNINGS])
def ssd_chunk_scan_peel(
    CB: torch.Tensor,  # (b, nc, g, c, c) fp32
    x: torch.Tensor,  # (b, L, h, p)
    dt: torch.Tensor,  # (b, h, nc, c) fp32
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    C: torch.Tensor,  # (b, L, g, n)
    states_in: torch.Tensor,  # (b, nc, h, p, n)
    D: torch.Tensor | None,  # (h, p) (a per-head D is expanded with stride 0 by the host)
    z: torch.Tensor | None,  # (b, L, h, p)
    seq_idx: torch.Tensor | None,  # (b, L) int32
    seq_end: torch.Tensor | None,  # (b, nc + 1) int32
    out: torch.Tensor,  # (b, L, h, p), written here (the wrapper picks its memory layout)
    out_x: torch.Tensor,  # (b, L, h, p), written here with z; ``out`` itself without z
) -> tuple[torch.Tensor, torch.Tensor]:
    b, L, h, p = x.shape
    _, nc, g, c, _ = CB.shape
    n = C.shape[3]
    c = hl.specialize(c)
    n = hl.specialize(n)
    ratio = h // g
    block_m = hl.register_block_size(16, c)
    block_n = hl.register_block_size(16, p)
    block_k = hl.register_block_size(16, c)
    # Program order: heads fastest, then row and column tiles, then batch and chunk. The tiles that share data run
    # side by side: the heads of a group read the same C and C.B^T blocks, and the row tiles of a (chunk, head) the
    # same state and x rows, so these reads come close together in time (batch first puts the heads of a group b*nc
    # programs apart and the row tiles b*nc*h).
    for th, tm, tn, tb, tc in hl.tile([h, c, p, b, nc], block_size=[1, block_m, block_n, 1, 1]):
        pos_m = tc.begin * c + tm.index
        dA_m = dA_cumsum[tb.begin, th.begin, tc.begin, tm]
        # Inter-chunk part: exp(dA_m) * C_m . state_in^T  (K = n in one dot).
        c_m = C[tb.begin, pos_m, th.begin // ratio, :]  # (M, n)
        st = states_in[tb.begin, tc.begin, th.begin, tn, :].to(C.dtype)  # (N, n)
        acc = hl.dot(c_m, st.permute(1, 0))
        scale_m = torch.exp2(dA_m * _LOG2E)
        if seq_idx is not None:
            same = seq_idx[tb.begin, pos_m] == seq_end[tb.begin, tc.begin]
            scale_m = torch.where(same, scale_m, 0.0)
        acc = acc * scale_m[:, None]
        # Intra-chunk part: causal, decayed, dt-weighted CB applied to x; the column tiles left of the row tile first
        # (every (m, k) causal: no mask), then the diagonal tile, whose x rows also give the D term.
        for tk in hl.tile(0, tm.begin, block_size=block_k):
            cb = CB[tb.begin, tc.begin, th.begin // ratio, tm, tk]
            dA_k = dA_cumsum[tb.begin, th.begin, tc.begin, tk]
            dt_k = dt[tb.begin, th.begin, tc.begin, tk]
            w = cb * torch.exp2(torch.clamp(dA_m[:, None] - dA_k[None, :], max=0.0) * _LOG2E) * dt_k[None, :]
            x_k = x[tb.begin, tc.begin * c + tk.index, th.begin, tn]
            acc = hl.dot(w.to(x.dtype), x_k, acc=acc)
        cbd = CB[tb.begin, tc.begin, th.begin // ratio, tm, tm]
        dt_d = dt[tb.begin, th.begin, tc.begin, tm]
        wd = cbd * torch.exp2(torch.clamp(dA_m[:, None] - dA_m[None, :], max=0.0) * _LOG2E) * dt_d[None, :]
        wd = torch.where(tm.index[:, None] >= tm.index[None, :], wd, 0.0).to(x.dtype)
        x_m = x[tb.begin, pos_m, th.begin, tn]
        acc = hl.dot(wd, x_m, acc=acc)
        if D is not None:
            acc = acc + x_m.to(torch.float32) * D[th.begin, tn].to(torch.float32)[None, :]
        if z is not None:
            out_x[tb.begin, pos_m, th.begin, tn] = acc.to(out_x.dtype)
            z_m = z[tb.begin, pos_m, th.begin, tn].to(torch.float32)
            acc = acc * (z_m * torch.sigmoid(z_m))
        out[tb.begin, pos_m, th.begin, tn] = acc.to(out.dtype)
    return out, out_x
