"""The torch reference backend against step-by-step fp64 oracles, values and gradients."""

import pytest
import torch
import torch.nn.functional as F

from kernels.causal_conv1d import causal_conv1d_ref
from kernels.mamba_split import mamba_split_conv1d_scan_combined_ref
from kernels.rmsnorm_gated import RMSNormGatedRef, rmsnorm_gated_ref
from kernels.ssd import mamba_chunk_scan_combined_ref, ssd_recurrence_fp64

SHAPES = [
    # b, l, h, p, g, n, chunk
    (1, 16, 2, 4, 1, 8, 8),    # l multiple of chunk, ngroups 1
    (2, 37, 4, 8, 2, 16, 8),   # odd l, ngroups 2
    (2, 29, 6, 4, 3, 4, 16),   # odd l, ngroups 3, one partial chunk
]


def _inputs(b, l, h, p, g, n, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    return dict(
        x=r(b, l, h, p), dt=r(b, l, h) * 0.5, A=-(torch.rand(h, generator=gen, dtype=dtype) + 0.5),
        B=r(b, l, g, n), C=r(b, l, g, n), D=r(h), z=r(b, l, h, p), dt_bias=r(h) * 0.1,
        initial_states=r(b, h, p, n),
    )


def _seq_idx(b, l):
    s = torch.zeros(b, l, dtype=torch.int32)
    s[0, l // 3:] = 1
    s[0, (2 * l) // 3:] = 2
    if b > 1:
        s[1, 5:] = 1
    return s


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("use_seq_idx", [False, True])
@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.05, 0.8)])
def test_chunked_ssd_matches_fp64_recurrence_values_and_grads(shape, use_seq_idx, dt_limit):
    b, l, h, p, g, n, chunk = shape
    inp = _inputs(b, l, h, p, g, n)
    seq_idx = _seq_idx(b, l) if use_seq_idx else None
    leaves = {k: v.clone().requires_grad_(True) for k, v in inp.items()}
    out, fin = mamba_chunk_scan_combined_ref(
        leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk, D=leaves["D"], z=leaves["z"],
        dt_bias=leaves["dt_bias"], initial_states=leaves["initial_states"], seq_idx=seq_idx, dt_softplus=True,
        dt_limit=dt_limit, return_final_states=True,
    )
    leaves2 = {k: v.clone().requires_grad_(True) for k, v in inp.items()}
    ref, ref_fin = ssd_recurrence_fp64(
        leaves2["x"], leaves2["dt"], leaves2["A"], leaves2["B"], leaves2["C"], D=leaves2["D"], z=leaves2["z"],
        dt_bias=leaves2["dt_bias"], initial_states=leaves2["initial_states"], seq_idx=seq_idx, dt_softplus=True,
        dt_limit=dt_limit,
    )
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fin, ref_fin, rtol=1e-10, atol=1e-10)
    gy = torch.randn_like(ref)
    gf = torch.randn_like(ref_fin)
    ((out * gy).sum() + (fin * gf).sum()).backward()
    ((ref * gy).sum() + (ref_fin * gf).sum()).backward()
    for k in inp:
        torch.testing.assert_close(leaves[k].grad, leaves2[k].grad, rtol=1e-9, atol=1e-9, msg=f"grad of {k}")


def test_seq_idx_resets_state_like_separate_sequences():
    b, l, h, p, g, n = 1, 24, 2, 4, 1, 8
    inp = _inputs(b, l, h, p, g, n, seed=3)
    seq_idx = torch.tensor([[0] * 10 + [1] * 14], dtype=torch.int32)
    args = lambda s: [inp[k][:, s] for k in ("x", "dt")] + [inp["A"]] + [inp[k][:, s] for k in ("B", "C")]  # noqa: E731
    packed = mamba_chunk_scan_combined_ref(*args(slice(None)), 8, D=inp["D"], seq_idx=seq_idx, dt_softplus=True)
    first = mamba_chunk_scan_combined_ref(*args(slice(0, 10)), 8, D=inp["D"], dt_softplus=True)
    second = mamba_chunk_scan_combined_ref(*args(slice(10, None)), 8, D=inp["D"], dt_softplus=True)
    torch.testing.assert_close(packed, torch.cat([first, second], dim=1), rtol=1e-10, atol=1e-10)


def test_D_per_head_dim():
    b, l, h, p, g, n = 1, 12, 2, 4, 1, 4
    inp = _inputs(b, l, h, p, g, n, seed=5)
    Dhp = torch.randn(h, p, dtype=torch.float64)
    out = mamba_chunk_scan_combined_ref(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 4, D=Dhp)
    ref, _ = ssd_recurrence_fp64(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], D=Dhp)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def _conv_loop(x, w, bias, seq_idx, act):
    b, d, l = x.shape
    W = w.shape[1]
    out = torch.zeros(b, d, l, dtype=torch.float64)
    for bi in range(b):
        for t in range(l):
            acc = bias.double().clone() if bias is not None else torch.zeros(d, dtype=torch.float64)
            for k in range(W):
                s = t - (W - 1) + k
                if s < 0 or (seq_idx is not None and seq_idx[bi, s] != seq_idx[bi, t]):
                    continue
                acc += w[:, k].double() * x[bi, :, s].double()
            out[bi, :, t] = acc
    return F.silu(out) if act else out


@pytest.mark.parametrize("with_seq", [False, True])
@pytest.mark.parametrize("act", [None, "silu"])
def test_causal_conv1d_ref_matches_loop_and_channel_last(with_seq, act):
    torch.manual_seed(0)
    b, l, d, W = 2, 11, 6, 4
    x_bld = torch.randn(b, l, d, dtype=torch.float64)
    x = x_bld.transpose(1, 2)  # channel-last strides, as the fused path passes it
    assert x.stride(1) == 1
    w, bias = torch.randn(d, W, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    seq = _seq_idx(b, l) if with_seq else None
    torch.testing.assert_close(causal_conv1d_ref(x, w, bias, seq, act), _conv_loop(x, w, bias, seq, act))


@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("group_size", [None, 4])
def test_rmsnorm_gated_ref_matches_formula(norm_before_gate, group_size):
    torch.manual_seed(0)
    x, z, w = torch.randn(3, 5, 8), torch.randn(3, 5, 8), torch.randn(8)
    gs = group_size or 8
    xin = x if norm_before_gate else x * F.silu(z)
    xg = xin.reshape(3, 5, 8 // gs, gs)
    y = (xg / torch.sqrt(xg.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(3, 5, 8) * w
    if norm_before_gate:
        y = y * F.silu(z)
    torch.testing.assert_close(rmsnorm_gated_ref(x, w, z=z, eps=1e-5, group_size=group_size,
                                                 norm_before_gate=norm_before_gate), y)
    m = RMSNormGatedRef(8, eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate)
    with torch.no_grad():
        m.weight.copy_(w)
    torch.testing.assert_close(m(x, z), y)


def test_fused_split_op_equals_unfused_composition():
    torch.manual_seed(0)
    b, l, h, p, g, n, W = 2, 19, 4, 4, 2, 8, 4
    dim = h * p
    zx = torch.randn(b, l, 2 * dim + 2 * g * n + h, dtype=torch.float64)
    w, cb = torch.randn(dim + 2 * g * n, W, dtype=torch.float64), torch.randn(dim + 2 * g * n, dtype=torch.float64)
    dt_bias, A, D = torch.randn(h, dtype=torch.float64), -torch.rand(h, dtype=torch.float64), torch.randn(h, dtype=torch.float64)
    y = mamba_split_conv1d_scan_combined_ref(zx, w, cb, dt_bias, A, D, 8, headdim=p, ngroups=g, norm_before_gate=False)
    z, xBC, dt = torch.split(zx, [dim, dim + 2 * g * n, h], dim=-1)
    xBC = _conv_loop(xBC.transpose(1, 2), w, cb, None, "silu").transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, g * n, g * n], dim=-1)
    ref, _ = ssd_recurrence_fp64(x.reshape(b, l, h, p), dt, A, B.reshape(b, l, g, n), C.reshape(b, l, g, n), D=D,
                                 z=z.reshape(b, l, h, p), dt_bias=dt_bias, dt_softplus=True)
    torch.testing.assert_close(y, ref.reshape(b, l, dim), rtol=1e-10, atol=1e-10)


def test_fused_split_op_rejects_inconsistent_width():
    h, p, g, n = 2, 4, 1, 4
    dim = h * p
    zx = torch.randn(1, 8, 2 * dim + 2 * g * n + h + 3)
    with pytest.raises(ValueError, match="does not match"):
        mamba_split_conv1d_scan_combined_ref(zx, torch.randn(dim + 2 * g * n, 4), None, torch.zeros(h), -torch.ones(h),
                                             torch.ones(h), 4, headdim=p, ngroups=g)
