"""optim.fused=true (torch's fused AdamW) against torch's default AdamW in megatron's optimizer (CPU)."""

import pytest
import torch

from nano_hybrid.config import ConfigError, compose

BASE = ["model=tiny", "parallel=single", "kernels.backend=torch", "data=mock", "train.train_iters=20",
        "optim.warmup_iters=2", "optim.lr=3e-3", "logger.wandb.mode=disabled"]


def _train(fused: bool, steps: int = 4):
    from nano_hybrid import train as T

    cfg = compose([*BASE, f"optim.fused={str(fused).lower()}"])
    plan = T.validate(cfg)
    torch.manual_seed(0)
    ddp, opt, sched = T.build_model_and_optimizer(plan, cfg)
    init = {n: p.detach().clone() for n, p in ddp.named_parameters()}
    g = torch.Generator().manual_seed(5)
    b, s = 2, 32
    pos = torch.arange(s)[None].expand(b, s)
    for _ in range(steps):
        tok = torch.randint(0, 256, (b, s), generator=g)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(tok, pos, None, labels=tok.roll(-1, 1)).mean().backward()
        ddp.finish_grad_sync()
        with T.cpu_compat_mode(plan):
            ok, _, _ = opt.step()
        assert ok
        sched.step(increment=1)
    return {n: p.detach().clone() for n, p in ddp.named_parameters()}, opt, init


def test_fused_adamw_matches_default(mp, monkeypatch):
    from nano_hybrid.optim import inner_torch_optimizers

    calls = []
    real = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: calls.append(1) or real(*a, **k))
    ref, ref_opt, init = _train(False)
    assert not calls and all(not g["fused"] for o in inner_torch_optimizers(ref_opt) for g in o.param_groups)
    got, opt, _ = _train(True)
    assert len(calls) >= 4  # the fused kernel ran in every step
    assert all(g["fused"] and not g["foreach"] for o in inner_torch_optimizers(opt) for g in o.param_groups)
    assert set(got) == set(ref) and len(got) > 20
    # the same AdamW update up to fp32 rounding (the fused kernel orders the arithmetic differently; for an
    # entry whose gradient is ~0, m / (sqrt(v) + eps) amplifies a last-bit difference): every entry within
    # 1e-5 (lr is 3e-3), all but 1 in 10^4 within 1e-6
    n_far = n_all = 0
    for name, p in got.items():
        torch.testing.assert_close(p, ref[name], rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        n_far += int(((p - ref[name]).abs() > 1e-6).sum())
        n_all += p.numel()
    assert n_far <= n_all * 1e-4, (n_far, n_all)
    # the optimizer really updated the weights (a no-op update would also "match")
    assert sum(not torch.allclose(got[n], init[n]) for n in got) > 20


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
    from nano_hybrid import train as T

    with pytest.raises(ConfigError, match="optim.fused=1 must be true or false"):
        T.validate(compose([*BASE, "optim.fused=1"]))
