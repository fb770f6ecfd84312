"""MoE experts through grouped GEMMs (``model.moe_experts_impl=grouped``).

``GroupedGemmExperts`` replaces megatron's ``SequentialMLP`` (a Python loop over experts) as the
``experts`` submodule of ``MoELayer``; the router (sigmoid + expert bias + top-k scaling), token
dispatcher and shared expert are megatron's, unchanged. Both expert GEMMs of all local experts run as
one ``torch._grouped_mm`` each (bf16 CUTLASS grouped GEMM on Hopper).

CPU: torch 2.13's ``torch._grouped_mm`` has a CPU implementation (fp32 and bf16, forward and backward),
so the same code runs on CPU; the one CPU defect found (its backward rejects a zero-stride incoming
gradient, e.g. from ``y.sum().backward()``) is handled by making the gradient contiguous. There is no
fallback on any device: if ``torch._grouped_mm`` rejects an input, the error propagates.

Parameters: ``weight1`` [E_local, ffn/ETP, hidden] (= the experts' ``linear_fc1.weight`` stacked) and
``weight2`` [E_local, hidden, ffn/ETP] (= ``linear_fc2.weight`` stacked). The distributed-checkpoint
keys and global shapes are the same as ``SequentialMLP``'s (``...experts.experts.linear_fc1.weight`` of
global shape [E, ffn, hidden]), so the two implementations load each other's checkpoints.

Init: on the device from the expert-parallel RNG stream (per-rank), or with ``use_cpu_initialization``
from host masters of all E experts so that expert e's weights do not depend on the EP/ETP layout
(``GroupedGemmExperts._init_layout_invariant``).
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_expert_parallel_rng_tracker_name
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide


def experts_allreduce_with_dense(config) -> bool:
    """The ``allreduce`` attribute expert weights need: True (reduce with the dense params) only when
    the expert grid is the dense one, i.e. EP == 1 and ETP == TP (CP is 1 here).

    Megatron's expert linears use ``allreduce = not (is_expert and EP > 1)`` (layers.py:886, :1209),
    which is wrong for TP > 1 with ETP = 1 and EP = 1 (``parallel=tp2``): the TP ranks then hold whole,
    identical experts but, under sequence parallelism, route *different* tokens (their sequence
    shards) through them, so expert grads must be summed over the TP ranks (= the expert-data-parallel
    group). With allreduce=True DDP reduces them over the dense DP group only (size 1 for tp2): each TP
    rank applied the gradient of its half of the tokens, the replicas drifted apart, and the grad
    norm counted the experts once per TP rank (they carry tensor_model_parallel=True). allreduce=False
    sends them to the expert-DP group (sum over TP ranks) and megatron's expert optimizer, whose grad
    norm is reduced over ETP x EP x PP (counted once).
    """
    return config.expert_model_parallel_size == 1 and (
        (config.expert_tensor_parallel_size or config.tensor_model_parallel_size) == config.tensor_model_parallel_size)


def mark_expert_params(model: torch.nn.Module) -> int:
    """Apply ``experts_allreduce_with_dense`` to megatron's own expert linears (``SequentialMLP``'s
    ``is_expert`` Column/RowParallelLinear, ``moe_experts_impl=sequential``); returns how many params
    were marked. ``GroupedGemmExperts`` sets it itself."""
    n = 0
    for mod in model.modules():
        if getattr(mod, "is_expert", False) and hasattr(mod, "config"):
            dense = experts_allreduce_with_dense(mod.config)
            for p in mod.parameters(recurse=False):
                setattr(p, "allreduce", dense)
                n += 1
    return n


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    ``torch._grouped_mm``'s CPU backward (torch 2.13) raises "Invalid strides/sizes, got [0, 0]" for
    an expanded (zero-stride) gradient; this is a no-op when the gradient is already contiguous.
    """

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _act_scale_eager(h: torch.Tensor, probs: torch.Tensor, act) -> torch.Tensor:
    return (act(h) * probs.unsqueeze(-1)).to(h.dtype)


# activation function -> its compiled act_scale (None once compiling it has failed)
_ACT_SCALE: dict = {}


def act_scale(h: torch.Tensor, probs: torch.Tensor, act) -> torch.Tensor:
    """``act(h) * probs[:, None]`` in h's dtype (the routing weights applied to the expert activations).

    probs are fp32 (``moe_router_dtype=fp32``), so the eager expression writes an fp32 copy of the
    [tokens*topk, ffn] activations and reads it back to round it: about 2.5 ms of the 27 ms MoE layer at
    Nano shapes on an H200. On CUDA the same expression runs as one ``torch.compile`` kernel forward and
    one backward (fp32 math in registers, same rounding as eager). If compiling fails the eager
    expression is used, with one warning."""
    if not h.is_cuda:
        return _act_scale_eager(h, probs, act)
    if act not in _ACT_SCALE:
        _ACT_SCALE[act] = torch.compile(functools.partial(_act_scale_eager, act=act), dynamic=True)
    fn = _ACT_SCALE[act]
    if fn is None:  # compiling failed before
        return _act_scale_eager(h, probs, act)
    try:
        return fn(h, probs)
    except Exception as e:  # noqa: BLE001 - an optimisation only: fall back to the same math, say so once
        warnings.warn(f"nano_hybrid MoE: torch.compile of the expert activation failed ({type(e).__name__}: "
                      f"{str(e)[:200]}); using the eager expression", stacklevel=2)
        _ACT_SCALE[act] = None
        return _act_scale_eager(h, probs, act)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out[rows of group g] = x[rows of group g] @ w[g].T for w [G, N, K]; ``offs`` = int32 end offsets."""
    return _ContiguousGrad.apply(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))


class GroupedGemmExperts(MegatronModule):
    """All local experts of one MoE layer as two grouped GEMMs; ``SequentialMLP``'s interface.

    ``forward(permuted_local_hidden_states [T, hidden], tokens_per_expert [E_local], permuted_probs [T])
    -> (output [T, hidden], None)``; rows are grouped by expert in order, as megatron's dispatchers
    produce them. Non-gated activations only (Nemotron-3 uses squared ReLU), no expert bias.
    """

    def __init__(
        self,
        num_local_experts: int,
        config,
        submodules=None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        if config.gated_linear_unit:
            raise ValueError("moe_experts_impl=grouped supports non-gated experts only; use model.moe_experts_impl=sequential")
        if config.add_bias_linear:
            raise ValueError("moe_experts_impl=grouped has no expert bias; set add_bias_linear=False")
        if config.fp8 or config.fp4:
            raise ValueError("moe_experts_impl=grouped does not support fp8/fp4")
        if pg_collection is None:
            raise ValueError("GroupedGemmExperts needs pg_collection (built by MoELayer)")
        self.num_local_experts = num_local_experts
        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp
        self.activation_func = config.activation_func
        hidden = config.hidden_size
        ffn = config.moe_ffn_hidden_size
        self.ffn_local = divide(ffn, self.tp_group.size())
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight1 = torch.nn.Parameter(
            torch.empty(num_local_experts, self.ffn_local, hidden, device=device, dtype=config.params_dtype))
        self.weight2 = torch.nn.Parameter(
            torch.empty(num_local_experts, hidden, self.ffn_local, device=device, dtype=config.params_dtype))
        if config.perform_initialization:
            if config.use_cpu_initialization:
                self._init_layout_invariant(config)
            else:
                # per-expert init under the expert-parallel RNG stream, like megatron's expert linears
                with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                    for e in range(num_local_experts):
                        config.init_method(self.weight1.data[e])
                        config.output_layer_init_method(self.weight2.data[e])
        # allreduce=False makes DDP reduce expert grads over the expert-data-parallel group (and puts
        # them in megatron's expert optimizer); see experts_allreduce_with_dense() for when that is
        # needed. The TP attributes mark the ffn axis as split over the expert-tensor-parallel group.
        dense = experts_allreduce_with_dense(config)
        for w, dim in ((self.weight1, 1), (self.weight2, 2)):
            setattr(w, "allreduce", dense)
            set_tensor_model_parallel_attributes(w, is_parallel=True, dim=dim, stride=1)

    @torch.no_grad()
    def _init_layout_invariant(self, config) -> None:
        """Host init that does not depend on the EP/ETP layout (``use_cpu_initialization``).

        As megatron's ``_initialize_affine_weight_cpu``: for every *global* expert e = 0..E-1 in order,
        a full fp32 master fc1 [ffn, hidden] (``init_method``) and fc2 [hidden, ffn]
        (``output_layer_init_method``) are drawn from the global torch CPU generator (seeded from
        ``cfg.seed`` identically on every rank); this rank keeps experts ``ep_rank * E_local + i`` and
        their ffn slice ``etp_rank`` of ``ETP``. Every rank draws all E masters, so the generator is in
        the same state afterwards whatever the layout, and expert e's weights equal the EP=1 model's.
        """
        ep_size, ep_rank = self.ep_group.size(), self.ep_group.rank()
        tp_size, tp_rank = self.tp_group.size(), self.tp_group.rank()
        first = ep_rank * self.num_local_experts
        hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
        for e in range(self.num_local_experts * ep_size):
            m1 = torch.empty(ffn, hidden, dtype=torch.float32)
            config.init_method(m1)
            m2 = torch.empty(hidden, ffn, dtype=torch.float32)
            config.output_layer_init_method(m2)
            if first <= e < first + self.num_local_experts:
                self.weight1.data[e - first].copy_(torch.chunk(m1, tp_size, dim=0)[tp_rank])
                self.weight2.data[e - first].copy_(torch.chunk(m2, tp_size, dim=1)[tp_rank])

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x = permuted_local_hidden_states
        probs = permuted_probs
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise ValueError("moe_apply_probs_on_input needs moe_router_topk=1")
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        if x.shape[0] == 0:
            # no token routed here: keep every weight in the graph so gradients (zeros) exist
            zero = (self.weight1.sum() + self.weight2.sum()) * 0.0
            return x.new_zeros(0, self.config.hidden_size) + zero.to(x.dtype), None
        offs = torch.cumsum(tokens_per_expert.to(device=x.device), dim=0).to(torch.int32)
        h = self._mm(x, self.weight1, offs)
        h = act_scale(h, probs, self.activation_func)
        out = self._mm(h, self.weight2, offs)
        return out, None

    def _mm(self, x, w, offs):
        """One expert GEMM (``model/fp8.py`` swaps it for torchao's fp8 grouped GEMM)."""
        return grouped_mm(x, w, offs)

    def backward_dw(self):
        """Nothing deferred: weight gradients are computed in the normal backward."""
        return None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Same keys and global shapes as ``SequentialMLP`` (experts stacked on an expert axis)."""
        ep_size, ep_rank = self.ep_group.size(), self.ep_group.rank()
        tp_size, tp_rank = self.tp_group.size(), self.tp_group.rank()
        n_pre = len(sharded_offsets)
        replica_id = (0, 0, self.dp_group.rank())
        out = {}
        # fc1 weight [E, ffn, hidden]: ffn is TP-split (column parallel); fc2 [E, hidden, ffn]: row parallel
        for name, w, tp_axis in (("linear_fc1", self.weight1, 1), ("linear_fc2", self.weight2, 2)):
            key = f"{prefix}experts.{name}.weight"
            out[f"{prefix}{'weight1' if name == 'linear_fc1' else 'weight2'}"] = ShardedTensor.from_rank_offsets(
                key, w, *sharded_offsets,
                (n_pre + 0, ep_rank, ep_size),
                (n_pre + tp_axis, tp_rank, tp_size),
                replica_id=replica_id, prepend_axis_num=n_pre,
            )
        return out


def copy_grouped_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Copy every weight of model ``src`` into model ``dst`` of the same config, mapping grouped expert
    tensors (``...experts.weight1`` / ``weight2`` [E, ...]) to megatron ``SequentialMLP`` experts
    (``...experts.local_experts.<e>.linear_fc1.weight`` / ``linear_fc2.weight``) where ``dst`` has
    those: the fast modules and the reference modules then compute with the same weights. A ``dst``
    weight with no counterpart in ``src`` raises KeyError."""
    s_sd = src.state_dict()
    with torch.no_grad():
        for name, t in dst.state_dict().items():
            if name.endswith("_extra_state"):
                continue
            if "local_experts." in name:
                pre, rest = name.split("local_experts.")
                e, lin = rest.split(".", 1)
                t.copy_(s_sd[pre + ("weight1" if lin.startswith("linear_fc1") else "weight2")][int(e)])
            elif name in s_sd:
                t.copy_(s_sd[name])
            else:
                raise KeyError(name)
