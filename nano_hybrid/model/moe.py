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

The permutation is also free of host syncs: megatron's dispatcher copies ``tokens_per_expert`` to the
host and sizes the permutation with ``masked_select``, three waits for the device per MoE layer and
micro-batch; here the number of copies is known (``T * topk``), the positions come from a cumulative sum
(``selected_positions``) and ``tokens_per_expert`` stays on the device for the grouped GEMM.

Any other case (expert parallelism, token dropping, TE's fused permutation) uses megatron's code
unchanged. The permuted order is megatron's (expert-major, tokens ascending within an expert), so
``tokens_per_expert`` (on the device instead of the host), probs and expert inputs are identical to
megatron's.

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


def selected_positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of the ``count`` True entries of the 1-D ``mask``, ascending, without a host sync.

    ``masked_select`` / ``nonzero`` size their output from the data and so wait for the device; here the
    count is known (every token has exactly ``topk`` experts). A stable partition does it: with ``sel[i]`` the
    number of True entries up to and including i, True entry i goes to slot ``sel[i] - 1`` and False entry i to
    ``count + i - sel[i]``. The slots are a permutation of ``0..N-1`` (one write each: no atomics, the same result
    in deterministic mode), so the first ``count`` of the scattered indices are the True ones in order. A mask
    with another number of True entries fails a device-side assertion (on CPU at once, on CUDA at the next sync)."""
    torch._assert_async(mask.sum() == count, "MoE routing map: a token does not have exactly topk experts")
    idx = torch.arange(mask.numel(), device=mask.device)
    sel = torch.cumsum(mask, 0)
    slot = torch.where(mask, sel - 1, idx + count - sel)
    return torch.empty_like(idx).scatter_(0, slot, idx)[:count]


class SelectPositions(torch.autograd.Function):
    """src [N] -> src[pos] for ``pos = selected_positions(mask, n)``; backward scatters the gradient back
    under ``mask`` (``masked_scatter``, no atomics): the same values and gradient as ``src.masked_select(mask)``."""

    @staticmethod
    def forward(ctx, src, pos, mask):
        ctx.save_for_backward(mask)
        return src.index_select(0, pos)

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return torch.zeros(mask.shape, dtype=grad.dtype, device=grad.device).masked_scatter(mask, grad), None, None


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
            and not getattr(c, "moe_router_padding_for_quantization", False)
        )

    def dispatch_postprocess(self, hidden_states, probs):
        if not self._fast_ok():
            self._inv = None
            return super().dispatch_postprocess(hidden_states, probs)
        self.hidden_shape_before_permute = hidden_states.shape
        num_tokens, k = hidden_states.shape[0], self.config.moe_router_topk
        self.local_map = self.routing_map
        mask = self.local_map.bool().T.contiguous().view(-1)  # [E * T], expert-major
        pos = selected_positions(mask, num_tokens * k)  # expert-major, tokens ascending (megatron's order)
        sorted_indices = pos % num_tokens
        tokens_per_expert = self.local_map.sum(dim=0).long()  # stays on the device: the grouped GEMM reads it there
        self._inv = torch.argsort(sorted_indices, stable=True).view(num_tokens, k)
        self.reversed_local_input_permutation_mapping = sorted_indices
        permuted = PermuteTopK.apply(hidden_states, sorted_indices, self._inv)
        self.local_probs = SelectPositions.apply(probs.T.contiguous().view(-1), pos, mask)
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
