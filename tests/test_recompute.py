"""Activation recompute (``model.recompute``): the gradients of every choice equal the no-recompute ones.

One gloo process builds model=tiny (M, E and * layers; fp32, CPU) with dropout on (so the RNG
restore of the checkpoint regions is exercised) once per choice, loads the same weights, runs one
forward + backward on the same batch from the same RNG state and compares loss, MoE aux-loss log
and every parameter gradient with ``recompute=none``. Each variant also has to actually recompute:
forward hooks count how often the recomputed modules run (twice per step instead of once).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

from nano_hybrid.config import ConfigError, compose  # noqa: E402

BASE = ["model=tiny", "kernels.backend=torch", "model.seq_length=64", "model.hidden_dropout=0.1",
        "model.attention_dropout=0.1", "model.hybrid_override_pattern=MEM*E-"]

# choice, modules, {module kind: extra forward calls per step}
ONCE = {"mamba": 2, "mixer_norm": 2, "norm": 6, "attn": 1, "core_attn": 1, "moe": 2, "shared": 2, "mlp": 1}
VARIANTS = [
    ("full", [], ONCE),
    ("selective", ["layernorm"], {"norm": 6}),
    ("selective", ["moe"], {"moe": 2, "shared": 2}),
    ("selective", ["core_attn"], {"core_attn": 1}),
    ("selective", ["ssd"], {"mixer_norm": 2}),
    ("selective", ["mlp"], {"mlp": 1}),
    ("selective", ["shared_experts"], {"shared": 2}),
    ("selective", ["moe", "layernorm", "ssd", "core_attn"], {"norm": 6, "moe": 2, "shared": 2, "mixer_norm": 2, "core_attn": 1}),
]


@pytest.fixture(scope="module")
def gloo():
    import torch.distributed as dist

    from nano_hybrid.parallel import destroy_parallel, initialize_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    initialize_parallel(compose(BASE))
    yield
    destroy_parallel()
    assert not dist.is_initialized()


def _counting_hooks(model) -> dict:
    """Forward-call counters per module kind (count every call, recomputations included)."""
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    counts = {k: 0 for k in ("mamba", "moe", "attn", "mlp", "norm", "core_attn", "mixer_norm", "shared")}

    def hook(kind):
        def f(*_):
            counts[kind] += 1
        return f

    for layer in model.decoder.layers:
        if isinstance(layer, MambaLayer):
            layer.register_forward_hook(hook("mamba"))
            layer.norm.register_forward_hook(hook("norm"))
            layer.mixer.norm.register_forward_hook(hook("mixer_norm"))
        elif isinstance(layer, MLPLayer):
            layer.mlp.register_forward_hook(hook("mlp"))
            layer.pre_mlp_layernorm.register_forward_hook(hook("norm"))
        elif isinstance(layer, TransformerLayer) and isinstance(layer.mlp, MoELayer):
            layer.mlp.router.register_forward_hook(hook("moe"))  # inside MoELayer's checkpoint region
            layer.pre_mlp_layernorm.register_forward_hook(hook("norm"))
            layer.mlp.shared_experts.register_forward_hook(hook("shared"))
        else:
            layer.register_forward_hook(hook("attn"))
            layer.input_layernorm.register_forward_hook(hook("norm"))
            layer.self_attention.core_attention.register_forward_hook(hook("core_attn"))
    return counts


def _step(overrides, state=None, device="cpu"):
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    from nano_hybrid import mcore_compat
    from nano_hybrid.model import build_model

    cfg = compose([*BASE, *overrides])
    torch.manual_seed(0)
    model = build_model(cfg, device=device)
    if state is not None:
        model.load_state_dict(state)
    model.train()
    counts = _counting_hooks(model)
    g = torch.Generator().manual_seed(3)
    s, b = 64, 2
    tok = torch.randint(0, 256, (b, s), generator=g).to(device)
    pos = torch.arange(s, device=device)[None].expand(b, s)
    torch.manual_seed(11)
    mcore_compat.model_parallel_manual_seed(77)
    clear_aux_losses_tracker()
    loss = model(tok, pos, None, labels=tok).float().mean()
    loss.backward()
    aux = {k: v["values"].clone() for k, v in get_moe_layer_wise_logging_tracker().items()}
    clear_aux_losses_tracker()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return model, loss.detach(), grads, aux, counts


@pytest.fixture(scope="module")
def reference(gloo):
    model, loss, grads, aux, counts = _step([])
    return {k: v.clone() for k, v in model.state_dict().items() if v is not None}, loss, grads, aux, counts


@pytest.mark.parametrize("choice,modules,extra", VARIANTS, ids=[f"{c}-{'+'.join(m) or 'all'}" for c, m, _ in VARIANTS])
def test_recompute_gradients_match(reference, choice, modules, extra):
    state, ref_loss, ref_grads, ref_aux, ref_counts = reference
    mods = "[" + ",".join(modules) + "]"
    _, loss, grads, aux, counts = _step([f"model.recompute={choice}", f"model.recompute_modules={mods}"], state)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    assert set(grads) == set(ref_grads) and len(grads) > 20
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert set(aux) == set(ref_aux)
    for name in aux:  # the aux-loss log counts each layer once (no double logging in the recompute)
        torch.testing.assert_close(aux[name], ref_aux[name], rtol=0, atol=1e-6)
    expected = {k: v + extra.get(k, 0) for k, v in ref_counts.items()}
    assert counts == expected


def test_no_recompute_runs_each_module_once(reference):
    *_, counts = reference
    assert counts == ONCE


GPU_VARIANTS = [v for v in VARIANTS if v[0] == "full" or len(v[1]) > 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("choice,modules,extra", GPU_VARIANTS, ids=[f"{c}-{'+'.join(m) or 'all'}" for c, m, _ in GPU_VARIANTS])
def test_recompute_gradients_match_gpu_mamba_ssm(gloo, choice, modules, extra):
    """The same on one GPU with mamba-ssm's kernels (fp32; the CUDA RNG streams restored by the checkpoints)."""
    gpu = ["kernels.backend=mamba_ssm"]
    model, ref_loss, ref_grads, ref_aux, ref_counts = _step(gpu, device="cuda")
    state = {k: v.clone() for k, v in model.state_dict().items() if v is not None}
    del model
    mods = "[" + ",".join(modules) + "]"
    _, loss, grads, aux, counts = _step([*gpu, f"model.recompute={choice}", f"model.recompute_modules={mods}"],
                                        state, device="cuda")
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5)
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():  # mamba-ssm's backward accumulates with atomics: not bitwise
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert set(aux) == set(ref_aux)
    assert counts == {k: v + extra.get(k, 0) for k, v in ref_counts.items()}


@pytest.mark.parametrize("override,msg", [
    ("model.recompute=partial", "model.recompute='partial'; choose one of none, selective, full"),
    ("model.recompute_modules=[moe,attention]", "unknown name(s) ['attention']"),
    ("model.recompute_modules=[]", "model.recompute=selective needs a non-empty model.recompute_modules"),
])
def test_bad_recompute_settings_are_config_errors(override, msg):
    from nano_hybrid.model.config import check_model_cfg, model_dict

    overrides = [*BASE, override]
    if "recompute=" not in override:
        overrides.append("model.recompute=selective")
    with pytest.raises(ConfigError) as e:
        check_model_cfg(model_dict(compose(overrides).model))
    assert msg in str(e.value)
