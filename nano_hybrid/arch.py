"""The hybrid model's architecture shape: one frozen record for the FLOPs formula (``flops.py``), the
Hugging Face tensor mapping (``hf/mapping.py``) and the memory planner (``plan.py``).

Field names are megatron-core's (``TransformerConfig`` / ``MambaModel``), plus the project's two
MambaMixer arguments ``mamba_conv_width`` (``d_conv``) and ``mamba_chunk_size`` (``chunk_size``).
Two constructors describe the same model:

- :meth:`HybridArch.from_model_cfg`: from ``cfg.model`` (a dict or DictConfig) and the tensor-parallel
  size (the vocabulary is padded for it, as ``build_model`` pads it); no model is built.
- :meth:`HybridArch.from_megatron`: from a built megatron ``MambaModel`` (unwrapped).

Defaults where a value is not set, in both: ``num_query_groups`` = ``num_attention_heads``,
``kv_channels`` = hidden / heads, ``mamba_num_heads`` = 2 x hidden / ``mamba_head_dim`` when the
pattern has Mamba layers (megatron's expand 2), conv width and chunk length the schema's (``ModelSchema``);
``moe_router_topk`` and
``moe_ffn_hidden_size`` (itself defaulting to ``ffn_hidden_size``) are 0 without experts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from nano_hybrid.schema import ModelSchema, optional_defaults

_MODEL_DEFAULTS = optional_defaults(ModelSchema)


@dataclass(frozen=True)
class HybridArch:
    hybrid_override_pattern: str  # one symbol per layer: M (Mamba-2), * (attention), E (MoE), - (dense MLP)
    hidden_size: int
    padded_vocab_size: int = 0  # the embedding's / LM head's rows (vocab padded for the TP size)
    # Mamba-2
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_dim: int = 0
    mamba_num_groups: int = 1
    mamba_conv_width: int = _MODEL_DEFAULTS["mamba_conv_width"]
    mamba_chunk_size: int = _MODEL_DEFAULTS["mamba_chunk_size"]
    # attention
    num_attention_heads: int = 0
    num_query_groups: int = 0
    kv_channels: int = 0
    # MoE / dense MLP
    num_moe_experts: int = 0
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    ffn_hidden_size: int = 0
    gated_linear_unit: bool = False
    share_embeddings_and_output_weights: bool = False

    # ------------------------------------------------------------------------------ derived
    @property
    def num_layers(self) -> int:
        return len(self.hybrid_override_pattern)

    @property
    def d_inner(self) -> int:
        """Mamba inner width: heads x head dim."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def bc_width(self) -> int:
        """Width of each of the Mamba B and C projections: groups x state dim."""
        return self.mamba_num_groups * self.mamba_state_dim

    @property
    def in_proj_width(self) -> int:
        """Mamba ``in_proj`` output width: z, x (d_inner each), B, C (bc_width each), dt (heads)."""
        return 2 * self.d_inner + 2 * self.bc_width + self.mamba_num_heads

    @property
    def conv_channels(self) -> int:
        """Channels of the Mamba depthwise conv1d: x, B, C."""
        return self.d_inner + 2 * self.bc_width

    @property
    def attention_head_dim(self) -> int:
        return self.kv_channels

    @property
    def tied_embeddings(self) -> bool:
        return self.share_embeddings_and_output_weights

    def as_dict(self) -> dict:
        return asdict(self)

    # ------------------------------------------------------------------------- constructors
    @classmethod
    def from_model_cfg(cls, m, tensor_model_parallel_size: int = 1) -> "HybridArch":
        """From ``cfg.model`` (dict or DictConfig); the vocabulary is padded as megatron pads it for
        ``tensor_model_parallel_size``."""
        from nano_hybrid.model.config import model_dict, padded_vocab_size

        m = model_dict(m)

        def i(key, default=0):
            v = m.get(key)
            return int(v) if v is not None else default

        pattern = str(m["hybrid_override_pattern"])
        hidden, heads, experts = i("hidden_size"), i("num_attention_heads"), i("num_moe_experts")
        head_dim = i("mamba_head_dim")
        mamba_heads = i("mamba_num_heads")
        if "M" in pattern and not mamba_heads and head_dim:
            mamba_heads = (2 * hidden) // head_dim  # megatron's default: expand 2
        vocab = m.get("vocab_size")
        return cls(
            hybrid_override_pattern=pattern,
            hidden_size=hidden,
            padded_vocab_size=padded_vocab_size(int(vocab), i("make_vocab_size_divisible_by"),
                                                int(tensor_model_parallel_size)) if vocab is not None else 0,
            mamba_num_heads=mamba_heads,
            mamba_head_dim=head_dim,
            mamba_state_dim=i("mamba_state_dim"),
            mamba_num_groups=i("mamba_num_groups"),
            mamba_conv_width=i("mamba_conv_width"),
            mamba_chunk_size=i("mamba_chunk_size"),
            num_attention_heads=heads,
            num_query_groups=i("num_query_groups") or heads,
            kv_channels=i("kv_channels") or (hidden // heads if heads else 0),
            num_moe_experts=experts,
            moe_router_topk=i("moe_router_topk") if experts else 0,
            moe_ffn_hidden_size=(i("moe_ffn_hidden_size") or i("ffn_hidden_size")) if experts else 0,
            moe_shared_expert_intermediate_size=i("moe_shared_expert_intermediate_size"),
            ffn_hidden_size=i("ffn_hidden_size"),
            gated_linear_unit=False,  # make_transformer_config builds non-gated MLPs/experts
            share_embeddings_and_output_weights=not bool(m["untie_embeddings_and_output_weights"]),
        )

    @classmethod
    def from_megatron(cls, model) -> "HybridArch":
        """From a built megatron ``MambaModel`` (unwrapped) and its TransformerConfig.

        Conv width and chunk size come from this rank's first Mamba mixer (the schema's defaults when a
        pipeline stage holds none)."""
        cfg = model.config
        pattern = getattr(model, "hybrid_override_pattern", None)
        if not pattern:
            raise ValueError("model has no hybrid_override_pattern; the architecture needs the layer pattern")
        mixer = next((x for x in model.modules() if type(x).__name__.endswith("MambaMixer") or hasattr(x, "d_conv")),
                     None)
        head_dim = cfg.mamba_head_dim or 0
        mamba_heads = cfg.mamba_num_heads or 0
        if "M" in pattern and not mamba_heads:
            mamba_heads = (2 * cfg.hidden_size) // head_dim  # megatron's default: expand 2
        experts = cfg.num_moe_experts or 0
        mixer_dims = {} if mixer is None else {"mamba_conv_width": mixer.d_conv, "mamba_chunk_size": mixer.chunk_size}
        return cls(
            **mixer_dims,
            hybrid_override_pattern=pattern,
            hidden_size=cfg.hidden_size,
            padded_vocab_size=model.vocab_size,
            mamba_num_heads=mamba_heads,
            mamba_head_dim=head_dim,
            mamba_state_dim=cfg.mamba_state_dim or 0,
            mamba_num_groups=cfg.mamba_num_groups or 1,
            num_attention_heads=cfg.num_attention_heads,
            num_query_groups=cfg.num_query_groups or cfg.num_attention_heads,
            kv_channels=cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads,
            num_moe_experts=experts,
            moe_router_topk=cfg.moe_router_topk if experts else 0,
            moe_ffn_hidden_size=(cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size) if experts else 0,
            moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size or 0,
            ffn_hidden_size=cfg.ffn_hidden_size or 0,
            gated_linear_unit=bool(cfg.gated_linear_unit),
            share_embeddings_and_output_weights=bool(model.share_embeddings_and_output_weights),
        )
