"""Local (non-transformer-engine) layer specs for the hybrid stack: M (Mamba-2), E (MoE), * (attention), - (MLP).

Layer structure is megatron-core's (``MambaLayer``, ``TransformerLayer`` + ``SelfAttention``,
``MoETransformerLayer`` + ``MoELayer``, ``MLPLayer``); the differences from megatron's TE spec are:

- norms are ``mcore_compat.TorchRMSNorm`` modules in the layers' ``norm``/``input_layernorm``/
  ``pre_mlp_layernorm`` slots (TE fuses them into the following linear). ``sharded_state_dict_keys_map``
  renames them to the TE-spec names (``mixer.in_proj.layer_norm_``, ...), so dist checkpoints use the
  same keys as megatron's TE spec;
- the Mamba mixer is ``BackendMambaMixer`` with the kernel backend passed as a spec param;
- the Mamba layer is ``RecomputeMambaLayer`` and the stack ``HybridStack`` (``model/recompute.py``):
  megatron's ``MambaLayer`` / ``MambaStack`` plus activation recompute (``model.recompute``);
- core attention is ``SDPAttention`` (``attention_impl=sdpa``) inside ``GroupedQuerySelfAttention`` (a
  ``SelfAttention`` that hands it the GQA query without megatron's reshape copy) or megatron's
  ``DotProductAttention`` (``unfused``) inside megatron's ``SelfAttention``; experts are
  ``GroupedGemmExperts`` (``moe_experts_impl=grouped``) or megatron's ``SequentialMLP`` (``sequential``).
"""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.ssm.mamba_block import MambaStackSubmodules
from megatron.core.ssm.mamba_layer import MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from nano_hybrid import mcore_compat
from nano_hybrid.model.attention import GroupedQuerySelfAttention, SDPAttention
from nano_hybrid.model.config import ATTENTION_IMPLS, MOE_EXPERTS_IMPLS
from nano_hybrid.model.experts import GroupedGemmExperts
from nano_hybrid.model.mixer import BackendMambaMixer
from nano_hybrid.model.moe import GraphReleasingMoELayer, TopKPermuteMoELayer
from nano_hybrid.model.recompute import HybridStack, RecomputeMambaLayer, recompute_settings

CORE_ATTENTION = {"sdpa": SDPAttention, "unfused": DotProductAttention}
# the self-attention module around each core attention: the grouped-query one needs SDPAttention's 5-D input
SELF_ATTENTION = {"sdpa": GroupedQuerySelfAttention, "unfused": SelfAttention}


def moe_spec(num_experts: int, experts_impl: str) -> ModuleSpec:
    """MoE layer spec: megatron's router/dispatcher/shared expert; experts by ``experts_impl``."""
    if experts_impl not in MOE_EXPERTS_IMPLS:
        raise ValueError(f"moe_experts_impl={experts_impl!r}; choose one of {', '.join(MOE_EXPERTS_IMPLS)}")
    spec = get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=False)
    # megatron's MoELayer, minus the dispatcher's hold on the last forward's autograd graph (model/moe.py)
    spec.module = GraphReleasingMoELayer
    if experts_impl == "grouped":
        # production path: grouped-GEMM experts and the atomics-free token permutation (model/moe.py)
        spec.module = TopKPermuteMoELayer
        spec.submodules.experts = ModuleSpec(module=GroupedGemmExperts)
    return spec


def hybrid_stack_spec(
    backend,
    *,
    attention_impl: str,
    moe_experts_impl: str,
    num_experts: int | None,
    mamba_chunk_size: int,
    mamba_conv_width: int,
    recompute: str,
    recompute_modules: tuple[str, ...],
    mamba_fused_norm: bool = False,
) -> ModuleSpec:
    """The stack spec for ``MambaModel`` with the given kernel backend and attention/expert modules.

    ``recompute`` / ``recompute_modules`` (see ``nano_hybrid.model.recompute``): the parts megatron's
    layers do not recompute themselves (full-layer recompute in the stack, the Mamba layer's norm, the
    mixer's SSD) are set here; the megatron parts come from the TransformerConfig. ``mamba_fused_norm``: the mixer
    passes its gated norm's weight to the fused op (``BackendMambaMixer``).
    """
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={attention_impl!r}; choose one of {', '.join(ATTENTION_IMPLS)}")
    recompute, recompute_modules = recompute_settings({"recompute": recompute, "recompute_modules": list(recompute_modules)})
    norm = mcore_compat.TorchRMSNorm
    mamba_layer = ModuleSpec(
        module=RecomputeMambaLayer,
        params={"recompute_norm": "layernorm" in recompute_modules},
        submodules=MambaLayerSubmodules(
            norm=norm,
            mixer=ModuleSpec(
                module=BackendMambaMixer,
                params={"backend": backend, "chunk_size": mamba_chunk_size, "d_conv": mamba_conv_width,
                        "recompute_ssd": "ssd" in recompute_modules, "fused_norm": mamba_fused_norm},
                submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
            ),
            mamba_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"},
        ),
    )
    attention_layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SELF_ATTENTION[attention_impl],
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=CORE_ATTENTION[attention_impl],
                    linear_proj=RowParallelLinear,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"},
        ),
    )
    mlp_layer = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
        ),
    )
    moe_layer = ModuleSpec(
        module=MoETransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm,
            mlp=moe_spec(num_experts or 1, moe_experts_impl),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    return ModuleSpec(
        module=HybridStack,
        params={"recompute_full": recompute == "full"},
        submodules=MambaStackSubmodules(
            mamba_layer=mamba_layer, attention_layer=attention_layer, mlp_layer=mlp_layer, moe_layer=moe_layer
        ),
    )
