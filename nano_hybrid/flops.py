"""Model FLOPs per token for the hybrid Mamba-2 / attention / MoE stack (used for ``tflops_per_gpu``).

Counts multiply-adds of matrix products as 2 FLOPs; elementwise work (norms, activations, gating,
softmax, the SSD decay exponentials, the scan across chunks) is left out, as in Megatron-LM's formula.
Training FLOPs = 3 x forward (forward, data-gradient and weight-gradient products). Per token and layer
(h = hidden, s = sequence length; symbol in the hybrid pattern in brackets):

Mamba-2 [M] (H heads of P dims, d_inner = H*P, N state dims, G groups, conv width W, chunk Q):
    in_proj   2 h (2 d_inner + 2 G N + H)
    conv1d    2 (d_inner + 2 G N) W
    SSD       2 G Q N        C B^T inside a chunk (full Q x Q block per group, as the chunked kernels compute it)
            + 2 H Q P        intra-chunk output (L o C B^T) X
            + 2 H N P        chunk states B^T X
            + 2 H N P        inter-chunk output C h
    out_proj  2 d_inner h
Attention [*] (a query heads, g KV groups, head dim d):
    q, k, v   2 h d (a + 2 g)
    core      2 a d (s + 1)  QK^T and AV over the causal average of (s + 1) / 2 keys per query
    out       2 a d h
MoE [E] (E experts, top-k, expert FFN f, shared expert FFN f_s, non-gated; x 3/2 if gated):
    router    2 h E
    routed    k * 2 * 2 h f
    shared    2 * 2 h f_s
Dense MLP [-] (FFN f):  2 * 2 h f  (x 3/2 if gated)
LM head:                2 h V   (the embedding lookup costs no FLOPs)

This formula is part of the metrics contract: changing it changes every dashboard's TFLOP/s, so
change it only together with its test (tests/test_flops.py) and say so in the changelog.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class HybridShape:
    pattern: str  # hybrid layer pattern, e.g. "MEM*E"
    hidden: int
    vocab: int  # padded vocab (the LM head's output width)
    seq_length: int
    # Mamba-2
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state: int = 0
    mamba_groups: int = 1
    conv_width: int = 4
    chunk_size: int = 128
    # attention
    attn_heads: int = 0
    attn_groups: int = 0
    attn_head_dim: int = 0
    # MoE / MLP
    num_experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    ffn: int = 0
    gated_mlp: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


def mamba_layer_flops(c: HybridShape) -> float:
    H, P, N, G = c.mamba_heads, c.mamba_head_dim, c.mamba_state, c.mamba_groups
    d_inner = H * P
    in_proj = 2 * c.hidden * (2 * d_inner + 2 * G * N + H)
    conv = 2 * (d_inner + 2 * G * N) * c.conv_width
    ssd = 2 * G * c.chunk_size * N + 2 * H * c.chunk_size * P + 4 * H * N * P
    out_proj = 2 * d_inner * c.hidden
    return float(in_proj + conv + ssd + out_proj)


def attention_layer_flops(c: HybridShape) -> float:
    a, g, d = c.attn_heads, c.attn_groups, c.attn_head_dim
    qkv = 2 * c.hidden * d * (a + 2 * g)
    core = 2 * a * d * (c.seq_length + 1)
    out = 2 * a * d * c.hidden
    return float(qkv + core + out)


def moe_layer_flops(c: HybridShape) -> float:
    mult = 1.5 if c.gated_mlp else 1.0
    router = 2 * c.hidden * c.num_experts
    routed = c.topk * 4 * c.hidden * c.moe_ffn * mult
    shared = 4 * c.hidden * c.shared_ffn * mult
    return float(router + routed + shared)


def mlp_layer_flops(c: HybridShape) -> float:
    return float(4 * c.hidden * c.ffn * (1.5 if c.gated_mlp else 1.0))


LAYER_FLOPS = {"M": mamba_layer_flops, "*": attention_layer_flops, "E": moe_layer_flops, "-": mlp_layer_flops}


def forward_flops_per_token(c: HybridShape) -> float:
    unknown = sorted(set(c.pattern) - set(LAYER_FLOPS))
    if unknown:
        raise ValueError(f"hybrid pattern {c.pattern!r} has layer symbols without a FLOPs formula: {unknown}")
    per_kind = {sym: fn(c) for sym, fn in LAYER_FLOPS.items() if sym in c.pattern}
    return sum(per_kind[sym] for sym in c.pattern) + 2.0 * c.hidden * c.vocab


def training_flops_per_token(c: HybridShape) -> float:
    """Forward + backward model FLOPs per token (3 x forward)."""
    return 3.0 * forward_flops_per_token(c)


def shape_from_megatron(model, seq_length: int) -> HybridShape:
    """Read the shape from a built megatron ``MambaModel`` (unwrapped) and its TransformerConfig.

    Conv width and chunk size come from this rank's first Mamba mixer (megatron's defaults 4 and 128
    when a pipeline stage holds none).
    """
    cfg = model.config
    pattern = getattr(model, "hybrid_override_pattern", None)
    if not pattern:
        raise ValueError("model has no hybrid_override_pattern; the FLOPs formula needs the layer pattern")
    mixer = next((m for m in model.modules() if type(m).__name__.endswith("MambaMixer") or hasattr(m, "d_conv")), None)
    mamba_heads = getattr(cfg, "mamba_num_heads", None) or 0
    head_dim = getattr(cfg, "mamba_head_dim", 0) or 0
    if "M" in pattern and not mamba_heads:
        mamba_heads = (2 * cfg.hidden_size) // head_dim  # megatron's default: expand 2
    return HybridShape(
        pattern=pattern,
        hidden=cfg.hidden_size,
        vocab=model.vocab_size,
        seq_length=seq_length,
        mamba_heads=mamba_heads,
        mamba_head_dim=head_dim,
        mamba_state=getattr(cfg, "mamba_state_dim", 0) or 0,
        mamba_groups=getattr(cfg, "mamba_num_groups", 1) or 1,
        conv_width=getattr(mixer, "d_conv", 4) if mixer is not None else 4,
        chunk_size=getattr(mixer, "chunk_size", 128) if mixer is not None else 128,
        attn_heads=cfg.num_attention_heads,
        attn_groups=cfg.num_query_groups or cfg.num_attention_heads,
        attn_head_dim=cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads,
        num_experts=cfg.num_moe_experts or 0,
        topk=cfg.moe_router_topk if cfg.num_moe_experts else 0,
        moe_ffn=(cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size) if cfg.num_moe_experts else 0,
        shared_ffn=cfg.moe_shared_expert_intermediate_size or 0,
        ffn=cfg.ffn_hidden_size or 0,
        gated_mlp=bool(cfg.gated_linear_unit),
    )
