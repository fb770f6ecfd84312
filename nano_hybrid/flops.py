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

The shape is a :class:`nano_hybrid.arch.HybridArch` (``HybridArch.from_megatron(model)`` in training,
``HybridArch.from_model_cfg(cfg.model)`` without a model); the sequence length is the run's.
"""

from __future__ import annotations

from nano_hybrid.arch import HybridArch


def mamba_layer_flops(a: HybridArch, seq_length: int) -> float:
    H, P, N, G = a.mamba_num_heads, a.mamba_head_dim, a.mamba_state_dim, a.mamba_num_groups
    d_inner = H * P
    in_proj = 2 * a.hidden_size * (2 * d_inner + 2 * G * N + H)
    conv = 2 * (d_inner + 2 * G * N) * a.mamba_conv_width
    ssd = 2 * G * a.mamba_chunk_size * N + 2 * H * a.mamba_chunk_size * P + 4 * H * N * P
    out_proj = 2 * d_inner * a.hidden_size
    return float(in_proj + conv + ssd + out_proj)


def attention_layer_flops(a: HybridArch, seq_length: int) -> float:
    n, g, d = a.num_attention_heads, a.num_query_groups, a.kv_channels
    qkv = 2 * a.hidden_size * d * (n + 2 * g)
    core = 2 * n * d * (seq_length + 1)
    out = 2 * n * d * a.hidden_size
    return float(qkv + core + out)


def moe_layer_flops(a: HybridArch, seq_length: int) -> float:
    mult = 1.5 if a.gated_linear_unit else 1.0
    router = 2 * a.hidden_size * a.num_moe_experts
    routed = a.moe_router_topk * 4 * a.hidden_size * a.moe_ffn_hidden_size * mult
    shared = 4 * a.hidden_size * a.moe_shared_expert_intermediate_size * mult
    return float(router + routed + shared)


def mlp_layer_flops(a: HybridArch, seq_length: int) -> float:
    return float(4 * a.hidden_size * a.ffn_hidden_size * (1.5 if a.gated_linear_unit else 1.0))


LAYER_FLOPS = {"M": mamba_layer_flops, "*": attention_layer_flops, "E": moe_layer_flops, "-": mlp_layer_flops}


def forward_flops_per_token(a: HybridArch, seq_length: int) -> float:
    """Forward model FLOPs per token of architecture ``a`` at sequence length ``seq_length``."""
    pattern = a.hybrid_override_pattern
    unknown = sorted(set(pattern) - set(LAYER_FLOPS))
    if unknown:
        raise ValueError(f"hybrid pattern {pattern!r} has layer symbols without a FLOPs formula: {unknown}")
    per_kind = {sym: fn(a, seq_length) for sym, fn in LAYER_FLOPS.items() if sym in pattern}
    return sum(per_kind[sym] for sym in pattern) + 2.0 * a.hidden_size * a.padded_vocab_size


def training_flops_per_token(a: HybridArch, seq_length: int) -> float:
    """Forward + backward model FLOPs per token (3 x forward)."""
    return 3.0 * forward_flops_per_token(a, seq_length)
