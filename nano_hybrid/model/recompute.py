"""Activation recompute for the hybrid stack (``model.recompute`` / ``model.recompute_modules``).

megatron-core 0.16.1's ``MambaStack`` has no activation recompute of its own: its layers keep every
activation their backward needs. This module adds the three choices megatron's ``TransformerBlock``
offers, built from megatron's own checkpoint functions so the RNG streams are restored as megatron
restores them (``tensor_parallel.checkpoint`` saves and resets the CPU, device and tracker RNG
states; ``CheckpointWithoutOutput`` likewise):

- ``none``: nothing is recomputed.
- ``full``: every layer of the stack is one ``tensor_parallel.checkpoint`` region; only each layer's
  input ``[s, b, h]`` is kept and the layer is re-run in backward (megatron's
  ``recompute_granularity=full, recompute_method=uniform, recompute_num_layers=1``).
- ``selective``: the modules in ``model.recompute_modules`` are recomputed:

  ============== ============================================================================
  module         what is recomputed (and by whom)
  ============== ============================================================================
  layernorm      every pre-norm: attention ``input_layernorm`` and MoE/MLP ``pre_mlp_layernorm``
                 (megatron's ``TransformerLayer``, ``CheckpointWithoutOutput``) and the Mamba
                 layer's ``norm`` (``RecomputeMambaLayer`` here, same mechanism): the norm output
                 is freed after the following projection and rebuilt in backward
  moe            the whole MoE block: router, token dispatch, experts, shared expert
                 (megatron's ``MoELayer``)
  shared_experts the shared expert only (megatron's ``MoELayer``)
  core_attn      the core attention (megatron's ``Attention``)
  mlp            dense ``-`` MLP layers (megatron's ``TransformerLayer``)
  ssd            the Mamba mixer between ``in_proj`` and ``out_proj``: causal conv1d, SSD scan,
                 gating and the gated RMSNorm (``BackendMambaMixer``); only ``zxBCdt`` is kept
  ============== ============================================================================

The megatron names go to ``TransformerConfig.recompute_granularity='selective'`` /
``recompute_modules``; ``ssd`` and the Mamba ``layernorm`` are handled by the layer spec
(``nano_hybrid.model.specs``). ``full`` is handled by ``HybridStack`` and is not passed to megatron
(``TransformerConfig``'s ``full`` acts in ``TransformerBlock`` only).
"""

from __future__ import annotations

import functools
import torch
from megatron.core import tensor_parallel
from megatron.core.ssm.mamba_layer import MambaLayer
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import WrappedTensor, make_viewless_tensor

from nano_hybrid import mcore_compat
from nano_hybrid.model.config import (
    RECOMPUTE_CHOICES,
    RECOMPUTE_MODULES,
    megatron_recompute_kwargs,
    recompute_settings,
)

__all__ = ["HybridStack", "RecomputeMambaLayer", "megatron_recompute_kwargs", "recompute_settings",
           "RECOMPUTE_CHOICES", "RECOMPUTE_MODULES"]


def _recompute_active(module: torch.nn.Module) -> bool:
    return module.training and torch.is_grad_enabled()


class RecomputeMambaLayer(MambaLayer):
    """megatron's ``MambaLayer``; with ``recompute_norm`` its pre-norm output is freed after ``in_proj``
    has consumed it and recomputed in backward (megatron's ``CheckpointWithoutOutput``, as
    ``TransformerLayer`` does for its norms). Same parameters and checkpoint keys as ``MambaLayer``."""

    def __init__(self, *args, recompute_norm: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.recompute_norm = recompute_norm

    def forward(self, hidden_states, attention_mask=None, inference_context=None, rotary_pos_emb=None, *,
                inference_params=None, packed_seq_params=None):
        if not (self.recompute_norm and _recompute_active(self) and inference_context is None
                and inference_params is None):
            return super().forward(hidden_states, attention_mask, inference_context, rotary_pos_emb,
                                   inference_params=inference_params, packed_seq_params=packed_seq_params)
        # megatron's MambaLayer.forward with the norm under CheckpointWithoutOutput
        residual = hidden_states
        if self.residual_in_fp32:
            residual = residual.to(torch.float32)
        hidden_states = hidden_states.to(dtype=self.config.params_dtype)
        norm_ckpt = tensor_parallel.CheckpointWithoutOutput()
        normed = norm_ckpt.checkpoint(self.norm, hidden_states)
        mixer_out_with_bias = self.mixer(normed, inference_context=None, packed_seq_params=packed_seq_params)
        # in_proj saved `normed` for its weight gradient: free it now; the hook on the mixer output's
        # gradient (computed before in_proj's backward) rebuilds it
        norm_ckpt.discard_output_and_register_recompute(mixer_out_with_bias[0])
        with self.bias_dropout_add_exec_handler():
            return self.mamba_bda(training=self.training, fused=self.config.bias_dropout_fusion)(
                mixer_out_with_bias, residual, self.hidden_dropout
            )


def _run_layer(layer, hidden_states, attention_mask, *, rotary_pos_emb, packed_seq_params, padding_mask):
    if isinstance(layer, TransformerLayer):
        out, _ = layer(hidden_states=hidden_states, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                       packed_seq_params=packed_seq_params, padding_mask=padding_mask)
        return out
    out = layer(hidden_states=hidden_states, attention_mask=attention_mask, packed_seq_params=packed_seq_params)
    return out[0] if isinstance(out, tuple) else out


class HybridStack(mcore_compat.local_norm_mamba_stack_class()):
    """The hybrid ``MambaStack`` (torch final norm, see ``mcore_compat``) with ``recompute_full``: in
    training, each layer runs inside ``tensor_parallel.checkpoint`` (only its input is kept). Inference
    and ``recompute_full=False`` run megatron's ``MambaStack.forward`` unchanged."""

    def __init__(self, config, submodules, *args, recompute_full: bool = False, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.recompute_full = recompute_full

    def forward(self, hidden_states, attention_mask, inference_context=None, rotary_pos_emb=None, *,
                inference_params=None, packed_seq_params=None, padding_mask=None):
        if not (self.recompute_full and _recompute_active(self) and inference_context is None
                and inference_params is None):
            return super().forward(hidden_states, attention_mask, inference_context, rotary_pos_emb,
                                   inference_params=inference_params, packed_seq_params=packed_seq_params,
                                   padding_mask=padding_mask)
        if self.config.fp8 or self.config.fp4:
            raise NotImplementedError("model.recompute=full is not implemented for fp8/fp4 training")
        if not self.pre_process:
            hidden_states = self.input_tensor  # set by the pipeline schedule (set_input_tensor)
        if isinstance(hidden_states, WrappedTensor):
            hidden_states = hidden_states.unwrap()
        for layer in self.layers:
            fn = functools.partial(_run_layer, layer, rotary_pos_emb=rotary_pos_emb,
                                   packed_seq_params=packed_seq_params, padding_mask=padding_mask)
            hidden_states = tensor_parallel.checkpoint(fn, False, hidden_states, attention_mask)
        if self.post_process and self.post_layer_norm:
            hidden_states = self.final_norm(hidden_states)
        return make_viewless_tensor(inp=hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True)
