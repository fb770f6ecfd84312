"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` (``model.attention_impl=sdpa``).

A drop-in for megatron's ``DotProductAttention`` as the ``core_attention`` submodule of ``SelfAttention``:
same constructor and ``forward(query, key, value, attention_mask, attn_mask_type=None, ...)``, inputs
``[sq, b, np, hn]`` / ``[sk, b, ng, hn]``, output ``[sq, b, np*hn]``. GQA goes to SDPA's ``enable_gqa``
(no repeated K/V), causal masking to ``is_causal=True``, so on GPU SDPA picks its flash / cuDNN /
memory-efficient kernels and the ``sq x sk`` scores are never materialised.

Mask semantics (as transformer-engine's ``TEDotProductAttention``): with ``attn_mask_type=causal`` the
``attention_mask`` argument is ignored and the causal mask is applied by SDPA; with any other mask type
the boolean megatron mask (True = masked) is passed to SDPA as ``~mask``.

Grouped query without the copy (``GroupedQuerySelfAttention`` + the 5-D input of ``SDPAttention``):
megatron's ``SelfAttention`` splits the fused QKV projection ``[sq, b, ng, (np/ng + 2) * hn]`` into
``query [sq, b, ng, np/ng * hn]`` and ``key``/``value [sq, b, ng, hn]``, then reshapes ``query`` to
``[sq, b, np, hn]``. For GQA (``np/ng > 1``, ``ng > 1`` per rank) that reshape is a strided copy (``ng``
and ``np/ng`` cannot merge: the group stride is ``(np/ng + 2) * hn``, not ``np/ng * hn``), ~161 us per layer
forward on an H200 at Nano dims (32 heads, 2 groups). ``GroupedQuerySelfAttention`` hands ``SDPAttention`` the split query as the view
``[sq, b, ng, np/ng, hn]`` instead; ``SDPAttention`` folds ``(b, ng)`` into SDPA's batch (one K/V head per
batch entry, ``np/ng`` query heads through ``enable_gqa``), which is again a view, so SDPA reads Q, K and V
straight out of the projection output. Head order is megatron's (head ``g * np/ng + j``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import attention as mcore_attention
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide


class SDPAttention(MegatronModule):
    """Causal GQA core attention via ``F.scaled_dot_product_attention`` (see module docstring).

    ``query`` is ``[sq, b, np, hn]`` (megatron's layout) or ``[sq, b, ng, np/ng, hn]`` (the uncopied split
    that ``GroupedQuerySelfAttention`` passes); ``key``/``value`` are ``[sk, b, ng, hn]`` either way.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                f"attention_impl=sdpa does not support context_parallel_size={config.context_parallel_size} (needs 1)")
        if config.apply_query_key_layer_scaling:
            raise ValueError("attention_impl=sdpa does not support apply_query_key_layer_scaling")
        if config.softmax_type != "vanilla":
            raise ValueError(f"attention_impl=sdpa supports softmax_type='vanilla' only, got {config.softmax_type!r}")
        if config.window_size is not None:
            raise ValueError(f"attention_impl=sdpa does not support sliding-window attention (window_size={config.window_size})")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        tp = pg_collection.tp.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        self.softmax_scale = (
            1.0 / math.sqrt(self.hidden_size_per_attention_head) if softmax_scale is None else softmax_scale
        )
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError("attention_impl=sdpa does not support packed sequences (packed_seq_params)")
        if attention_bias is not None:
            raise ValueError("attention_impl=sdpa does not support attention_bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        is_causal = mask_type == AttnMaskType.causal
        attn_mask = None
        if not is_causal and attention_mask is not None:
            attn_mask = ~attention_mask.to(torch.bool)
        if query.dim() == 5 and attn_mask is not None:
            # megatron's explicit mask is [b|1, 1|np, sq, sk] in (batch, head) order; rather than
            # re-laying it out for the folded (b*ng, np/ng) batch, take the 4-D path (the query copy
            # the 5-D form avoids; explicit masks are not on the causal training path)
            query = query.flatten(2, 3)
        if query.dim() == 5:
            # [sq, b, ng, j, hn] (j = np/ng query heads per K/V head): fold (b, ng) into SDPA's batch.
            # These reshapes are views for the split of megatron's fused QKV (stride(b) = ng * stride(ng))
            sq, b, ng, j, hd = query.shape
            q = query.permute(1, 2, 3, 0, 4).reshape(b * ng, j, sq, hd)
            k = key.permute(1, 2, 0, 3).reshape(b * ng, 1, key.size(0), hd)
            v = value.permute(1, 2, 0, 3).reshape(b * ng, 1, value.size(0), hd)
            gqa = j > 1
        else:
            sq, b, _, _ = query.shape
            # [s, b, h, d] -> [b, h, s, d]
            q = query.permute(1, 2, 0, 3)
            k = key.permute(1, 2, 0, 3)
            v = value.permute(1, 2, 0, 3)
            gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = self._sdpa(q, k, v, attn_mask, dropout_p, is_causal, gqa)
        else:
            out = self._sdpa(q, k, v, attn_mask, dropout_p, is_causal, gqa)
        # [b, h, s, d] (or [b*ng, j, s, d], same memory order for the heads) -> [s, b, h*d]. A view
        # when SDPA allocated its output in the query's stride order (cuDNN does), else a copy
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _sdpa(self, q, k, v, attn_mask, dropout_p, is_causal, gqa):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=self.softmax_scale, enable_gqa=gqa,
        )


class GroupedQuerySelfAttention(SelfAttention):
    """megatron's ``SelfAttention`` that passes ``SDPAttention`` the query as the uncopied 5-D split.

    Same parameters, submodules and checkpoint keys as ``SelfAttention`` (it adds no state). Where it is
    safe (``_grouped_query_ok``) ``get_query_key_value_tensors`` returns ``query`` as the view
    ``[sq, b, ng, np/ng, hn]`` of the fused QKV projection instead of megatron's ``[sq, b, np, hn]`` copy;
    everything else in megatron's ``forward`` between the split and ``core_attention`` (inference KV cache,
    THD squeeze, RoPE, output gate) is off in that case, and the selective-recompute path
    (``_checkpointed_attention_forward``) hands ``query`` to ``core_attention`` unchanged. Otherwise (RoPE,
    inference, packed sequences, q/k layernorm, output gate, ``num_query_groups < tp``, ``test_mode``,
    activation offloading of core attention, another core attention, or MHA where megatron's reshape is
    already a view) it is megatron's ``SelfAttention`` unchanged.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        heads_per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        # the per-layer conditions; the per-call ones are checked in forward
        self._grouped_query_layer_ok = (
            isinstance(self.core_attention, SDPAttention)
            and heads_per_group > 1
            and self.config.num_query_groups >= self.world_size
            and not self.config.attention_output_gate
            and not self.config.test_mode
            and not self.offload_core_attention
            and (self.q_layernorm is None or isinstance(self.q_layernorm, IdentityOp))
            and (self.k_layernorm is None or isinstance(self.k_layernorm, IdentityOp))
        )
        # set by forward for the duration of one call: get_query_key_value_tensors does not see
        # forward's arguments (inference context, RoPE, packed sequences)
        self._grouped_query = False

    def _grouped_query_ok(self, key_value_states, inference_context, rotary_pos_emb, packed_seq_params) -> bool:
        # RoPE is applied to the 4-D query by megatron (a 5-D one would broadcast the embedding wrongly);
        # inference rewrites query/key/value through the KV cache; THD squeezes dim 1
        return (
            self._grouped_query_layer_ok
            and key_value_states is None
            and inference_context is None
            and rotary_pos_emb is None
            and packed_seq_params is None
        )

    def forward(
        self,
        hidden_states,
        attention_mask,
        key_value_states=None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ):
        self._grouped_query = self._grouped_query_ok(
            key_value_states, inference_context if inference_context is not None else inference_params,
            rotary_pos_emb, packed_seq_params,
        )
        try:
            return super().forward(
                hidden_states,
                attention_mask,
                key_value_states=key_value_states,
                inference_context=inference_context,
                rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos,
                rotary_pos_sin=rotary_pos_sin,
                rotary_pos_cos_sin=rotary_pos_cos_sin,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
                inference_params=inference_params,
            )
        finally:
            self._grouped_query = False

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        if not (self._grouped_query and split_qkv and not output_gate):
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, output_gate=output_gate, split_qkv=split_qkv
            )
        # megatron's projection and [sq, b, ng, (np/ng + 2) * hn] view, split as megatron splits it
        # (TE's SplitAlongDim when present), without the query reshape
        mixed_qkv, split_arg_list = super().get_query_key_value_tensors(
            hidden_states, key_value_states, output_gate=False, split_qkv=False
        )
        if mcore_attention.SplitAlongDim is not None:
            query, key, value = mcore_attention.SplitAlongDim(mixed_qkv, 3, split_arg_list)
        else:
            query, key, value = torch.split(mixed_qkv, split_arg_list, dim=3)
        # [sq, b, ng, np/ng * hn] -> [sq, b, ng, np/ng, hn]: splits the contiguous last dim, a view
        query = query.view(*query.shape[:3], -1, self.hidden_size_per_attention_head)
        return query, key, value
