"""optim.fused=true (torch's fused AdamW) against torch's default AdamW in megatron's optimizer (CPU)."""

import collections
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nano_hybrid.config import ConfigError, compose

BASE = ["model=tiny", "parallel=single", "kernels.backend=torch", "data=mock", "train.train_iters=20",
        "optim.warmup_iters=2", "optim.lr=3e-3", "logger.wandb.mode=disabled"]
U = 2.0 ** -24  # fp32 unit roundoff
EPS = torch.finfo(torch.float32).eps  # 2u: an ulp of x is at most EPS * |x|


def adam_ratio_bound(t: int, beta1: float, beta2: float) -> float:
    """max |m_hat_t / sqrt(v_hat_t)| of bias-corrected Adam after t steps, for any gradients (Cauchy-Schwarz on
    m_t = (1-b1) sum b1^k g_{t-k}, v_t = (1-b2) sum b2^k g_{t-k}^2)."""
    geo = sum((beta1 * beta1 / beta2) ** k for k in range(t))
    return (1 - beta1) / (1 - beta1 ** t) * math.sqrt((1 - beta2 ** t) / (1 - beta2) * geo)


def _snapshot(opt):
    from nano_hybrid.optim import inner_torch_optimizers

    snap = []
    for o in inner_torch_optimizers(opt):
        for g in o.param_groups:
            for p in g["params"]:
                mg = getattr(p, "main_grad", None)
                snap.append((o, p, p.detach().clone(), None if mg is None else mg.detach().clone(),
                             {k: v.clone() if torch.is_tensor(v) else v for k, v in o.state.get(p, {}).items()}))
    return snap


def _restore(snap):
    for o, p, data, main_grad, state in snap:
        with torch.no_grad():
            p.copy_(data)
            if main_grad is not None:
                p.main_grad.copy_(main_grad)
        o.state.pop(p, None)
        if state:
            o.state[p] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}


class _OpCount(TorchDispatchMode):
    """Counts the aten ops other than views dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += not func.is_view
        return func(*args, **(kwargs or {}))


def _gradient_steps(ddp, opt, n: int):
    """Steps 1..n of a trajectory: before each yield, fresh gradients of a random batch sit in the DDP buffers (the
    caller steps the optimizer)."""
    g = torch.Generator().manual_seed(5)
    b, s = 2, 32
    pos = torch.arange(s)[None].expand(b, s)
    for step in range(1, n + 1):
        tok = torch.randint(0, 256, (b, s), generator=g)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(tok, pos, None, labels=tok.roll(-1, 1)).mean().backward()
        ddp.finish_grad_sync()
        yield step


def test_fused_adamw_update_matches_default(mp, monkeypatch):
    """At every step of a real training trajectory both implementations step from the same parameters, Adam states
    and gradients; their updates then differ by fp32 rounding only. Per entry: the new weight rounds twice (at most
    an ulp each, <= EPS |p|), and the update lr * m_hat / (sqrt(v_hat) + eps), whose ratio is at most
    ``adam_ratio_bound`` in size, carries a relative error of a few dozen u (moment updates, bias corrections,
    sqrt, division, in either order): bound 64 u on the ratio. Comparing trajectories instead would compare
    gradients of slightly different weights, which near-zero gradients amplify without bound."""
    from nano_hybrid import runconfig, trainer as T
    from nano_hybrid.optim import inner_torch_optimizers, set_adam_fused

    calls = []
    real = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = compose([*BASE, "optim.fused=false"])
    plan = runconfig.validate(cfg)
    torch.manual_seed(0)
    ddp, opt, sched = T.build_model_and_optimizer(plan, cfg)
    b1, b2 = float(cfg.optim.adam_beta1), float(cfg.optim.adam_beta2)
    names = {p: n for n, p in ddp.named_parameters()}
    n_checked = n_moved = 0
    for step in _gradient_steps(ddp, opt, 4):
        lr = float(inner_torch_optimizers(opt)[0].param_groups[0]["lr"])
        snap = _snapshot(opt)
        n_calls = len(calls)
        set_adam_fused(opt, True)
        with T.cpu_compat_mode(plan):
            ok, norm_fused, _ = opt.step()
        assert ok and len(calls) > n_calls  # the fused kernel ran
        assert all(gr["fused"] and not gr["foreach"] for o in inner_torch_optimizers(opt) for gr in o.param_groups)
        fused = {p: p.detach().clone() for _, p, *_ in snap}
        _restore(snap)
        set_adam_fused(opt, False)
        n_calls = len(calls)
        with T.cpu_compat_mode(plan):
            ok, norm_ref, _ = opt.step()
        assert ok and len(calls) == n_calls  # torch's default implementation, not the fused kernel
        assert norm_fused == norm_ref  # the same gradients reached both
        ratio = adam_ratio_bound(step, b1, b2)
        for _, p, before, *_ in snap:
            got, ref = fused[p], p.detach()
            atol = 2 * EPS * torch.maximum(before.abs(), ref.abs()) + 64 * U * lr * ratio
            bad = (got - ref).abs() > atol
            assert not bad.any(), (names.get(p), step, float((got - ref).abs().max()), int(bad.sum()))
            if lr > 0:  # the warmup starts at optim.init_lr=0
                n_checked += ref.numel()
                n_moved += int((ref != before).sum())
        sched.step(increment=1)
    # the optimizer really updated the weights in the steps with lr > 0 (a no-op update would also "match")
    assert n_checked and n_moved > 0.9 * n_checked, (n_moved, n_checked)


def test_adam_ratio_bound():
    assert adam_ratio_bound(1, 0.9, 0.95) == pytest.approx(1.0)
    # a constant gradient reaches m_hat / sqrt(v_hat) = 1; the bound is never below it and grows with t
    bounds = [adam_ratio_bound(t, 0.9, 0.95) for t in range(1, 6)]
    assert all(x >= 1.0 for x in bounds) and bounds == sorted(bounds)
    # brute force: the worst ratio over sign patterns of +-1 and 0 gradients stays under the bound at t=3
    import itertools

    worst = 0.0
    for gs in itertools.product((-1.0, 0.0, 1.0), repeat=3):
        m = v = 0.0
        for x in gs:
            m, v = 0.9 * m + 0.1 * x, 0.95 * v + 0.05 * x * x
        if v:
            worst = max(worst, abs(m / (1 - 0.9 ** 3)) / math.sqrt(v / (1 - 0.95 ** 3)))
    assert worst <= bounds[2] + 1e-12


def test_fused_flag_survives_state_dict_reload(mp):
    from nano_hybrid.optim import inner_torch_optimizers, set_adam_fused

    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([p], lr=1e-2)
    p.grad = torch.ones(4)
    opt.step()
    sd = opt.state_dict()  # saved by a default-implementation run
    set_adam_fused(opt, True)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["fused"] is True and opt.state[p]["step"].device == p.device
    opt.step()
    assert inner_torch_optimizers(opt) == [opt]


def test_bad_fused_value_is_a_config_error():
    from nano_hybrid import runconfig

    with pytest.raises(ConfigError, match="optim.fused=1 must be true or false"):
        runconfig.validate(compose([*BASE, "optim.fused=1"]))


# ------------------------------------------------------------------------------- optim.multi_tensor
def test_foreach_ops_equal_megatrons_local_fallbacks():
    """The foreach gradient norm and scale give bitwise the values of megatron's local fallbacks: the norm of the
    per-tensor norms in fp32; the clip's in-place product by an fp32 scale; the fp32 main -> bf16 model copy."""
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    from nano_hybrid.mcore_compat import CudaToCpuMode
    from nano_hybrid.optim import foreach_l2_norm, foreach_scale

    g = torch.Generator().manual_seed(3)
    shapes = [(7,), (33, 5), (2, 3, 4), (1,), (257, 64)]
    grads = [torch.randn(s, generator=g) * 10 ** float(torch.randint(-3, 3, (1,), generator=g)) for s in shapes]
    with CudaToCpuMode():
        ref, _ = local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    got, none = foreach_l2_norm(2048 * 32, None, [grads], False)
    assert none is None and got.shape == (1,) and got.dtype == torch.float32
    assert torch.equal(got, ref.cpu())
    for scale in (0.37, 1.0 / 3.0):  # the clip: grads scaled in place
        a, b = [t.clone() for t in grads], [t.clone() for t in grads]
        local_multi_tensor_scale(0, None, [a, a], scale)
        foreach_scale(0, None, [b, b], scale)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    src = [t.clone() for t in grads]  # distinct lists, another dtype
    a, b = [torch.empty_like(t, dtype=torch.bfloat16) for t in grads], [torch.empty_like(t, dtype=torch.bfloat16) for t in grads]
    for scale in (1.0, 0.5):
        local_multi_tensor_scale(0, None, [src, a], scale)
        foreach_scale(0, None, [src, b], scale)
        assert all(torch.equal(x, y) for x, y in zip(a, b)) and all(torch.equal(s, t) for s, t in zip(src, grads))


def test_multi_tensor_ops_swap_only_megatrons_local_fallbacks_for_the_block():
    from megatron.core import utils as mu
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mopt

    from nano_hybrid.optim import foreach_l2_norm, foreach_scale, multi_tensor_ops

    before = (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, mopt.multi_tensor_scale_impl)
    assert before == (mu.local_multi_tensor_l2_norm, mu.local_multi_tensor_scale, mu.local_multi_tensor_scale)
    with multi_tensor_ops("foreach"):
        assert (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, mopt.multi_tensor_scale_impl) == (
            foreach_l2_norm, foreach_scale, foreach_scale)
    assert (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, mopt.multi_tensor_scale_impl) == before
    with pytest.raises(RuntimeError, match="inside"):
        with multi_tensor_ops("foreach"):
            raise RuntimeError("inside")
    assert (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, mopt.multi_tensor_scale_impl) == before
    with multi_tensor_ops("loop"):
        assert (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, mopt.multi_tensor_scale_impl) == before
    kernel = object()  # an implementation from apex / transformer-engine stays
    old = clip_grads.l2_norm_impl
    clip_grads.l2_norm_impl = kernel
    try:
        with multi_tensor_ops("foreach"):
            assert clip_grads.l2_norm_impl is kernel and clip_grads.multi_tensor_scale_impl is foreach_scale
        assert clip_grads.l2_norm_impl is kernel
    finally:
        clip_grads.l2_norm_impl = old
    with pytest.raises(ValueError, match="choose foreach or loop"):
        with multi_tensor_ops("apex"):
            pass
    with pytest.raises(ConfigError, match="optim.multi_tensor"):
        from nano_hybrid import runconfig

        runconfig.validate(compose([*BASE, "optim.multi_tensor=apex"]))


def test_optimizer_step_with_foreach_ops_equals_megatrons_loop(mp, monkeypatch):
    """guarded_step (gradient norm, clipping, AdamW) from the same state under optim.multi_tensor=foreach and =loop:
    the same gradient norm and bitwise the same parameters, with clipping active, at every step of a trajectory;
    the foreach run computes the norm with torch._foreach_norm, the loop run with one norm per tensor. The foreach
    step dispatches a fixed handful of ops whatever the number of parameters; the loop, several per parameter."""
    from nano_hybrid import runconfig, trainer as T
    from nano_hybrid.optim import multi_tensor_ops
    from nano_hybrid.stepguard import guarded_step

    cfg = compose([*BASE, "optim.clip_grad=0.05"])
    plan = runconfig.validate(cfg)
    torch.manual_seed(0)
    ddp, opt, sched = T.build_model_and_optimizer(plan, cfg)
    calls = collections.Counter()
    real_norm = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: calls.update(["foreach"]) or real_norm(*a, **k))
    for step in _gradient_steps(ddp, opt, 3):
        snap = _snapshot(opt)
        results = {}
        for kind in ("loop", "foreach"):
            _restore(snap)
            calls.clear()
            ops = _OpCount()
            with T.cpu_compat_mode(plan), multi_tensor_ops(kind), torch.no_grad(), ops:
                ok, norm = guarded_step(opt, 1.0)
            if step > 1:  # the first step also creates the Adam states, two per parameter
                assert (ops.n < 30) if kind == "foreach" else (ops.n > 2 * len(snap)), (kind, ops.n, len(snap))
            assert ok and norm > cfg.optim.clip_grad  # clipping scaled the gradients
            assert (calls["foreach"] > 0) == (kind == "foreach")
            results[kind] = (norm, [p.detach().clone() for _, p, *_ in snap])
        assert results["foreach"][0] == results["loop"][0], step
        assert all(torch.equal(x, y) for x, y in zip(results["foreach"][1], results["loop"][1])), step
