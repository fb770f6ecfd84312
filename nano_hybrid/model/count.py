"""Parameter counts from a built model (works on the meta device)."""

from __future__ import annotations

import torch

ACTIVE_DEFINITION = (
    "active_params = parameters one token passes through: every non-expert parameter, the LM head and "
    "router, the shared expert, and top-k of the routed experts (k/num_experts of each MoE layer's routed "
    "expert weights), excluding the input embedding table (the paper's '3.2B active'); "
    "active_params_incl_embedding adds the input embedding (the paper's '3.6B incl. embeddings')."
)


def _routed_expert_modules(model: torch.nn.Module):
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP, GroupedMLP
    from nano_hybrid.model.experts import GroupedGemmExperts

    kinds = (SequentialMLP, TEGroupedMLP, GroupedMLP, GroupedGemmExperts)
    return [m for m in model.modules() if isinstance(m, kinds)]


def count_params(model: torch.nn.Module) -> dict:
    """``total_params``, ``active_params`` (excl. input embedding), ``active_params_incl_embedding``,
    plus a breakdown; counted from the modules' parameters (local shard on this rank)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    cfg = model.config
    inactive = 0
    routed = 0
    for mod in _routed_expert_modules(model):
        n = sum(p.numel() for p in mod.parameters())
        routed += n
        k, e = cfg.moe_router_topk, cfg.num_moe_experts
        # local experts hold num_local/num_experts of the layer's experts; per-token share is k/E
        inactive += n - n * k / e
    emb = 0
    if hasattr(model, "embedding"):
        emb = model.embedding.word_embeddings.weight.numel()
    out_layer = 0
    if getattr(model, "output_layer", None) is not None and model.output_layer.weight is not None:
        out_layer = model.output_layer.weight.numel()
    active_incl = total - inactive
    return {
        "total_params": int(total),
        "active_params": int(round(active_incl - emb)),
        "active_params_incl_embedding": int(round(active_incl)),
        "routed_expert_params": int(routed),
        "embedding_params": int(emb),
        "output_layer_params": int(out_layer),
        "active_definition": ACTIVE_DEFINITION,
    }
