"""train.fp8 (nano_hybrid/model/fp8.py): config errors, which modules the swap takes, unchanged parameters and
checkpoints, and the float8 matmul's error against fp32 (torch's CPU ``_scaled_mm`` runs float8 e4m3)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

from nano_hybrid.config import compose  # noqa: E402
from nano_hybrid.errors import ConfigError  # noqa: E402
from nano_hybrid.model import build_model  # noqa: E402
from nano_hybrid.model import fp8 as F  # noqa: E402


CPU = torch.device("cpu")
# e4m3 keeps 3 mantissa bits: round-to-nearest's relative error per operand is at most u = 2^-4. A product of two
# independently rounded operands has relative error <= ~2u per term, zero-mean, so the relative Frobenius error of
# a matmul of zero-mean random data is <= sqrt(2) * u (plus the bf16/fp32 output rounding, <= 2^-9).
U_E4M3 = 2.0 ** -4
FP8_BOUND = math.sqrt(2) * U_E4M3 + 2.0 ** -9
# a bf16 matmul is within ~2^-8 of fp32: above 4 * 2^-9 the fp8 casts did happen
FP8_FLOOR = 4 * 2.0 ** -9


def _cfg(*overrides):
    return compose(["model=tiny", "kernels.backend=torch", *overrides])


# ------------------------------------------------------------------------------------------- config errors
@pytest.mark.parametrize("overrides,message", [
    (["train.fp8=e5m2"], "train.fp8='e5m2'; choose one of none, tensorwise, rowwise"),
    (["train.fp8=rowwise", "train.fp8_modules=[mamba_proj,lm_head]"], "train.fp8_modules has 'lm_head'"),
    (["train.fp8=rowwise", "train.fp8_modules=[router]"], "train.fp8_modules has 'router'"),
    (["train.fp8=rowwise", "train.fp8_modules=mamba_proj"], "train.fp8_modules='mamba_proj' must be a list"),
    (["train.fp8=tensorwise", "train.fp8_modules=[experts]"], "torchao's fp8 grouped GEMM scales rowwise only"),
    (["train.fp8=rowwise", "train.fp8_modules=[experts]"], "model.moe_experts_impl=grouped needs CUDA"),
])
def test_bad_fp8_settings_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        F.check_settings(_cfg(*overrides), CPU)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_good_fp8_settings_pass():
    for ov in (["train.fp8=none"], ["train.fp8=tensorwise"], ["train.fp8=rowwise", "train.fp8_modules=[]"],
               ["train.fp8=tensorwise", "train.fp8_modules=[experts]", "model.moe_experts_impl=sequential"]):
        F.check_settings(_cfg(*ov), CPU)


def test_fp8_without_torchao_says_how_to_install(monkeypatch):
    monkeypatch.setattr(F, "torchao_available", lambda: False)
    F.check_settings(_cfg("train.fp8=none"), CPU)  # none needs nothing
    with pytest.raises(ConfigError, match=r"train.fp8=rowwise needs torchao.*pip install torchao=="):
        F.check_settings(_cfg("train.fp8=rowwise"), CPU)


def test_fp8_on_a_cpu_without_float8_matmul_is_refused(monkeypatch):
    monkeypatch.setattr(F, "cpu_scaled_mm_error", lambda: "RuntimeError: no CPU kernel")
    with pytest.raises(ConfigError, match=r"train.fp8=tensorwise on train.device=cpu.*no CPU kernel"):
        F.check_settings(_cfg("train.fp8=tensorwise"), CPU)


def test_validate_checks_fp8_and_records_it(tmp_path):
    from nano_hybrid.runconfig import validate

    with pytest.raises(ConfigError, match="train.fp8='fp4'"):
        validate(_cfg("train.fp8=fp4", "data=mock", f"run_dir={tmp_path}"))
    plan = validate(_cfg("train.fp8=rowwise", "train.fp8_modules=[attention]", "data=mock", f"run_dir={tmp_path}"))
    assert plan.run.train.fp8 == "rowwise" and list(plan.run.train.fp8_modules) == ["attention"]


def test_this_torch_runs_float8_matmul_on_cpu():
    assert F.torchao_available()
    assert F.cpu_scaled_mm_error() is None  # torch 2.13's CPU _scaled_mm: the numerics tests below run here


def test_defaults():
    cfg = _cfg()
    assert cfg.train.fp8 == "none"
    assert list(cfg.train.fp8_modules) == ["mamba_proj", "attention", "mlp", "shared_expert"]


# ------------------------------------------------------------------------------------------- the swap
# MEM*E: 2 mixers, 1 attn, 2 MoE; the mixers' in_proj (648 x 256) stays bf16 (648 is not a multiple of 16)
TINY_COUNTS = {"mamba_proj": 2, "attention": 2, "mlp": 0, "shared_expert": 4}


@pytest.fixture(scope="module")
def tiny(mp):
    torch.manual_seed(0)
    return build_model(_cfg("model.moe_experts_impl=sequential"))


def _sig(model):
    return {n: (tuple(p.shape), p.dtype) for n, p in model.state_dict().items() if torch.is_tensor(p)}


@pytest.mark.parametrize("kinds", [("mamba_proj",), ("attention",), ("shared_expert",), ("experts",),
                                   ("mamba_proj", "attention", "mlp", "shared_expert", "experts"), ()])
def test_swap_takes_exactly_the_chosen_kinds(tiny, kinds):
    before = _sig(tiny)
    params = {n: p for n, p in tiny.named_parameters()}
    counts = F.apply_fp8(tiny, "rowwise", kinds)
    try:
        expected = {**{k: 0 for k in F.FP8_MODULE_KINDS}, **{k: TINY_COUNTS.get(k, 32) for k in kinds}}
        assert counts == expected  # experts (sequential): 8 experts x fc1/fc2 x 2 MoE layers
        swapped = F.fp8_modules(tiny)
        assert len(swapped) == sum(expected.values())
        assert not any("output_layer" in n or "router" in n for n in swapped)
        assert set(swapped.values()) <= {"rowwise"}
        # same Parameter objects, names, shapes, dtypes; same state_dict
        assert {n: p for n, p in tiny.named_parameters()} == params
        assert _sig(tiny) == before
    finally:
        F.apply_fp8(tiny, "none", ())
    assert F.fp8_modules(tiny) == {}
    assert _sig(tiny) == before


def test_checkpoints_load_across_fp8_and_bf16(mp):
    torch.manual_seed(0)
    a = build_model(_cfg("train.fp8=tensorwise"))
    torch.manual_seed(1)
    b = build_model(_cfg())
    assert len(F.fp8_modules(a)) == sum(TINY_COUNTS.values()) and F.fp8_modules(b) == {}
    sd_a, sd_b = a.state_dict(), b.state_dict()
    assert sd_a.keys() == sd_b.keys()
    b.load_state_dict(sd_a, strict=True)  # fp8 run's checkpoint into a bf16 model
    for k, v in sd_a.items():
        if torch.is_tensor(v):
            assert torch.equal(b.state_dict()[k], v), k
    torch.manual_seed(2)
    c = build_model(_cfg())
    a.load_state_dict(c.state_dict(), strict=True)  # and back
    assert all(torch.equal(a.state_dict()[k], v) for k, v in c.state_dict().items() if torch.is_tensor(v))


def test_linears_off_the_fp8_alignment_stay_bf16_with_one_warning(tiny):
    with pytest.warns(UserWarning) as rec:
        counts = F.apply_fp8(tiny, "tensorwise", ("mamba_proj",))
    try:
        msgs = [str(w.message) for w in rec if "stay bf16" in str(w.message)]
        assert msgs == ["train.fp8=tensorwise: 2 linear(s) stay bf16, a weight dim not being a multiple of 16 "
                        "(float8 GEMM alignment): 2 x mamba_proj in_proj 648x256"], msgs
        assert counts["mamba_proj"] == 2
        assert all("out_proj" in n for n in F.fp8_modules(tiny))
    finally:
        F.apply_fp8(tiny, "none", ())


@pytest.mark.parametrize("sizes", [[61, 0, 99, 32], [16, 32], [0, 0, 5], [1]])
def test_pad_groups_aligns_each_group_and_round_trips(sizes):
    """fp8_grouped_mm's padding: every group starts on a multiple of 16, the padding rows are zero, and a grouped
    GEMM over the padded rows gathered back equals the unpadded grouped GEMM, forward and backward."""
    from nano_hybrid.model.experts import grouped_mm

    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    m, k, n = int(offs[-1]), 32, 48
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g, requires_grad=True)
    w = torch.randn(len(sizes), n, k, generator=g, requires_grad=True)
    xp, pends, dest = F.pad_groups(x, offs, 16)
    assert xp.shape == ((m + 15 * len(sizes) + 15) // 16 * 16, k) and pends.dtype == torch.int32
    padded = [(s + 15) // 16 * 16 for s in sizes]
    assert pends.tolist() == torch.cumsum(torch.tensor(padded), 0).tolist()
    starts = [p - q for p, q in zip(pends.tolist(), padded)]
    assert dest.tolist() == [st + i for st, s in zip(starts, sizes) for i in range(s)]
    mask = torch.ones(xp.shape[0], dtype=torch.bool)
    mask[dest] = False
    assert torch.equal(xp[dest], x) and not xp[mask].any()
    dy = torch.randn(m, n, generator=g)
    ref = grouped_mm(x, w, offs)
    gx, gw = torch.autograd.grad(ref, (x, w), dy)
    out = grouped_mm(xp, w, pends).index_select(0, dest)
    px, pw = torch.autograd.grad(out, (x, w), dy)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(px, gx)
    torch.testing.assert_close(pw, gw)


def test_unknown_recipe_or_kind_in_apply_raises(tiny):
    with pytest.raises(ValueError, match="train.fp8='e5m2'"):
        F.apply_fp8(tiny, "e5m2", ())
    with pytest.raises(ValueError, match="train.fp8_modules has 'lm_head'"):
        F.apply_fp8(tiny, "rowwise", ("lm_head",))


# ------------------------------------------------------------------------------------------- numerics (CPU)
def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_swapped_linear_matches_fp32_within_e4m3_error(tiny, recipe):
    lin = tiny.decoder.layers[0].mixer.out_proj
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, lin.input_size, generator=g)

    def run():
        xi = x.clone().requires_grad_(True)
        lin.weight.grad = None
        y, _ = lin(xi)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        y.backward(dy)
        return y.detach(), xi.grad, lin.weight.grad.clone()

    ref = run()  # the model is fp32 on CPU: megatron's matmul is the fp32 reference
    F.apply_fp8(tiny, recipe, ("mamba_proj",))
    try:
        assert type(lin).__name__ == "Fp8RowParallelLinear"
        out = run()
    finally:
        F.apply_fp8(tiny, "none", ())
    for name, o, r in zip(("output", "grad_input", "grad_weight"), out, ref):
        assert o.dtype == r.dtype and o.shape == r.shape
        assert FP8_FLOOR < _rel(o, r) < FP8_BOUND, (name, _rel(o, r))


def test_fp8_model_trains_forward_backward_close_to_fp32(mp):
    from tests.test_model_build import _batch

    torch.manual_seed(0)
    ref = build_model(_cfg())
    torch.manual_seed(0)
    m = build_model(_cfg("train.fp8=rowwise"))
    tok, pos, mask = _batch(2, 64, 512)
    l_ref = ref(tok, pos, mask, labels=tok).mean()
    l_fp8 = m(tok, pos, mask, labels=tok).mean()
    l_fp8.backward()
    assert abs(l_fp8.item() - l_ref.item()) < 0.05 * l_ref.item()
    bad = [n for n, p in m.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not bad, bad


def test_te_mapping():
    assert F.te_fp8_kwargs("none") == {}
    assert F.te_fp8_kwargs("tensorwise") == {"fp8": "hybrid", "fp8_recipe": "tensorwise"}
    with pytest.raises(ConfigError, match="train.fp8=rowwise has no transformer-engine recipe"):
        F.te_fp8_kwargs("rowwise")


# ------------------------------------------------------------------------------------------- runs (CPU)
def test_fp8_run_resumes_bitwise_and_its_checkpoint_serves_bf16_and_the_hf_export(tmp_path):
    """train.fp8=tensorwise (attention linears) through ``nano_hybrid.train``: 2N steps uninterrupted == N steps, SIGKILL while saving
    step 2N, resume from N (losses and final model + optimizer state bitwise); a bf16 run continues from the fp8
    run's checkpoint; the HF export reads it."""
    from side_by_side import side_by_side

    from nano_hybrid import export_hf
    from tests.test_checkpoint_resume import N, _assert_ok, _env, ckpt_tensors, losses, train

    fp8 = ["train.fp8=tensorwise", "train.fp8_modules=[attention]"]  # torch's CPU float8 matmul is slow: 2 linears
    a, b, c = tmp_path / "A", tmp_path / "B", tmp_path / "C"
    pa, pb1 = side_by_side(
        lambda: train(a, *fp8, f"train.train_iters={2 * N}", "checkpoint.interval=0"),
        lambda: train(b, *fp8, f"train.train_iters={2 * N}", f"checkpoint.interval={N}", hooked=True,
                      env=_env(NANO_HYBRID_TEST_KILL_DURING_SAVE=str(2 * N))))
    _assert_ok(pa)
    assert pb1.returncode != 0
    _assert_ok(train(b, *fp8, f"train.train_iters={2 * N}", f"checkpoint.interval={N}"))
    la, lb = losses(a), losses(b)
    assert sorted(la) == list(range(1, 2 * N + 1)) and la == lb
    ta = ckpt_tensors(a / "checkpoints" / f"iter_{2 * N:07d}", tmp_path)
    tb = ckpt_tensors(b / "checkpoints" / f"iter_{2 * N:07d}", tmp_path)
    keys = sorted(k for k, v in ta.items() if isinstance(v, torch.Tensor))
    assert any("optimizer" in k for k in keys) and keys == sorted(k for k, v in tb.items() if torch.is_tensor(v))
    assert all(torch.equal(ta[k], tb[k]) for k in keys)
    # a bf16 (train.fp8=none) run resumes from the fp8 run's step-N checkpoint: same step N+1 batch and weights,
    # so its first loss is the fp8 run's within e4m3's effect on the loss
    pc = train(c, f"train.train_iters={2 * N}", "checkpoint.interval=0",
               f"checkpoint.load={b / 'checkpoints' / f'iter_{N:07d}'}")
    _assert_ok(pc)
    lc = losses(c)
    assert sorted(lc) == list(range(N + 1, 2 * N + 1))
    assert lc[N + 1] != la[N + 1] and abs(lc[N + 1] - la[N + 1]) < 0.02 * la[N + 1], (lc, la)
    assert export_hf.main([str(b / "checkpoints" / f"iter_{2 * N:07d}"), str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    from safetensors.torch import load_file

    hf = {}
    for f in sorted((tmp_path / "hf").glob("model-*.safetensors")):
        hf.update(load_file(f))
    assert hf and all(torch.isfinite(v).all() for v in hf.values())
