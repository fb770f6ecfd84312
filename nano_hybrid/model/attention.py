"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` (``model.attention_impl=sdpa``).

A drop-in for megatron's ``DotProductAttention`` as the ``core_attention`` submodule of ``SelfAttention``:
same constructor and ``forward(query, key, value, attention_mask, attn_mask_type=None, ...)``, inputs
``[sq, b, np, hn]`` / ``[sk, b, ng, hn]``, output ``[sq, b, np*hn]``. GQA goes to SDPA's ``enable_gqa``
(no repeated K/V), causal masking to ``is_causal=True``, so on GPU SDPA picks its flash / cuDNN /
memory-efficient kernels and the ``sq x sk`` scores are never materialised.

Mask semantics (as transformer-engine's ``TEDotProductAttention``): with ``attn_mask_type=causal`` the
``attention_mask`` argument is ignored and the causal mask is applied by SDPA; with any other mask type
the boolean megatron mask (True = masked) is passed to SDPA as ``~mask``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide


class SDPAttention(MegatronModule):
    """Causal GQA core attention via ``F.scaled_dot_product_attention`` (see module docstring)."""

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
        sq, b, nh, hd = query.shape
        # [s, b, h, d] -> [b, h, s, d]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        is_causal = mask_type == AttnMaskType.causal
        attn_mask = None
        if not is_causal and attention_mask is not None:
            attn_mask = ~attention_mask.to(torch.bool)
        gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = self._sdpa(q, k, v, attn_mask, dropout_p, is_causal, gqa)
        else:
            out = self._sdpa(q, k, v, attn_mask, dropout_p, is_causal, gqa)
        # [b, h, s, d] -> [s, b, h*d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _sdpa(self, q, k, v, attn_mask, dropout_p, is_causal, gqa):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=self.softmax_scale, enable_gqa=gqa,
        )
