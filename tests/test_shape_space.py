"""The helion backend's shape space (kernels/shapes.py): what it supports runs and matches the torch reference in
interpret mode at small sizes (groups 1 and = heads, chunk 64 / 128 / 256, lengths that are not a multiple of the
chunk, seq_idx on and off, fp32 and bf16); what it does not support is refused by name before any kernel runs."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("HELION_INTERPRET", "1")

from kernels import first_use, mamba_split_helion as msh  # noqa: E402
from kernels.mamba_split import mamba_split_conv1d_scan_combined_ref  # noqa: E402
from kernels.shapes import UnsupportedShapeError, check_supported  # noqa: E402


def _inputs(b, l, h, p, g, n, width=4, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    dim = h * p
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(zxbcdt=r(b, l, 2 * dim + 2 * g * n + h).to(dtype), conv1d_weight=(r(dim + 2 * g * n, width) * 0.5).to(dtype),
                conv1d_bias=r(dim + 2 * g * n).to(dtype), dt_bias=r(h), A=-torch.rand(h, generator=gen) - 0.5, D=r(h))


def _seq(b, l):
    s = torch.zeros(b, l, dtype=torch.int32)
    s[:, l // 3:] = 1
    s[:, 2 * l // 3:] = 2
    return s


# (b, l, h, p, g, n, c, seq_idx, dtype): groups 1 / = heads / between, chunks 64, 128, 256, partial last chunks
GRID = [
    (1, 70, 2, 8, 1, 8, 64, False, torch.float32),
    (2, 40, 4, 8, 4, 16, 256, True, torch.float32),
    (1, 130, 4, 16, 2, 8, 128, True, torch.bfloat16),
]


@pytest.mark.parametrize("b,l,h,p,g,n,c,seq,dtype", GRID, ids=lambda v: str(v).replace("torch.", ""))
def test_supported_grid_matches_the_reference(b, l, h, p, g, n, c, seq, dtype):
    t = _inputs(b, l, h, p, g, n, dtype=dtype)
    kw = dict(chunk_size=c, seq_idx=_seq(b, l) if seq else None, headdim=p, ngroups=g, norm_before_gate=False)
    leaves_h = {k: v.clone().requires_grad_(True) for k, v in t.items()}
    leaves_r = {k: v.float().clone().requires_grad_(True) for k, v in t.items()}  # fp32 reference of the same values
    out_h = msh.mamba_split_conv1d_scan_combined_helion(*leaves_h.values(), **kw)
    out_r = mamba_split_conv1d_scan_combined_ref(*leaves_r.values(), **kw)
    do = torch.randn(out_r.shape, generator=torch.Generator().manual_seed(1))
    g_h = torch.autograd.grad((out_h.float() * do).sum(), list(leaves_h.values()))
    g_r = torch.autograd.grad((out_r * do).sum(), list(leaves_r.values()))
    for name, a, r in [("out", out_h, out_r), *zip(t, g_h, g_r)]:
        a, r = a.float(), r.float()
        if dtype == torch.float32:  # fp32 throughout: the reference's own rounding differences
            err = (a - r).abs().max().item()
            assert err <= 1e-4 * max(1.0, r.abs().max().item()), f"{name}: max err {err:.3e}"
        else:  # bf16 inputs/outputs, fp32 accumulation: a few bf16 ulps in relative L2
            rel = ((a - r).norm() / r.norm().clamp_min(1e-12)).item()
            assert rel < 2e-2, f"{name}: relative L2 error {rel:.3e}"


@pytest.mark.parametrize("dims,match", [
    (dict(headdim=12), "headdim=12"), (dict(dstate=24), "dstate=24"), (dict(chunk_size=512), "chunk_size=512"),
    (dict(chunk_size=48), "chunk_size=48"), (dict(ngroups=3), "ngroups=3 with nheads=4"),
    (dict(dtype=torch.float64), "dtype torch.float64"), (dict(conv_width=5), "conv width 5"),
    # fp32 tiles past 128 KiB: the state, and the chunk's blocks of x and of B / C
    (dict(headdim=256, dstate=256), r"headdim x dstate = 256 x 256 in float32 \(256 KiB"),
    (dict(headdim=256, dstate=16, chunk_size=256), r"chunk_size x headdim = 256 x 256 in float32"),
    (dict(headdim=8, dstate=256, chunk_size=256), r"chunk_size x dstate = 256 x 256 in float32"),
])
def test_unsupported_dims_are_refused_by_name(dims, match):
    base = dict(nheads=4, headdim=8, ngroups=2, dstate=16, chunk_size=64, dtype=torch.float32, conv_width=4)
    with pytest.raises(UnsupportedShapeError, match=match):
        check_supported(**{**base, **dims})
    check_supported(**base)


def test_tile_limit_is_per_dtype():
    """The same 256 x 256 state at chunk 256 is 128 KiB in 16-bit dtypes (supported) and 256 KiB in fp32 (refused);
    in fp32 each of the state, the chunk's x block and its B / C block holds at most 32768 elements."""
    big = dict(nheads=2, headdim=256, ngroups=1, dstate=256, chunk_size=256)
    for dtype in (torch.bfloat16, torch.float16):
        check_supported(**big, dtype=dtype)
    f32 = dict(dtype=torch.float32)
    with pytest.raises(UnsupportedShapeError, match="headdim x dstate = 256 x 256 in float32"):
        check_supported(**big, **f32)
    with pytest.raises(UnsupportedShapeError, match="chunk_size x dstate = 256 x 256 in float32"):
        check_supported(**{**big, "headdim": 128}, **f32)  # the state fits, the chunk's B block does not
    with pytest.raises(UnsupportedShapeError, match="chunk_size x headdim = 256 x 256 in float32"):
        check_supported(**{**big, "dstate": 128}, **f32)  # the state fits, the chunk's x block does not
    check_supported(**{**big, "headdim": 128, "chunk_size": 128}, **f32)
    check_supported(**{**big, "headdim": 128, "dstate": 128}, **f32)


def test_the_fused_op_refuses_before_any_kernel_runs(monkeypatch):
    monkeypatch.setattr(first_use, "tuned_call", lambda *a, **k: pytest.fail("a kernel ran"))
    t = _inputs(1, 16, 4, 12, 2, 16)  # headdim 12
    with pytest.raises(UnsupportedShapeError, match="mamba_split_conv1d_scan_combined_helion: headdim=12"):
        msh.mamba_split_conv1d_scan_combined_helion(*t.values(), chunk_size=64, headdim=12, ngroups=2)
    t = _inputs(1, 16, 4, 8, 2, 16, dtype=torch.float64)
    with pytest.raises(UnsupportedShapeError, match="dtype torch.float64"):
        msh.mamba_split_conv1d_scan_combined_helion(*t.values(), chunk_size=64, headdim=8, ngroups=2)


# the corners of the supported space: the largest per-head state at the largest chunk in a 16-bit dtype (256 x 256);
# in fp32 the largest state (128 x 256, at chunk 128) and the largest chunk (256, state 128 x 128), each with 128 KiB
# tiles; and the smallest dims with a head count that is not a power of two
CORNERS = [
    (1, 300, 2, 256, 1, 256, 256, False, torch.bfloat16),
    (1, 130, 2, 128, 2, 256, 128, True, torch.float32),
    (1, 300, 2, 128, 1, 128, 256, False, torch.float32),
    (2, 40, 3, 8, 3, 8, 16, True, torch.float16),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("b,l,h,p,g,n,c,seq,dtype", CORNERS, ids=lambda v: str(v).replace("torch.", ""))
def test_supported_corners_run_on_the_gpu(b, l, h, p, g, n, c, seq, dtype):
    """Compiled kernels at the corners of kernels/shapes.py on this GPU: output and every gradient match the fp32
    reference (a config this GPU refuses gives way to the next candidate; none may be left to crash)."""
    t = {k: v.cuda() for k, v in _inputs(b, l, h, p, g, n, dtype=dtype).items()}
    kw = dict(chunk_size=c, seq_idx=_seq(b, l).cuda() if seq else None, headdim=p, ngroups=g, norm_before_gate=False)
    leaves_h = {k: v.clone().requires_grad_(True) for k, v in t.items()}
    leaves_r = {k: v.float().clone().requires_grad_(True) for k, v in t.items()}
    out_h = msh.mamba_split_conv1d_scan_combined_helion(*leaves_h.values(), **kw)
    out_r = mamba_split_conv1d_scan_combined_ref(*leaves_r.values(), **kw)
    do = torch.randn(out_r.shape, generator=torch.Generator().manual_seed(1)).cuda()
    g_h = torch.autograd.grad((out_h.float() * do).sum(), list(leaves_h.values()))
    g_r = torch.autograd.grad((out_r * do).sum(), list(leaves_r.values()))
    # relative L2 per tensor: fp32 inputs may take TF32 dots (10-bit mantissa; sums of up to 256 terms), 16-bit
    # inputs round to 8 / 11 bits; a wrong index or mask gives errors of order 1
    tol = 1e-2 if dtype == torch.float32 else 2e-2
    for name, a, r in [("out", out_h, out_r), *zip(t, g_h, g_r)]:
        rel = ((a.float() - r.float()).norm() / r.float().norm().clamp_min(1e-12)).item()
        assert rel < tol, f"{name}: relative L2 error {rel:.3e}"
