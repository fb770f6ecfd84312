"""model=nano_proxy: Nano's layer kinds at reduced depth and width, with the per-layer Mamba-2 dims the kernels
see in Nano, GQA attention, top-k MoE with a shared expert and the 131k vocabulary; its size and FLOPs are the
numbers its config states."""

from __future__ import annotations

import warnings

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

from nano_hybrid.arch import HybridArch  # noqa: E402
from nano_hybrid.config import CONFIG_DIR, compose  # noqa: E402
from nano_hybrid.flops import forward_flops_per_token, training_flops_per_token  # noqa: E402
from nano_hybrid.model import build_model, count_params  # noqa: E402
from nano_hybrid.model.mixer import BackendMambaMixer  # noqa: E402

TOTAL, ACTIVE = 164_369_600, 84_677_824


def _build():
    cfg = compose(["model=nano_proxy", "kernels.backend=torch"])
    return cfg, build_model(cfg, device="meta")


def test_pattern_is_nanos_first_layers_in_nanos_proportions(mp):
    cfg, model = _build()
    nano = str(compose(["model=nano30b"]).model.hybrid_override_pattern)
    pattern = str(cfg.model.hybrid_override_pattern)
    assert nano.startswith(pattern) and len(model.decoder.layers) == len(pattern) == 9
    assert (pattern.count("M"), pattern.count("E"), pattern.count("*")) == (4, 4, 1)
    assert model.decoder.layer_type_list == list(pattern)


def test_mamba_layers_have_the_dims_the_kernels_see_in_nano(mp):
    cfg, model = _build()
    nano = compose(["model=nano30b"]).model
    mixers = [m for m in model.modules() if isinstance(m, BackendMambaMixer)]
    assert len(mixers) == 4
    for m in mixers:
        # per-head dims, groups and chunk exactly as Nano's; fewer heads, d_inner = 2 x hidden as in Nano
        assert (m.headdim, m.d_state, m.ngroups, m.chunk_size) == (64, 128, 8, 128)
        assert (m.headdim, m.d_state, m.ngroups, m.chunk_size) == (
            nano.mamba_head_dim, nano.mamba_state_dim, nano.mamba_num_groups, nano.mamba_chunk_size)
        assert m.nheads == 16 and m.d_inner == 16 * 64 == 2 * cfg.model.hidden_size
        assert m.nheads % m.ngroups == 0
        # zxBCdt = z, x (d_inner each), B, C (8 groups x 128 each), dt (one per head); conv over x, B, C
        assert m.in_proj.weight.shape == (2 * 1024 + 2 * 8 * 128 + 16, 512)
        assert m.conv1d.weight.shape == (1024 + 2 * 8 * 128, 1, 4)
    arch = HybridArch.from_megatron(model)
    assert arch == HybridArch.from_model_cfg(cfg.model)
    assert arch.in_proj_width == 4112 and arch.conv_channels == 3072


def test_attention_is_gqa_and_moe_is_topk_with_a_shared_expert(mp):
    cfg, model = _build()
    attn = model.decoder.layers[5].self_attention
    assert attn.linear_qkv.weight.shape == ((8 + 2 * 2) * 64, 512)  # 8 query heads, 2 KV heads of 64
    moe = model.decoder.layers[1].mlp
    assert moe.router.weight.shape == (16, 512) and model.config.moe_router_topk == 4
    assert moe.shared_experts is not None
    assert model.embedding.word_embeddings.weight.shape == (131072, 512)
    assert model.output_layer.weight.shape == (131072, 512)  # untied LM head


def test_size_and_flops_are_what_the_config_states(mp):
    cfg, model = _build()
    c = count_params(model)
    assert c["total_params"] == TOTAL and c["active_params"] == ACTIVE, c
    arch = HybridArch.from_model_cfg(cfg.model)
    fwd, train = forward_flops_per_token(arch, 1024), training_flops_per_token(arch, 1024)
    text = (CONFIG_DIR / "model" / "nano_proxy.yaml").read_text()
    for stated in (f"{TOTAL / 1e6:.1f}M parameters", f"{ACTIVE / 1e6:.1f}M active",
                   f"{fwd / 1e6:.1f}M forward", f"{train / 1e6:.1f}M training"):
        assert stated in text, stated
