"""train.fp8 on one GPU (pytest -m gpu): torchao's float8 GEMMs (compiled, as the swapped layers call them) against
fp32 within e4m3's error, the rowwise fp8 grouped expert GEMM, and the tiny model with every module kind in fp8."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

from nano_hybrid.model import fp8 as F  # noqa: E402

# train.fp8 is an optional extra: without torchao these tests skip with the install line (train.fp8 then refuses to
# start, tests/test_fp8.py checks that on CPU)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not F.torchao_available(), reason=f"train.fp8 needs torchao: {F.INSTALL_HINT}")]

# see tests/test_fp8.py: e4m3 round-to-nearest u = 2^-4 per operand -> relative Frobenius error <= sqrt(2) u
FP8_BOUND = math.sqrt(2) * 2.0 ** -4 + 2.0 ** -9
FP8_FLOOR = 4 * 2.0 ** -9


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _data(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).cuda().to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).cuda().to(torch.bfloat16)
    dy = torch.randn(m, n, generator=g).cuda().to(torch.bfloat16)
    return x, w, dy


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("k,n", [(2688, 10304), (4096, 2688), (2688, 1856)])
def test_fp8_linear_matches_fp32_at_nano_shapes(recipe, k, n):
    x, w, dy = _data(2048, k, n)
    xf, wf = x.float().requires_grad_(True), w.float().requires_grad_(True)
    (xf @ wf.t()).backward(dy.float())
    yr = x.float() @ w.float().t()
    xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = F.fp8_linear(xi, wi, recipe)
    y.backward(dy)
    assert y.dtype == torch.bfloat16 and xi.grad.dtype == torch.bfloat16 and wi.grad.dtype == torch.bfloat16
    for name, o, r in (("y", y, yr), ("dx", xi.grad, xf.grad), ("dw", wi.grad, wf.grad)):
        assert FP8_FLOOR < _rel(o, r) < FP8_BOUND, (name, _rel(o, r))


def test_fp8_grouped_mm_matches_fp32():
    from nano_hybrid.model.experts import grouped_mm

    e, k, n = 4, 256, 512
    tokens = torch.tensor([61, 0, 99, 32])  # one empty expert; sizes need not be multiples of 16
    m = int(tokens.sum())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).cuda().to(torch.bfloat16)
    w = (torch.randn(e, n, k, generator=g) / k ** 0.5).cuda().to(torch.bfloat16)
    dy = torch.randn(m, n, generator=g).cuda().to(torch.bfloat16)
    offs = torch.cumsum(tokens, 0).to(torch.int32).cuda()
    xf, wf = x.float().requires_grad_(True), w.float().requires_grad_(True)
    ref = torch.cat([xf[int(a):int(b)] @ wf[i].t() for i, (a, b) in enumerate(zip([0, *offs[:-1].tolist()],
                                                                                    offs.tolist()))])
    ref.backward(dy.float())
    xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = F.fp8_grouped_mm(xi, wi, offs)
    y.backward(dy)
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    for name, o, r in (("y", y, ref), ("dx", xi.grad, xf.grad), ("dw", wi.grad[[0, 2, 3]], wf.grad[[0, 2, 3]])):
        assert FP8_FLOOR < _rel(o, r) < FP8_BOUND, (name, _rel(o, r))
    # bf16 grouped GEMM of the same data for scale: far closer
    assert _rel(grouped_mm(x, w, offs), ref) < FP8_FLOOR


@pytest.mark.parametrize("recipe,kinds", [("tensorwise", ("mamba_proj", "attention", "shared_expert")),
                                          ("rowwise", ("mamba_proj", "attention", "shared_expert", "experts"))])
def test_tiny_model_in_fp8_trains_close_to_bf16(mp, recipe, kinds):
    from nano_hybrid.config import compose
    from nano_hybrid.model import build_model

    def batch(b, s, vocab):
        g = torch.Generator().manual_seed(0)
        tok = torch.randint(0, vocab, (b, s), generator=g).cuda()
        pos = torch.arange(s, device="cuda")[None].expand(b, s)
        return tok, pos, torch.triu(torch.ones(s, s, dtype=torch.bool, device="cuda"), 1)[None, None]

    cfg = compose(["model=tiny", "kernels.backend=torch"])
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.bfloat16)
    tok, pos, mask = batch(2, 256, 512)
    l_ref = model(tok, pos, mask, labels=tok).mean().item()
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    counts = F.apply_fp8(model, recipe, kinds)
    assert all(counts[k] > 0 for k in kinds if k != "mlp")
    loss = model(tok, pos, mask, labels=tok).mean()
    loss.backward()
    assert abs(loss.item() - l_ref) < 0.05 * l_ref
    bad = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not bad, bad
    assert {n: p.dtype for n, p in model.named_parameters()} == dtypes  # the swap leaves the parameters alone
