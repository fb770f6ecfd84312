"""model.lm_head_loss=chunked against megatron's plain LM head + vocab_parallel_cross_entropy (CPU, fp32)."""

import subprocess
import sys

import pytest
import torch

from nano_hybrid.config import ConfigError, compose

BASE = ["model=tiny", "parallel=single", "kernels.backend=torch"]


def _plain(hidden, weight, labels):
    from nano_hybrid.model.lm_loss import plain_linear_cross_entropy

    return plain_linear_cross_entropy(hidden, weight, labels)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_function_matches_plain(mp, chunk):
    from nano_hybrid.model.lm_loss import chunked_linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    s, b, h, v = 37, 2, 16, 96
    hidden = torch.randn(s, b, h, generator=g, dtype=torch.float64).float() * 2
    weight = torch.randn(v, h, generator=g) * 0.5
    labels = torch.randint(0, v, (s, b), generator=g)
    upstream = torch.rand(s, b, generator=g) * (torch.rand(s, b, generator=g) > 0.3)  # a masked, scaled loss

    out = {}
    for name, fn in (("plain", _plain), ("chunked", lambda x, w, y: chunked_linear_cross_entropy(x, w, y, chunk))):
        x = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        loss = fn(x, w, labels)
        (loss * upstream).sum().backward()
        out[name] = (loss.detach(), x.grad, w.grad)
    assert out["chunked"][0].shape == (s, b) and out["chunked"][0].dtype == torch.float32
    for a, ref, what in zip(out["chunked"], out["plain"], ("loss", "d hidden", "d weight")):
        torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-6, msg=lambda m, w=what: f"{w}: {m}")
    # the loss is not trivially equal: it is the cross-entropy of these logits
    ref = torch.nn.functional.cross_entropy((hidden @ weight.t()).view(-1, v), labels.view(-1), reduction="none")
    torch.testing.assert_close(out["chunked"][0].view(-1), ref, rtol=1e-5, atol=1e-6)


def test_chunked_function_without_grad_keeps_no_logits_grad():
    from nano_hybrid.model.lm_loss import ChunkedLinearCrossEntropy

    x, w = torch.randn(10, 8), torch.randn(32, 8)
    y = torch.randint(0, 32, (10,))
    w.requires_grad_(True)  # a parameter in evaluation: no D is kept under no_grad
    saved = []
    with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = ChunkedLinearCrossEntropy.apply(x, w, y, 4, torch.is_grad_enabled())
    assert not any(t is not None and t.shape == (10, 32) for t in saved)
    ref = torch.nn.functional.cross_entropy(x @ w.t(), y, reduction="none")
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="labels"):
        ChunkedLinearCrossEntropy.apply(x, w, y[:5], 4, False)


def test_functional_chunk_math_matches_the_in_place_path():
    """chunk_loss_and_dlogits / chunk_loss (what chunked_compiled compiles) against the eager in-place chunk code."""
    from nano_hybrid.model.lm_loss import ChunkedLinearCrossEntropy, chunk_loss, chunk_loss_and_dlogits

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(12, 8, generator=g), torch.randn(40, 8, generator=g)
    y = torch.randint(0, 40, (12,), generator=g)
    logits = x @ w.t()
    loss, d = chunk_loss_and_dlogits(logits, y)
    ref_d = torch.softmax(logits, -1) - torch.nn.functional.one_hot(y, 40).float()
    torch.testing.assert_close(d, ref_d, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunk_loss(logits, y), loss)
    xg = x.clone().requires_grad_(True)
    eager = ChunkedLinearCrossEntropy.apply(xg, w, y, 5, True, False)
    torch.testing.assert_close(loss, eager.detach(), rtol=1e-5, atol=1e-6)
    eager.sum().backward()
    torch.testing.assert_close(xg.grad, ref_d @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("use_compile", [False, True], ids=["chunked", "chunked_compiled"])
def test_chunked_bf16_on_gpu_matches_plain(mp, use_compile):
    """bf16 at a 32k vocabulary: loss and gradients of the chunked head (eager and torch.compile'd) vs the plain one."""
    from nano_hybrid.model.lm_loss import chunked_linear_cross_entropy

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    s, b, h, v = 2048, 2, 1024, 32768
    hidden = (torch.randn(s, b, h, device=dev, generator=g)).bfloat16()
    weight = (torch.randn(v, h, device=dev, generator=g) * 0.05).bfloat16()
    labels = torch.randint(0, v, (s, b), device=dev, generator=g)
    scale = 1.0 / (s * b)
    out = {}
    for name, fn in (("plain", _plain),
                     ("chunked", lambda x, w_, y: chunked_linear_cross_entropy(x, w_, y, 1536, use_compile))):
        x = hidden.clone().requires_grad_(True)
        w_ = weight.clone().requires_grad_(True)
        loss = fn(x, w_, labels)
        (loss.float().sum() * scale).backward()
        out[name] = (loss.detach().float(), x.grad.float(), w_.grad.float())
    for a, ref, what in zip(out["chunked"], out["plain"], ("loss", "d hidden", "d weight")):
        err = ((a - ref).norm() / ref.norm()).item()
        assert err < (1e-3 if what == "loss" else 2e-2), (what, err)


def _model_step(overrides, state=None):
    from nano_hybrid import mcore_compat
    from nano_hybrid.model import build_model

    cfg = compose([*BASE, *overrides])
    torch.manual_seed(0)
    model = build_model(cfg, device="cpu")
    if state is not None:
        model.load_state_dict(state)
    model.train()
    g = torch.Generator().manual_seed(3)
    s, b = 48, 2
    tok = torch.randint(0, 256, (b, s), generator=g)
    labels = torch.randint(0, 256, (b, s), generator=g)
    mask = (torch.rand(b, s, generator=g) > 0.2).float()
    pos = torch.arange(s)[None].expand(b, s)
    mcore_compat.model_parallel_manual_seed(77)
    loss = model(tok, pos, None, labels=labels)
    ((loss * mask).sum() / mask.sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return model, loss.detach(), grads


def test_model_chunked_loss_and_grads_match_plain(mp):
    from nano_hybrid.model.lm_loss import LMLossMambaModel

    model, ref_loss, ref_grads = _model_step(["model.lm_head_loss=plain"])
    state = {k: v.clone() for k, v in model.state_dict().items() if v is not None}
    chunked, loss, grads = _model_step(["model.lm_head_loss=chunked", "model.lm_loss_chunk_tokens=40"], state)
    assert isinstance(chunked, LMLossMambaModel) and chunked.lm_head_loss == "chunked"
    assert loss.shape == ref_loss.shape == (2, 48)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert set(grads) == set(ref_grads) and "output_layer.weight" in grads and len(grads) > 20
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # same parameter names as the plain model (checkpoints are interchangeable)
    assert set(chunked.state_dict()) == set(model.state_dict())


@pytest.mark.parametrize("override,msg", [
    ("model.lm_head_loss=fused", "model.lm_head_loss='fused'; choose one of plain, chunked"),
    ("model.lm_loss_chunk_tokens=0", "model.lm_loss_chunk_tokens=0 must be a positive integer"),
])
def test_bad_lm_head_settings_are_config_errors(override, msg):
    from nano_hybrid.model.config import check_model_cfg, model_dict

    with pytest.raises(ConfigError) as e:
        check_model_cfg(model_dict(compose([*BASE, override]).model))
    assert msg in str(e.value)


def test_chunked_with_tensor_parallel_is_refused_before_work(tmp_path):
    """One error line and exit code 2 from the training entry point (validate runs before any process group)."""
    r = subprocess.run(
        [sys.executable, "-m", "nano_hybrid.train", "model=tiny", "parallel=tp2", "model.lm_head_loss=chunked",
         f"run_dir={tmp_path}/run", "data=mock"],
        capture_output=True, text=True, timeout=120, env={**__import__("os").environ, "WORLD_SIZE": "2"})
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1] == ("error: model.lm_head_loss=chunked needs parallel.tensor_model_parallel_size=1 (got 2): "
                         "its logits are not vocab-parallel; use model.lm_head_loss=plain with TP")


@pytest.mark.slow
def test_chunked_compiled_on_cpu_matches_eager_chunked():
    """model.lm_head_loss=chunked_compiled's torch.compile'd chunk math (inductor's CPU backend, about a minute
    of compilation on two cores) against the eager chunked path, with and without gradients."""
    from nano_hybrid.model.lm_loss import chunked_linear_cross_entropy

    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 16, generator=g).requires_grad_(True)
    x = torch.randn(50, 16, generator=g).requires_grad_(True)
    y = torch.randint(0, 64, (50,), generator=g)
    res = {}
    for use_compile in (False, True):
        x.grad = w.grad = None
        loss = chunked_linear_cross_entropy(x, w, y, 16, use_compile=use_compile)
        (loss * torch.linspace(0, 1, 50)).sum().backward()
        res[use_compile] = (loss.detach(), x.grad.clone(), w.grad.clone())
    for a, b in zip(res[True], res[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(chunked_linear_cross_entropy(x, w, y, 16, use_compile=True), res[False][0],
                                   rtol=1e-5, atol=1e-6)
