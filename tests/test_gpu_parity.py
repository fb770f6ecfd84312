"""GPU: the torch reference backend against mamba-ssm / causal-conv1d (semantics check of the oracle).

Tolerance: relative L2 error ||a - b|| / ||b||. mamba-ssm's Triton dots run fp32 inputs in tf32, so
fp32 comparisons allow 5e-3; bf16 inputs vs the fp32 reference allow 2e-2.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from kernels.mamba_split import mamba_split_conv1d_scan_combined_ref  # noqa: E402
from kernels.registry import BackendUnavailableError, get_backend  # noqa: E402
from kernels.rmsnorm_gated import rmsnorm_gated_ref  # noqa: E402


@pytest.fixture(scope="module")
def mamba():
    try:
        return get_backend("mamba_ssm")
    except BackendUnavailableError as e:
        pytest.skip(str(e))


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _fused_inputs(b, l, h, p, g, n, W=4, dtype=torch.float32, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    dim = h * p
    return dict(
        zxbcdt=r(b, l, 2 * dim + 2 * g * n + h).to(dtype), conv1d_weight=(r(dim + 2 * g * n, W) * 0.5).to(dtype),
        conv1d_bias=(r(dim + 2 * g * n) * 0.1).to(dtype), dt_bias=r(h) * 0.1, A=-torch.rand(h, device="cuda") - 0.5,
        D=r(h),
    )


# One shape only: mamba-ssm autotunes every Triton kernel over its config list at each new shape (minutes).
@pytest.mark.parametrize("shape", [(2, 300, 16, 64, 8, 128, 128)])
@pytest.mark.parametrize("with_seq_idx", [False, True])
def test_fused_op_reference_matches_mamba_ssm(mamba, shape, with_seq_idx):
    b, l, h, p, g, n, chunk = shape
    inp = _fused_inputs(b, l, h, p, g, n)
    seq_idx = None
    if with_seq_idx:
        seq_idx = torch.zeros(b, l, dtype=torch.int32, device="cuda")
        seq_idx[:, l // 3:] = 1
        seq_idx[:, (3 * l) // 4:] = 2
    outs, grads = [], []
    for fn in (mamba.mamba_split_conv1d_scan_combined, mamba_split_conv1d_scan_combined_ref):
        leaves = {k: v.clone().requires_grad_(True) for k, v in inp.items()}
        y = fn(leaves["zxbcdt"], leaves["conv1d_weight"], leaves["conv1d_bias"], leaves["dt_bias"], leaves["A"],
               leaves["D"], chunk, seq_idx=seq_idx, headdim=p, ngroups=g, norm_before_gate=False)
        gy = torch.randn(y.shape, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda")
        (y.float() * gy).sum().backward()
        outs.append(y.detach())
        grads.append({k: v.grad for k, v in leaves.items()})
    assert rel(outs[0], outs[1]) < 5e-3
    for k in inp:
        assert rel(grads[0][k], grads[1][k]) < 5e-3, k


@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("use_z", [False, True])
def test_gated_rmsnorm_reference_matches_mamba_ssm(mamba, norm_before_gate, use_z):
    torch.manual_seed(0)
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    z = torch.randn_like(x, requires_grad=True) if use_z else None
    m = mamba.RMSNormGated(1024, eps=1e-5, group_size=256, norm_before_gate=norm_before_gate, device="cuda",
                           dtype=torch.bfloat16)
    with torch.no_grad():
        m.weight.copy_(torch.randn(1024) * 0.2 + 1)
    y = m(x, z)
    xr = x.detach().float().requires_grad_(True)
    zr = z.detach().float().requires_grad_(True) if use_z else None
    wr = m.weight.detach().float().requires_grad_(True)
    yr = rmsnorm_gated_ref(xr, wr, z=zr, eps=1e-5, group_size=256, norm_before_gate=norm_before_gate)
    assert rel(y, yr) < 2e-2
    gy = torch.randn_like(yr)
    (y.float() * gy).sum().backward()
    (yr * gy).sum().backward()
    assert rel(x.grad, xr.grad) < 2e-2
    assert rel(m.weight.grad, wr.grad) < 2e-2
    if use_z:
        assert rel(z.grad, zr.grad) < 2e-2
