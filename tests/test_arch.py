"""The one architecture record (``nano_hybrid.arch.HybridArch``): from ``cfg.model`` it equals the record read
from the megatron model built for that config, and its derived widths are the built tensors' widths."""

from __future__ import annotations

import warnings

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

from nano_hybrid.arch import HybridArch  # noqa: E402
from nano_hybrid.config import compose  # noqa: E402
from nano_hybrid.model import build_model  # noqa: E402


def test_tiny_arch_from_config_equals_arch_from_built_model(mp):
    cfg = compose(["model=tiny", "kernels.backend=torch", "model.vocab_size=300"])
    model = build_model(cfg)
    built = HybridArch.from_megatron(model)
    assert HybridArch.from_model_cfg(cfg.model) == built
    assert built.padded_vocab_size == 384 == model.embedding.word_embeddings.weight.shape[0]
    assert HybridArch.from_model_cfg(cfg.model, tensor_model_parallel_size=2).padded_vocab_size == 512
    assert (built.mamba_conv_width, built.mamba_chunk_size) == (4, 64)
    assert not built.tied_embeddings and built.num_layers == 5
    mixer = model.decoder.layers[0].mixer
    assert built.d_inner == 256 and built.bc_width == 64
    assert mixer.in_proj.weight.shape == (built.in_proj_width, built.hidden_size)
    assert mixer.conv1d.weight.shape == (built.conv_channels, 1, built.mamba_conv_width)
    qkv = model.decoder.layers[3].self_attention.linear_qkv.weight
    assert qkv.shape[0] == (built.num_attention_heads + 2 * built.num_query_groups) * built.attention_head_dim
