"""MoE layer with an atomics-free token permutation (used with ``model.moe_experts_impl=grouped``).

Megatron's non-fused ``permute`` / ``unpermute`` (``moe_utils``, used when transformer-engine's fused
permutation is not installed) move tokens with ``index_select`` and ``scatter_add_``: the backward of
the permutation is an ``index_add_`` of bf16 rows with atomics, and the un-permutation a bf16
``scatter_add_``. On one H200 at Nano shapes (16k tokens, top-6, hidden 2688) those two kernels take
3.2 ms of a 27 ms MoE layer (``scripts/check_fast_modules_gpu.py --kinds moe``).

When every token is routed to exactly ``topk`` local experts (the dropless all-gather dispatcher with
all experts on this rank: EP=1, no capacity factor), each token's ``topk`` copies can be found by one
stable argsort of the permutation indices, ``inv`` [T, topk]. Then both directions are gathers plus a
sum over the ``topk`` copies, accumulated in fp32 (megatron accumulates in the token dtype):

    permute      fwd: tokens[sorted_indices]                bwd: sum_j grad[inv[:, j]]
    unpermute    fwd: sum_j expert_out[inv[:, j]]           bwd: grad[sorted_indices]

Any other case (expert parallelism, token dropping, TE's fused permutation) uses megatron's code
unchanged. The permuted order is megatron's (expert-major, tokens ascending within an expert), so
``tokens_per_expert``, probs and expert inputs are identical to megatron's.

Both MoE layers (``GraphReleasingMoELayer`` for megatron's experts, ``TopKPermuteMoELayer`` for the
grouped ones) drop their token dispatcher's references to the forward's autograd graph once the output
is combined (see ``GraphReleasingMoELayer``).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher


def _sum_copies(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j x[inv[t, j]] with an fp32 (or wider) accumulator, in x's dtype."""
    t, k = inv.shape
    acc = torch.promote_types(x.dtype, torch.float32)
    return x.index_select(0, inv.reshape(-1)).view(t, k, x.shape[-1]).sum(1, dtype=acc).to(x.dtype)


class PermuteTopK(torch.autograd.Function):
    """tokens [T, H] -> tokens[sorted_indices] [T*k, H]; backward sums each token's k copies."""

    @staticmethod
    def forward(ctx, tokens, sorted_indices, inv):
        ctx.save_for_backward(inv)
        return tokens.index_select(0, sorted_indices)

    @staticmethod
    def backward(ctx, grad):
        (inv,) = ctx.saved_tensors
        return _sum_copies(grad.contiguous(), inv), None, None


class UnpermuteTopK(torch.autograd.Function):
    """expert outputs [T*k, H] (permuted order) -> [T, H], the sum of each token's k outputs."""

    @staticmethod
    def forward(ctx, permuted, sorted_indices, inv):
        ctx.save_for_backward(sorted_indices)
        return _sum_copies(permuted, inv)

    @staticmethod
    def backward(ctx, grad):
        (sorted_indices,) = ctx.saved_tensors
        return grad.contiguous().index_select(0, sorted_indices), None, None


class TopKAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """``MoEAllGatherTokenDispatcher`` whose local permutation is ``PermuteTopK`` / ``UnpermuteTopK``
    when every token has exactly ``topk`` local copies; megatron's own path otherwise."""

    _inv = None

    def _fast_ok(self) -> bool:
        c = self.config
        return (
            self.num_local_experts == c.num_moe_experts
            and not c.moe_permute_fusion
            and c.moe_expert_capacity_factor is None
            and not getattr(c, "moe_pad_expert_input_to_capacity", False)
        )

    def dispatch_postprocess(self, hidden_states, probs):
        if not self._fast_ok():
            self._inv = None
            return super().dispatch_postprocess(hidden_states, probs)
        self.hidden_shape_before_permute = hidden_states.shape
        num_tokens = hidden_states.shape[0]
        self.local_map = self.routing_map
        local_map_t = self.local_map.bool().T.contiguous()  # [E, T]
        tokens_per_expert = self.local_map.sum(dim=0).long().cpu()
        token_ids = torch.arange(num_tokens, device=hidden_states.device).unsqueeze(0).expand_as(local_map_t)
        sorted_indices = token_ids.masked_select(local_map_t)  # expert-major, tokens ascending (megatron's order)
        k = self.config.moe_router_topk
        if sorted_indices.numel() != num_tokens * k:  # not exactly topk copies per token: megatron's path
            self._inv = None
            self.routing_map = self.local_map
            return super().dispatch_postprocess(hidden_states, probs)
        self._inv = torch.argsort(sorted_indices, stable=True).view(num_tokens, k)
        self.reversed_local_input_permutation_mapping = sorted_indices
        permuted = PermuteTopK.apply(hidden_states, sorted_indices, self._inv)
        self.local_probs = probs.T.contiguous().masked_select(local_map_t)
        self.routing_map = None
        return permuted, tokens_per_expert, self.local_probs

    def combine_preprocess(self, hidden_states):
        inv, self._inv = self._inv, None
        if inv is None:
            return super().combine_preprocess(hidden_states)
        return UnpermuteTopK.apply(hidden_states, self.reversed_local_input_permutation_mapping, inv)


def drop_graph_tensors(obj) -> list[str]:
    """Set every tensor attribute of ``obj`` that belongs to an autograd graph (has a ``grad_fn``) to None;
    returns their names. Parameters and detached tensors stay."""
    names = [k for k, v in vars(obj).items() if isinstance(v, torch.Tensor) and v.grad_fn is not None]
    for k in names:
        setattr(obj, k, None)
    return names


class GraphReleasingMoELayer(MoELayer):
    """megatron's ``MoELayer`` whose token dispatcher keeps no reference to the forward's autograd graph.

    megatron's dispatchers keep the routing probabilities of the last forward on themselves (``local_probs``
    in the all-gather dispatcher, ``probs`` in the all-to-all one) until the next forward replaces them. That
    tensor keeps the step's autograd graph (its nodes, after the backward without their saved activations)
    alive, and with it the gradient-accumulator node of every parameter upstream of the router. Megatron DDP
    registers its gradient hooks on those nodes, as closures that hold the DDP module; PyTorch's garbage
    collector does not traverse the hooks of a node that has other owners, so the cycle DDP -> node -> hook
    -> DDP becomes invisible to it and a model dropped after a training step (with its optimizer and grad
    buffers) is never freed: a tool that builds one model after another in one process runs out of memory.
    The layer drops those tensors as soon as the output is combined (``postprocess``, the last stage of the
    forward, also under activation recompute); nothing after it reads them."""

    def postprocess(self, output, shared_expert_output):
        output = super().postprocess(output, shared_expert_output)
        drop_graph_tensors(self.token_dispatcher)
        return output


class TopKPermuteMoELayer(GraphReleasingMoELayer):
    """``GraphReleasingMoELayer`` whose all-gather dispatcher is ``TopKAllGatherTokenDispatcher`` (same state,
    same checkpoint keys: the dispatcher holds no parameters)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if type(self.token_dispatcher) is MoEAllGatherTokenDispatcher:
            self.token_dispatcher.__class__ = TopKAllGatherTokenDispatcher
