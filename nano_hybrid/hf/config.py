"""``cfg.model`` <-> Hugging Face Nemotron-H ``config.json`` (``model_type: nemotron_h``).

:func:`hf_config` writes every architecture field the way the published Nemotron-3 Nano 30B-A3B
config spells it (``hybrid_override_pattern`` and ``num_hidden_layers`` as well as transformers 5's
``layers_block_type``, ``norm_eps`` beside ``layer_norm_epsilon``), so transformers, vLLM and older
readers all find what they need. :func:`check_hf_config` compares a folder's ``config.json`` with a
model config and names the first architecture field that differs.

Fields that are not architecture: ``max_position_embeddings`` is ``model.seq_length`` (the model has no
position embedding: ``position_embedding_type: none``), ``initializer_range`` is ``init_method_std``,
the token ids come from the run's tokenizer. ``expand`` is written as 2, the published value:
transformers and vLLM take the Mamba inner width from ``mamba_num_heads x mamba_head_dim``.
"""

from __future__ import annotations

import math

from nano_hybrid.hf.mapping import MappingError

LAYER_TYPES = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
# legacy spellings found in configs on the Hub (transformers' remap_legacy_layer_types)
_LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}

# The architecture fields compared on import (order = the order mismatches are looked for).
ARCH_FIELDS = (
    "hybrid_override_pattern", "hidden_size", "vocab_size", "tie_word_embeddings",
    "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "use_conv_bias",
    "mamba_hidden_act", "mamba_proj_bias",
    "num_attention_heads", "num_key_value_heads", "head_dim", "attention_bias",
    "intermediate_size", "mlp_hidden_act", "mlp_bias", "use_bias",
    "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
    "n_shared_experts", "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group",
    "layer_norm_epsilon",
)


def _check_supported(m: dict) -> None:
    if str(m["position_embedding_type"]) != "none":
        raise MappingError(f"model.position_embedding_type={m['position_embedding_type']!r}: Nemotron-H has no "
                           "position embedding (use none)")
    pat = str(m["hybrid_override_pattern"])
    if "E" in pat:
        if str(m["moe_router_score_function"]) != "sigmoid":
            raise MappingError(f"model.moe_router_score_function={m.get('moe_router_score_function')!r}: "
                               "Nemotron-H routes with sigmoid scores")
        if not m.get("moe_shared_expert_intermediate_size"):
            raise MappingError("model.moe_shared_expert_intermediate_size is not set: Nemotron-H MoE layers have a shared expert")
        if int(m["moe_router_topk"]) < 2:
            raise MappingError("model.moe_router_topk=1: megatron does not normalise a single sigmoid score, "
                               "Nemotron-H does (norm_topk_prob)")


TRANSFORMERS_VERSION = "5.17.0"


def hf_config(m: dict, vocab_size: int, *, dtype: str = "bfloat16", token_ids: dict | None = None) -> dict:
    """The ``config.json`` dict for model config ``m`` (a plain dict of ``cfg.model``) with the
    (padded) embedding size ``vocab_size``. ``token_ids``: bos/eos/pad ids of the run's tokenizer."""
    from nano_hybrid.model.config import model_dict

    m = model_dict(m)
    _check_supported(m)
    pat = str(m["hybrid_override_pattern"])
    heads = int(m.get("num_attention_heads") or 1)
    ffn = m.get("ffn_hidden_size")
    ffn = int(ffn) if ffn is not None else 4 * int(m["hidden_size"])
    experts = int(m.get("num_moe_experts") or 0)
    eps = float(m["norm_epsilon"])
    c = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hybrid_override_pattern": pat,
        "layers_block_type": [LAYER_TYPES[s] for s in pat],
        "num_hidden_layers": len(pat),
        "hidden_size": int(m["hidden_size"]),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": not bool(m["untie_embeddings_and_output_weights"]),
        "max_position_embeddings": int(m["seq_length"]),
        # Mamba-2
        "mamba_num_heads": int(m.get("mamba_num_heads") or 0),
        "mamba_head_dim": int(m.get("mamba_head_dim") or 0),
        "ssm_state_size": int(m.get("mamba_state_dim") or 0),
        "n_groups": int(m["mamba_num_groups"]),
        "conv_kernel": int(m["mamba_conv_width"]),
        "chunk_size": int(m["mamba_chunk_size"]),
        "use_conv_bias": True,
        "mamba_hidden_act": "silu",
        "mamba_proj_bias": False,
        "expand": 2,
        "time_step_min": 0.001,   # megatron MambaMixer dt_min / dt_max / dt_init_floor
        "time_step_max": 0.1,
        "time_step_floor": 0.0001,
        "mamba_ssm_cache_dtype": "float32",
        # attention
        "num_attention_heads": heads,
        "num_key_value_heads": int(m.get("num_query_groups") or heads),
        "head_dim": int(m.get("kv_channels") or int(m["hidden_size"]) // heads),
        "attention_bias": False,
        "attention_dropout": float(m["attention_dropout"]),
        # MLP / MoE
        "intermediate_size": ffn,
        "mlp_hidden_act": "relu2" if m["squared_relu"] else "gelu",
        "mlp_bias": False,
        "use_bias": False,
        "n_routed_experts": experts,
        "num_experts_per_tok": int(m["moe_router_topk"]) if experts else 0,
        "moe_intermediate_size": int(m.get("moe_ffn_hidden_size") or ffn) if experts else 0,
        "moe_shared_expert_intermediate_size": int(m.get("moe_shared_expert_intermediate_size") or 0),
        "n_shared_experts": 1 if m.get("moe_shared_expert_intermediate_size") else 0,
        "routed_scaling_factor": float(m.get("moe_router_topk_scaling_factor") or 1.0),
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        # norms, init, misc
        "layer_norm_epsilon": eps,
        "norm_eps": eps,
        "hidden_dropout": float(m["hidden_dropout"]),
        "initializer_range": float(m["init_method_std"]),
        "residual_in_fp32": False,
        "rescale_prenorm_residual": True,
        "use_cache": True,
        "use_mamba_kernels": True,
        "num_logits_to_keep": 1,
        "dtype": dtype,
        "torch_dtype": dtype,  # the name transformers 4.x, vLLM and the published config use
        # the transformers release the folder is written for (the project's pin): transformers >= 5 reads the
        # tokenizer's split regex as written (no fix_mistral_regex rewrite, no warning that one is needed)
        "transformers_version": TRANSFORMERS_VERSION,
    }
    c.update(token_ids or {})
    return c


# transformers' NemotronHConfig defaults (5.17) for the architecture fields: a config.json that omits
# one gets this value in transformers, so it is compared as such
HF_DEFAULTS = {
    "hidden_size": 4096, "vocab_size": 131072, "tie_word_embeddings": False,
    "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
    "use_conv_bias": True, "mamba_hidden_act": "silu", "mamba_proj_bias": False,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "attention_bias": False,
    "intermediate_size": 21504, "mlp_hidden_act": "relu2", "mlp_bias": False, "use_bias": False,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
    "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "layer_norm_epsilon": 1e-5,
}
# older spellings transformers still accepts
_ALIASES = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "use_conv_bias": "mamba_conv_bias"}


def _pattern_of(hf: dict) -> str:
    if hf.get("hybrid_override_pattern"):
        return str(hf["hybrid_override_pattern"])
    types = hf.get("layers_block_type") or hf.get("layer_types")
    if types:
        inv = {v: k for k, v in LAYER_TYPES.items()}
        try:
            return "".join(inv[_LEGACY_LAYER_TYPES.get(t, t)] for t in types)
        except KeyError as e:
            raise MappingError(f"config.json: unknown layer type {e.args[0]!r}") from None
    return "ME*-"  # transformers' default layers_block_type


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
        except (TypeError, ValueError):
            return False
    return a == b


def first_mismatch(hf: dict, ours: dict) -> str | None:
    """The first architecture field where the HF ``config.json`` dict ``hf`` differs from ``ours`` (a
    :func:`hf_config` dict), as ``"name: folder has X, this run has Y"``; None when they agree."""
    if hf.get("model_type") != "nemotron_h":
        return f"model_type: folder has {hf.get('model_type')!r}, this run needs 'nemotron_h'"
    if int(hf.get("num_nextn_predict_layers") or 0):
        return f"num_nextn_predict_layers: folder has {hf['num_nextn_predict_layers']} MTP layers, this run has none"
    if hf.get("moe_latent_size") is not None:
        return f"moe_latent_size: folder has {hf['moe_latent_size']}, this run has no latent MoE projection"
    pattern = _pattern_of(hf)
    uses = set(ours["hybrid_override_pattern"])
    for key in ARCH_FIELDS:
        if key == "hybrid_override_pattern":
            theirs = pattern
        elif key in hf:
            theirs = hf[key]
        elif _ALIASES.get(key) in hf:
            theirs = hf[_ALIASES[key]]
        else:
            theirs = HF_DEFAULTS[key]
        mine = ours[key]
        # fields of a layer kind the pattern does not use are irrelevant
        if key in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel",
                   "use_conv_bias", "mamba_hidden_act", "mamba_proj_bias") and "M" not in uses:
            continue
        if key in ("num_attention_heads", "num_key_value_heads", "head_dim", "attention_bias") and "*" not in uses:
            continue
        if key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                   "moe_shared_expert_intermediate_size", "n_shared_experts", "routed_scaling_factor",
                   "norm_topk_prob", "n_group", "topk_group") and "E" not in uses:
            continue
        if key == "intermediate_size" and "-" not in uses:
            continue
        if key == "mlp_hidden_act" and not (uses & {"E", "-"}):
            continue
        if not _same(theirs, mine):
            return f"{key}: folder has {theirs!r}, this run has {mine!r}"
    return None
