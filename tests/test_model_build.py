"""Model builds for every model config, tiny forward/backward on CPU, 30B counts on meta, backend selection."""

from __future__ import annotations

import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

from kernels.registry import BackendUnavailableError, UnknownBackendError, get_backend  # noqa: E402
from nano_hybrid.config import CONFIG_DIR, ConfigError, compose  # noqa: E402
from nano_hybrid.model import build_model, count_params  # noqa: E402
from nano_hybrid.model.mixer import BackendMambaMixer  # noqa: E402

MODEL_CONFIGS = sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))
NANO30B_TOTAL = 31.58e9


def _batch(b, s, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, vocab, (b, s), generator=g)
    pos = torch.arange(s)[None].expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    return tok, pos, mask


def test_model_configs_present():
    assert {"tiny", "nano30b", "nano30b_slice"} <= set(MODEL_CONFIGS)


@pytest.mark.parametrize("name", MODEL_CONFIGS)
def test_every_model_config_builds_on_meta(mp, name):
    cfg = compose([f"model={name}", "kernels.backend=torch"])
    model = build_model(cfg, device="meta")
    pattern = cfg.model.hybrid_override_pattern
    assert len(model.decoder.layers) == len(pattern)
    mixers = [m for m in model.modules() if isinstance(m, BackendMambaMixer)]
    assert len(mixers) == pattern.count("M")
    assert all(p.device.type == "meta" for p in model.parameters())


def test_tiny_forward_backward_cpu(mp):
    cfg = compose(["model=tiny", "kernels.backend=torch"])
    torch.manual_seed(0)
    model = build_model(cfg)
    counts = count_params(model)
    assert 1e6 < counts["total_params"] < 2e7, counts
    pattern = cfg.model.hybrid_override_pattern
    assert set("ME*") <= set(pattern)
    tok, pos, mask = _batch(2, 128, cfg.model.vocab_size)
    loss = model(tok, pos, mask, labels=tok)
    assert loss.shape == (2, 128)
    loss = loss.mean()
    # untrained: close to uniform over the padded vocab
    assert abs(loss.item() - torch.log(torch.tensor(512.0)).item()) < 1.0
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, missing
    zero = [n for n, p in model.named_parameters() if p.grad.abs().sum() == 0]
    assert not zero, zero


def test_tiny_trains_a_few_steps(mp):
    cfg = compose(["model=tiny", "kernels.backend=torch", "model.seq_length=64"])
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tok, pos, mask = _batch(4, 64, 256, seed=1)
    losses = []
    for _ in range(6):
        loss = model(tok, pos, mask, labels=tok).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


def test_mixer_training_path_matches_megatron_prefill_path(mp):
    """Our _ssm_training (fused op, norm without z) equals megatron's own _ssm_prefill path
    (nn.Conv1d + chunk scan + norm(y, z)) with the same weights: checks the arguments we pass."""
    cfg = compose(["model=tiny", "kernels.backend=torch"])
    torch.manual_seed(0)
    model = build_model(cfg)
    mixer = next(m for m in model.modules() if isinstance(m, BackendMambaMixer))
    x = torch.randn(96, 2, cfg.model.hidden_size)
    y_train, _ = mixer(x)
    mixer.use_mem_eff_path = False
    try:
        y_prefill, _ = mixer(x)
    finally:
        mixer.use_mem_eff_path = True
    torch.testing.assert_close(y_train, y_prefill, rtol=1e-4, atol=1e-5)


def test_backend_is_chosen_per_model_without_global_patching(mp):
    import megatron.core.ssm.mamba_mixer as mm

    before = (mm.HAVE_MAMBA_SSM, mm.ExtendedRMSNorm, getattr(mm, "mamba_split_conv1d_scan_combined", None))
    model = build_model(compose(["model=tiny", "kernels.backend=torch"]))
    after = (mm.HAVE_MAMBA_SSM, mm.ExtendedRMSNorm, getattr(mm, "mamba_split_conv1d_scan_combined", None))
    assert before == after
    backend = get_backend("torch")
    for m in model.modules():
        if isinstance(m, BackendMambaMixer):
            assert m.kernel_backend is backend
            assert isinstance(m.norm, backend.RMSNormGated)


def test_nano30b_counts_on_meta(mp):
    model = build_model(compose(["model=nano30b", "kernels.backend=torch"]), device="meta")
    c = count_params(model)
    assert abs(c["total_params"] - NANO30B_TOTAL) / NANO30B_TOTAL < 0.003, c
    assert 3.2e9 <= c["active_params"] <= 3.6e9, c
    assert 3.2e9 <= c["active_params_incl_embedding"] <= 3.6e9, c
    assert c["embedding_params"] == 131072 * 2688 and c["output_layer_params"] == 131072 * 2688


def _layer_params(model):
    return [sum(p.numel() for p in layer.parameters()) for layer in model.decoder.layers]


def test_nano30b_slice_is_the_first_13_layers_with_32_experts(mp):
    full = build_model(compose(["model=nano30b", "kernels.backend=torch"]), device="meta")
    sl = build_model(compose(["model=nano30b_slice", "kernels.backend=torch"]), device="meta")
    assert sl.config.num_moe_experts == 32 and full.config.num_moe_experts == 128
    assert sl.config.moe_router_topk == full.config.moe_router_topk == 6
    pat = full.decoder.layer_type_list[:13]
    assert sl.decoder.layer_type_list == pat
    expert = 2 * 2688 * 1856  # one routed expert's fc1 + fc2
    for kind, n_full, n_slice in zip(pat, _layer_params(full)[:13], _layer_params(sl)):
        if kind == "E":
            # 96 fewer routed experts and 96 fewer router rows (the expert bias is a buffer)
            assert n_full - n_slice == 96 * expert + 96 * 2688, (n_full, n_slice)
        else:
            assert n_full == n_slice


def test_unknown_backend_is_one_clear_error(mp):
    with pytest.raises(UnknownBackendError, match=r"unknown kernel backend 'nope'.*torch, mamba_ssm, helion"):
        build_model(compose(["model=tiny", "kernels.backend=nope"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_mamba_ssm_backend_on_cpu_is_unavailable(mp):
    with pytest.raises(BackendUnavailableError, match="mamba_ssm.*CUDA"):
        build_model(compose(["model=tiny", "kernels=mamba_ssm"]))


def test_bad_model_settings_fail_early(mp):
    with pytest.raises(ConfigError, match="attention_impl='flash'"):
        build_model(compose(["model=tiny", "model.attention_impl=flash"]))
    with pytest.raises(ConfigError, match="moe_experts_impl='loop'"):
        build_model(compose(["model=tiny", "model.moe_experts_impl=loop"]))
    with pytest.raises(ConfigError, match="symbols must be from"):
        build_model(compose(["model=tiny", "model.hybrid_override_pattern=MX"]))


def test_vocab_is_configurable_and_padded(mp):
    model = build_model(compose(["model=tiny", "model.vocab_size=300"]), device="meta")
    assert model.embedding.word_embeddings.weight.shape[0] == 384  # padded to a multiple of 128


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tiny_bf16_on_gpu_with_each_backend(mp):
    from kernels.registry import available_backends

    for name, why in available_backends().items():
        if why is not None:
            continue
        model = build_model(compose(["model=tiny", f"kernels.backend={name}"]), dtype=torch.bfloat16)
        tok, pos, mask = (t.cuda() for t in _batch(2, 256, 512))
        loss = model(tok, pos, mask, labels=tok).float().mean()
        loss.backward()
        assert torch.isfinite(loss), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="CudaToCpuMode is the CPU path")
def test_megatron_ddp_and_distributed_optimizer_train_tiny_on_cpu(mp):
    """mcore_compat's CPU shims let megatron DDP + DistributedOptimizer (built/stepped under
    CudaToCpuMode) train the tiny model."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from nano_hybrid import mcore_compat

    torch.manual_seed(0)
    model = build_model(compose(["model=tiny", "model.seq_length=64"]))
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True), model)
    with mcore_compat.CudaToCpuMode():
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=3e-3, use_distributed_optimizer=True, clip_grad=1.0), [ddp])
    tok, pos, mask = _batch(4, 64, 256, seed=2)
    losses = []
    for _ in range(4):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(tok, pos, mask, labels=tok).mean()
        loss.backward()
        ddp.finish_grad_sync()
        with mcore_compat.CudaToCpuMode():
            ok, grad_norm, _ = opt.step()
        assert ok and grad_norm > 0
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.parametrize("strided", [False, True])
def test_mixer_copies_zxbcdt_only_for_backends_that_need_it(mp, strided):
    """The mixer hands zxbcdt to a ``strided_zxbcdt`` backend (helion) as the (b, l, d) view of in_proj's (l, b, d)
    output, and a contiguous copy to the others (mamba-ssm, torch); the result does not depend on it."""
    import dataclasses

    cfg = compose(["model=tiny", "kernels.backend=torch"])
    torch.manual_seed(0)
    model = build_model(cfg)
    mixer = next(m for m in model.modules() if isinstance(m, BackendMambaMixer))
    x = torch.randn(96, 2, cfg.model.hidden_size)
    y_ref, _ = mixer(x)
    seen = []
    base = mixer.kernel_backend

    def op(zxbcdt, *a, **kw):
        seen.append(zxbcdt.is_contiguous())
        return base.mamba_split_conv1d_scan_combined(zxbcdt, *a, **kw)

    mixer.kernel_backend = dataclasses.replace(base, mamba_split_conv1d_scan_combined=op, strided_zxbcdt=strided)
    try:
        y, _ = mixer(x)
    finally:
        mixer.kernel_backend = base
    assert seen == [not strided]
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)


def test_fused_norm_is_the_same_model(mp):
    """model.mamba_fused_norm=true (the mixer passes its gated norm's weight to the op) computes the same function as the
    norm module after the gated op: the same parameters and checkpoint keys, loss and every gradient equal within fp32
    rounding (torch backend, fp32); switching it in place on a built model (``arms.set_fused_norm``) gives the same;
    a non-boolean value fails at config validation."""
    from nano_hybrid.bench.arms import set_fused_norm

    res = {}
    for fused in (False, True):
        cfg = compose(["model=tiny", "kernels.backend=torch", f"model.mamba_fused_norm={str(fused).lower()}"])
        torch.manual_seed(0)
        model = build_model(cfg)
        assert all(m.fused_norm == fused for m in model.modules() if isinstance(m, BackendMambaMixer))
        tok, pos, mask = _batch(2, 64, cfg.model.vocab_size)
        model(tok, pos, mask, labels=tok).mean().backward()
        res[fused] = (model(tok, pos, mask, labels=tok).mean().item(),
                      {n: p.grad.clone() for n, p in model.named_parameters()})
        if fused:
            assert set_fused_norm(model, False) == cfg.model.hybrid_override_pattern.count("M")
            assert model(tok, pos, mask, labels=tok).mean().item() == pytest.approx(res[False][0], rel=1e-5)
            set_fused_norm(model, True)  # and back, as the benchmark arms switch it
            assert model(tok, pos, mask, labels=tok).mean().item() == pytest.approx(res[True][0], rel=1e-6)
            with pytest.raises(ValueError, match="true or false"):
                set_fused_norm(model, 1)
    assert res[True][0] == pytest.approx(res[False][0], rel=1e-5)
    assert res[True][1].keys() == res[False][1].keys()
    for n, g in res[False][1].items():
        torch.testing.assert_close(res[True][1][n], g, atol=1e-5, rtol=1e-4, msg=n)
    with pytest.raises(ConfigError, match="mamba_fused_norm"):
        build_model(compose(["model=tiny", "kernels.backend=torch", "model.mamba_fused_norm=3"]))


def test_apply_arm_switches_the_fused_norm(mp):
    """The step benchmarks' arms switch model.mamba_fused_norm in place (``arms.apply_arm``): an arm's own value, and
    for an arm without the key the composed config's."""
    from types import SimpleNamespace

    from nano_hybrid.bench import arms

    cfg = compose(["model=tiny", "kernels.backend=torch"])
    model = build_model(cfg)
    ctx = SimpleNamespace(cfg=cfg, model=model, optimizer=None)
    on, plain = arms.parse_arm("torch:model.mamba_fused_norm=true"), arms.parse_arm("torch")
    backends = arms.arm_backends(cfg, [on, plain])
    mixers = [m for m in model.modules() if isinstance(m, BackendMambaMixer)]
    for arm, want in ((on, True), (plain, False), (on, True)):
        arms.apply_arm(ctx, arm, backends)
        assert [m.fused_norm for m in mixers] == [want] * len(mixers)
