"""``cfg.model`` (+ ``cfg.parallel``) -> megatron ``TransformerConfig`` with the Mamba fields.

The model yaml files use megatron-core's own field names wherever one exists (``num_attention_heads``,
``num_query_groups``, ``kv_channels``, ``mamba_num_heads``, ``moe_router_topk``, ...), so the mapping
below is mostly 1:1. Keys that are not TransformerConfig fields:

- ``name``, ``hybrid_override_pattern`` (num_layers = its length), ``vocab_size``,
  ``make_vocab_size_divisible_by``, ``seq_length``, ``untie_embeddings_and_output_weights``,
  ``position_embedding_type``: MambaModel arguments.
- ``mamba_chunk_size``, ``mamba_conv_width``: MambaMixer arguments (``chunk_size``, ``d_conv``).
- ``squared_relu``: ``activation_func = squared_relu``, non-gated.
- ``attention_impl`` (``sdpa`` | ``unfused``) and ``moe_experts_impl`` (``grouped`` | ``sequential``):
  which core-attention and expert modules the layer spec uses (see ``nano_hybrid.model.specs``).
- ``lm_head_loss`` (``plain`` | ``chunked`` | ``chunked_compiled``) and ``lm_loss_chunk_tokens``: the LM head + cross-entropy,
  see ``nano_hybrid.model.lm_loss``.
- ``recompute`` (``none`` | ``selective`` | ``full``) and ``recompute_modules`` (used by ``selective``):
  activation recompute, see ``nano_hybrid.model.recompute``.
- ``use_cpu_initialization`` (default false): megatron's field of that name, but only ever switched
  *on* by this key; CPU (and meta) builds always initialise on the host. When on, every weight is
  drawn on the host from the seed alone (the global torch CPU generator, the same on every rank), as a
  full-size master of which each rank keeps its TP/EP slice: megatron's ``_initialize_affine_weight_cpu``
  for the linears/embeddings, ``GroupedGemmExperts`` for the experts, ``BackendMambaMixer`` for the
  Mamba conv1d / dt_bias / A_log and the in_proj (split per z/x/B/C/dt component). The initial weights
  are then the same for every TP/EP/DP layout (``moe_experts_impl=grouped``; megatron's
  ``SequentialMLP`` draws only its local experts, so it is EP-invariant only at EP=1). Slower start
  (the masters are drawn on one CPU thread: ~16 s for the 5-layer MEM*E slice of nano30b_slice),
  same per-step cost.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from omegaconf import DictConfig, OmegaConf

from nano_hybrid import mcore_compat
from nano_hybrid.errors import ConfigError
from nano_hybrid.model.lm_loss import lm_head_settings
from nano_hybrid.schema import ModelSchema, optional_defaults, required

ATTENTION_IMPLS = ("sdpa", "unfused")
MOE_EXPERTS_IMPLS = ("grouped", "sequential")
LAYER_SYMBOLS = set("ME*-")

RECOMPUTE_CHOICES = ("none", "selective", "full")
# model.recompute / model.recompute_modules (see nano_hybrid.model.recompute); the first five are
# recomputed by megatron's own TransformerLayer / Attention / MoELayer, ssd by BackendMambaMixer
MEGATRON_RECOMPUTE_MODULES = ("core_attn", "layernorm", "moe", "shared_experts", "mlp")
RECOMPUTE_MODULES = (*MEGATRON_RECOMPUTE_MODULES, "ssd")


def recompute_settings(m: dict) -> tuple[str, tuple[str, ...]]:
    """(choice, modules) from a model dict; modules are empty unless the choice is ``selective``.

    Raises ``ValueError`` naming the key on a bad value (``check_model_cfg`` turns it into a ConfigError).
    """
    choice = m["recompute"]
    if choice not in RECOMPUTE_CHOICES:
        raise ValueError(f"model.recompute={choice!r}; choose one of {', '.join(RECOMPUTE_CHOICES)}")
    modules = m["recompute_modules"]
    if modules is None:
        modules = []
    if isinstance(modules, str) or not all(isinstance(x, str) for x in modules):
        raise ValueError(f"model.recompute_modules={modules!r} must be a list of names from {', '.join(RECOMPUTE_MODULES)}")
    bad = sorted(set(modules) - set(RECOMPUTE_MODULES))
    if bad:
        raise ValueError(f"model.recompute_modules has unknown name(s) {bad}; choose from {', '.join(RECOMPUTE_MODULES)}")
    if choice == "selective" and not modules:
        raise ValueError("model.recompute=selective needs a non-empty model.recompute_modules")
    return choice, (tuple(dict.fromkeys(modules)) if choice == "selective" else ())


def megatron_recompute_kwargs(choice: str, modules: Iterable[str]) -> dict:
    """The ``TransformerConfig`` fields for the part megatron's own layers recompute."""
    mods = [x for x in modules if x in MEGATRON_RECOMPUTE_MODULES]
    if choice != "selective" or not mods:
        return {"recompute_granularity": None, "recompute_modules": []}
    return {"recompute_granularity": "selective", "recompute_modules": mods}


# model-yaml keys copied verbatim into TransformerConfig
_PASSTHROUGH = (
    "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "mamba_num_heads", "mamba_head_dim", "mamba_state_dim", "mamba_num_groups",
    "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
    "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
    "moe_router_bias_update_rate", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
    "moe_router_dtype", "moe_token_dispatcher_type", "init_method_std", "hidden_dropout",
    "attention_dropout",
)
_MODEL_ONLY = (
    "name", "hybrid_override_pattern", "vocab_size", "make_vocab_size_divisible_by", "seq_length",
    "untie_embeddings_and_output_weights", "position_embedding_type", "mamba_chunk_size",
    "mamba_conv_width", "mamba_fused_norm", "squared_relu", "norm_epsilon", "attention_impl", "moe_experts_impl",
    "use_cpu_initialization", "recompute", "recompute_modules", "lm_head_loss", "lm_loss_chunk_tokens",
)
# The model keys every config states and the defaults of the others: nano_hybrid/schema.py (ModelSchema), the one
# place they live. A plain mapping read here (not a composed config) takes MODEL_DEFAULTS for absent or null keys.
REQUIRED = required(ModelSchema)
MODEL_DEFAULTS = optional_defaults(ModelSchema)


def model_dict(model_cfg: Any) -> dict:
    """``cfg.model`` (a DictConfig or a mapping) as a plain dict, with MODEL_DEFAULTS for absent or null keys."""
    m = OmegaConf.to_container(model_cfg, resolve=True) if isinstance(model_cfg, DictConfig) else dict(model_cfg)
    for key, value in MODEL_DEFAULTS.items():
        if m.get(key) is None:
            m[key] = list(value) if isinstance(value, list) else value
    return m  # type: ignore[return-value]


def mamba_heads(m: dict) -> int:
    """The Mamba mixer's head count: ``model.mamba_num_heads``, or megatron's d_inner = 2 x hidden_size in heads of
    ``model.mamba_head_dim`` when it is null (a ConfigError when that does not divide)."""
    heads = m.get("mamba_num_heads")
    if heads is None:
        if (2 * m["hidden_size"]) % m["mamba_head_dim"]:
            raise ConfigError(f"model.mamba_num_heads=null needs 2 x model.hidden_size={m['hidden_size']} to be a "
                              f"multiple of model.mamba_head_dim={m['mamba_head_dim']}; set model.mamba_num_heads")
        heads = 2 * m["hidden_size"] // m["mamba_head_dim"]
    return int(heads)


# megatron-core's router choices (megatron/core/transformer/moe/router.py)
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
MOE_ROUTER_DTYPES = (None, "fp32", "fp64")

# torch._grouped_mm takes operands whose rows are 16-byte aligned: widths that are multiples of 8 in bf16 (4 in fp32)
GROUPED_MM_ALIGN = 8


def check_model_cfg(m: dict) -> None:
    """Fail early, naming the key, on a malformed model config."""
    missing = [k for k in REQUIRED if m.get(k) is None]
    if missing:
        raise ConfigError(f"model config {m.get('name')!r} is missing {', '.join(missing)}")
    unknown = sorted(set(m) - set(_PASSTHROUGH) - set(_MODEL_ONLY))
    if unknown:
        raise ConfigError(f"model config {m['name']!r} has unknown key(s) {unknown}")
    pat = m["hybrid_override_pattern"]
    bad = sorted(set(pat) - LAYER_SYMBOLS)
    if not pat:
        raise ConfigError("model.hybrid_override_pattern is empty: one symbol per layer (M Mamba-2, E MoE, * attention, "
                          "- dense MLP)")
    if bad:
        raise ConfigError(f"model.hybrid_override_pattern={pat!r}: symbols must be from M E * - (bad: {bad})")
    if m["attention_impl"] not in ATTENTION_IMPLS:
        raise ConfigError(f"model.attention_impl={m['attention_impl']!r}; choose one of {', '.join(ATTENTION_IMPLS)}")
    if m["moe_experts_impl"] not in MOE_EXPERTS_IMPLS:
        raise ConfigError(
            f"model.moe_experts_impl={m.get('moe_experts_impl')!r}; choose one of {', '.join(MOE_EXPERTS_IMPLS)}")
    for key in ("use_cpu_initialization", "mamba_fused_norm"):
        if not isinstance(m[key], bool):
            raise ConfigError(f"model.{key}={m.get(key)!r} must be true or false")
    try:
        recompute_settings(m)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        lm_head_settings(m)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if "E" in pat and not m.get("num_moe_experts"):
        raise ConfigError(f"model.hybrid_override_pattern has MoE layers (E) but model.num_moe_experts={m.get('num_moe_experts')}")
    if "*" in pat and not m.get("num_attention_heads"):
        raise ConfigError("model.hybrid_override_pattern has attention layers (*) but model.num_attention_heads is not set")
    if m["position_embedding_type"] not in ("none", "rope", "learned_absolute"):
        raise ConfigError(f"model.position_embedding_type={m.get('position_embedding_type')!r}; use none, rope or learned_absolute")
    for k, low, high, closed in (("norm_epsilon", 0.0, math.inf, False), ("init_method_std", 0.0, math.inf, False),
                                 ("hidden_dropout", 0.0, 1.0, True), ("attention_dropout", 0.0, 1.0, True)):
        v = m[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                (low <= v if closed else low < v) and v < high):
            where = f"in [{low:g}, {high:g})" if closed else "> 0 and finite"
            raise ConfigError(f"model.{k}={v!r} must be {where}")
    for k, choices in (("moe_router_score_function", MOE_SCORE_FUNCTIONS),
                       ("moe_router_load_balancing_type", MOE_LOAD_BALANCING_TYPES),
                       ("moe_router_dtype", MOE_ROUTER_DTYPES)):
        if m.get(k) not in choices:
            raise ConfigError(f"model.{k}={m.get(k)!r}; choose one of {', '.join(str(c).replace('None', 'null') for c in choices)}")

    def positive(k: str, nullable: bool = False) -> None:
        v = m.get(k)
        if v is None and nullable:
            return
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"model.{k}={v!r} must be a positive integer" + (" or null" if nullable else ""))

    for k in ("hidden_size", "vocab_size", "seq_length", "make_vocab_size_divisible_by"):
        positive(k)
    for k in ("ffn_hidden_size", "kv_channels", "num_query_groups", "moe_ffn_hidden_size",
              "moe_shared_expert_intermediate_size"):
        positive(k, nullable=True)
    if "M" in pat:
        for k in ("mamba_head_dim", "mamba_state_dim", "mamba_num_groups", "mamba_chunk_size", "mamba_conv_width"):
            positive(k)
        positive("mamba_num_heads", nullable=True)
        heads = mamba_heads(m)
        if heads % m["mamba_num_groups"]:
            raise ConfigError(f"model.mamba_num_heads={heads} must be divisible by "
                              f"model.mamba_num_groups={m['mamba_num_groups']}")
    if "*" in pat:
        positive("num_attention_heads")
        groups = m.get("num_query_groups") or m["num_attention_heads"]
        if m["num_attention_heads"] % groups:
            raise ConfigError(f"model.num_attention_heads={m['num_attention_heads']} must be divisible by "
                              f"model.num_query_groups={groups}")
        if m.get("kv_channels") is None and m["hidden_size"] % m["num_attention_heads"]:
            raise ConfigError(f"model.hidden_size={m['hidden_size']} must be divisible by model.num_attention_heads="
                              f"{m['num_attention_heads']} (or set model.kv_channels)")
    if "E" in pat:
        positive("num_moe_experts")
        positive("moe_router_topk")
        if m["moe_router_topk"] > m["num_moe_experts"]:
            raise ConfigError(f"model.moe_router_topk={m['moe_router_topk']} > model.num_moe_experts={m['num_moe_experts']}")
        width = m.get("moe_ffn_hidden_size") or m.get("ffn_hidden_size")
        if width is None:
            raise ConfigError("model.hybrid_override_pattern has MoE layers (E) but neither model.moe_ffn_hidden_size "
                              "nor model.ffn_hidden_size is set")
        if m["moe_experts_impl"] == "grouped" and (m["hidden_size"] % GROUPED_MM_ALIGN or width % GROUPED_MM_ALIGN):
            raise ConfigError(
                f"model.moe_experts_impl=grouped (torch._grouped_mm) needs model.hidden_size={m['hidden_size']} and the "
                f"expert width {width} to be multiples of {GROUPED_MM_ALIGN} (16-byte rows in bf16); use "
                "model.moe_experts_impl=sequential for these widths")


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: pad to a multiple of ``make_vocab_size_divisible_by * tensor_model_parallel_size``."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def make_transformer_config(cfg: DictConfig, *, device: torch.device, dtype: torch.dtype):
    """Build the megatron ``TransformerConfig`` for ``cfg.model`` under ``cfg.parallel`` on ``device``."""
    from megatron.core.activations import squared_relu
    from megatron.core.transformer import TransformerConfig

    m = model_dict(cfg.model)
    check_model_cfg(m)
    p = cfg.parallel
    kw = {k: m[k] for k in _PASSTHROUGH if m.get(k) is not None}
    on_cuda = device.type == "cuda"
    kw.update(
        num_layers=len(m["hybrid_override_pattern"]),
        normalization="RMSNorm",
        layernorm_epsilon=float(m["norm_epsilon"]),
        add_bias_linear=False,
        gated_linear_unit=False,
        # megatron's squared_relu is torch.compile'd (jit_fuser): a long first-call compile on CPU
        activation_func=(
            (squared_relu if on_cuda else mcore_compat.uncompiled(squared_relu))
            if m["squared_relu"] else torch.nn.functional.gelu
        ),
        use_mamba_mem_eff_path=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # CPU (and meta) builds initialise on the host; GPU builds directly on the device (per-rank
        # RNG streams: fast, but the weights depend on the TP/EP layout) unless
        # model.use_cpu_initialization=true (layout-invariant host init, see the module docstring).
        use_cpu_initialization=not on_cuda or bool(m["use_cpu_initialization"]),
        perform_initialization=device.type != "meta",
        # bias_dropout_fusion uses torch.compile (megatron/core/jit.py): 16 s first step on CPU.
        bias_dropout_fusion=on_cuda,
        # megatron's fused masked softmax needs the scaled_masked_softmax_cuda extension (Apex/TE builds),
        # which this recipe does not require: the unfused attention path uses torch softmax.
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=int(p.tensor_model_parallel_size),
        pipeline_model_parallel_size=int(p.pipeline_model_parallel_size),
        expert_model_parallel_size=int(p.expert_model_parallel_size),
        expert_tensor_parallel_size=int(p.expert_tensor_parallel_size),
        context_parallel_size=int(p.context_parallel_size),
        sequence_parallel=bool(p.sequence_parallel),
        pipeline_dtype=dtype,
    )
    kw.update(megatron_recompute_kwargs(*recompute_settings(m)))
    from nano_hybrid.model.fp8 import fp8_settings, te_fp8_kwargs, transformer_engine_available

    if transformer_engine_available():  # megatron's TE fp8 path (config mapping; torchao swap otherwise)
        kw.update(te_fp8_kwargs(fp8_settings(cfg)[0]))
    if m.get("num_moe_experts"):
        # the grouped-experts module is our own (nano_hybrid.model.experts); megatron's legacy
        # GroupedMLP needs the CUDA-only grouped_gemm package, so megatron's flag stays off.
        kw["moe_grouped_gemm"] = False
    try:
        return TransformerConfig(**kw)
    except (AssertionError, ValueError) as e:
        raise ConfigError(f"megatron rejected model config {m['name']!r}: {e}") from None


def mixer_dims(cfg: DictConfig) -> dict[str, int]:
    """The Mamba mixer's kernel dims one rank of the run ``cfg`` calls: b (micro-batch), l (sequence), h and g (heads
    and groups per rank), p, n, c (chunk), w (conv width). With context parallelism, megatron's
    ``MambaContextParallel`` exchanges the sequence for heads before the conv and the SSD: each rank's kernels see the
    whole sequence with heads / (TP x CP) heads and groups / (TP x CP) groups, or 1 group (replicated) where
    groups / TP < CP. ``scripts/tune_kernels.py`` tunes exactly these; a split that does not divide is a
    ConfigError naming the keys."""
    m = model_dict(cfg.model)
    check_model_cfg(m)
    par = cfg.parallel
    tp = int(par.tensor_model_parallel_size)
    cp = int(par.context_parallel_size)
    if "M" not in m["hybrid_override_pattern"]:
        raise ConfigError(f"model {m.get('name')!r} has no Mamba mixer (no M in model.hybrid_override_pattern)")
    h, g = mamba_heads(m), int(m["mamba_num_groups"])
    for key, v in (("model.mamba_num_heads", h), ("model.mamba_num_groups", g)):
        if v % tp:
            raise ConfigError(f"{key}={v} is not divisible by parallel.tensor_model_parallel_size={tp}")
    h, g = h // tp, g // tp
    if h % cp:
        raise ConfigError(f"model.mamba_num_heads per tensor-parallel rank ({h}) is not divisible by "
                          f"parallel.context_parallel_size={cp}")
    if (cp % g) if g < cp else (g % cp):
        raise ConfigError(f"model.mamba_num_groups per tensor-parallel rank ({g}) and "
                          f"parallel.context_parallel_size={cp}: one must divide the other")
    seq = int(cfg.train.seq_length)
    if seq % cp:
        raise ConfigError(f"train.seq_length={seq} is not divisible by parallel.context_parallel_size={cp}")
    return dict(b=int(cfg.train.micro_batch_size), l=seq, h=h // cp, p=int(m["mamba_head_dim"]), g=max(1, g // cp),
                n=int(m["mamba_state_dim"]), c=int(m["mamba_chunk_size"]), w=int(m["mamba_conv_width"]))
