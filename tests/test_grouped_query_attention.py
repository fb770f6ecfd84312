"""GroupedQuerySelfAttention + SDPAttention's 5-D query: the GQA query without megatron's reshape copy.

CPU fp32, small shapes. The 5-D path is the same math as megatron's ``[sq, b, np, hn]`` path in another
batch/head folding, so outputs and gradients must agree to float rounding:

- SDPAttention with the split query viewed as ``[sq, b, ng, np/ng, hn]`` vs reshaped (copied) to
  ``[sq, b, np, hn]``: output and the gradient of the fused QKV tensor (GQA and MHA, causal; explicit
  padding mask, which falls back to the 4-D layout); SDPA reads the query straight out of the fused
  tensor; dropout runs in the model-parallel RNG stream;
- a whole GroupedQuerySelfAttention vs megatron's SelfAttention with the same weights: output, input and
  weight gradients, state-dict and sharded-state-dict keys; the layer takes the 5-D path exactly when
  it is safe (not with RoPE, q/k layernorm or MHA) and matches megatron either way;
- the sdpa spec builds GroupedQuerySelfAttention, the unfused spec megatron's SelfAttention.
"""

from __future__ import annotations

import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.tensor_parallel import random as tpr  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402

from nano_hybrid import mcore_compat  # noqa: E402
from nano_hybrid.config import compose  # noqa: E402
from nano_hybrid.model import build_model  # noqa: E402
from nano_hybrid.model.attention import GroupedQuerySelfAttention, SDPAttention  # noqa: E402

TOL = dict(rtol=1e-6, atol=1e-6)
HN = 16


def _cfg(heads=8, groups=2, **kw):
    base = dict(
        num_layers=1, hidden_size=64, num_attention_heads=heads, num_query_groups=groups, kv_channels=HN,
        add_bias_linear=False, use_cpu_initialization=True, bias_dropout_fusion=False,
        masked_softmax_fusion=False, normalization="RMSNorm", attention_dropout=0.0, hidden_dropout=0.0,
    )
    base.update(kw)
    return TransformerConfig(**base)


def _spy_sdpa(attn: SDPAttention) -> list:
    """Record the (q, k, v) that ``attn`` hands to SDPA."""
    seen = []
    inner = attn._sdpa

    def spy(q, k, v, *rest):
        seen.append((q, k, v))
        return inner(q, k, v, *rest)

    attn._sdpa = spy
    return seen


# ------------------------------------------------------------------ SDPAttention, 5-D vs 4-D query
def _core_run(attn, mixed, go, groups, j, five, mask=None):
    """Split a fused [s, b, ng, (j+2)*hn] QKV tensor as megatron does; query 5-D view or 4-D copy."""
    s, b = mixed.shape[:2]
    m = mixed.clone().requires_grad_()
    q, k, v = torch.split(m, [j * HN, HN, HN], dim=3)
    q = q.view(s, b, groups, j, HN) if five else q.reshape(s, b, groups * j, HN)
    out = attn(q, k, v, mask)
    out.backward(go)
    return out.detach(), m.grad, m


@pytest.mark.parametrize("heads,groups", [(8, 2), (8, 1), (4, 4)])
def test_sdpa_5d_query_matches_4d(mp, heads, groups):
    attn = SDPAttention(_cfg(heads, groups), 1, AttnMaskType.causal, "self",
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"]))
    seen = _spy_sdpa(attn)
    s, b, j = 23, 3, heads // groups
    g = torch.Generator().manual_seed(0)
    mixed = torch.randn(s, b, groups, (j + 2) * HN, generator=g)
    go = torch.randn(s, b, heads * HN, generator=g)
    out4, grad4, m4 = _core_run(attn, mixed, go, groups, j, five=False)
    out5, grad5, m5 = _core_run(attn, mixed, go, groups, j, five=True)
    assert out5.shape == (s, b, heads * HN)
    torch.testing.assert_close(out5, out4, **TOL)
    torch.testing.assert_close(grad5, grad4, **TOL)
    # the 5-D query reaches SDPA as a view of the fused tensor (b*ng batch, j heads, one K/V head)
    q4, q5 = seen[0][0], seen[1][0]
    assert q5.shape == (b * groups, j, s, HN) and seen[1][1].shape == (b * groups, 1, s, HN)
    assert q5.untyped_storage().data_ptr() == m5.untyped_storage().data_ptr()
    if j > 1 and groups > 1:  # megatron's 4-D query is the strided copy this path removes
        assert q4.untyped_storage().data_ptr() != m4.untyped_storage().data_ptr()


def test_sdpa_5d_query_with_explicit_mask_matches_4d(mp):
    """A non-causal mask type with an explicit mask: the 5-D query falls back to the 4-D layout."""
    attn = SDPAttention(_cfg(), 1, AttnMaskType.padding, "self",
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"]))
    s, b, groups, j = 19, 2, 2, 4
    g = torch.Generator().manual_seed(1)
    mixed = torch.randn(s, b, groups, (j + 2) * HN, generator=g)
    go = torch.randn(s, b, groups * j * HN, generator=g)
    mask = torch.rand(b, 1, s, s, generator=g) < 0.3
    mask[..., 0] = False  # every row keeps at least one key
    out4, grad4, _ = _core_run(attn, mixed, go, groups, j, five=False, mask=mask)
    out5, grad5, _ = _core_run(attn, mixed, go, groups, j, five=True, mask=mask)
    torch.testing.assert_close(out5, out4, **TOL)
    torch.testing.assert_close(grad5, grad4, **TOL)
    # and the mask is honoured (not silently dropped): causal output differs
    causal = SDPAttention(_cfg(), 1, AttnMaskType.causal, "self")
    out_c, _, _ = _core_run(causal, mixed, go, groups, j, five=True)
    assert not torch.allclose(out_c, out5, atol=1e-3)


def test_sdpa_5d_query_dropout_in_model_parallel_stream(mp):
    attn = SDPAttention(_cfg(attention_dropout=0.3), 1, AttnMaskType.causal, "self")
    attn.train()
    s, b, groups, j = 17, 2, 2, 4
    g = torch.Generator().manual_seed(2)
    mixed = torch.randn(s, b, groups, (j + 2) * HN, generator=g)
    go = torch.randn(s, b, groups * j * HN, generator=g)
    tracker = tpr.get_cuda_rng_tracker()
    states = tracker.get_states()
    default_state = torch.get_rng_state()
    out_a, grad_a, _ = _core_run(attn, mixed, go, groups, j, five=True)
    assert torch.equal(torch.get_rng_state(), default_state)  # dropout drew from the tracker's stream
    tracker.set_states(states)
    out_b, grad_b, _ = _core_run(attn, mixed, go, groups, j, five=True)
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=0)
    torch.testing.assert_close(grad_b, grad_a, rtol=0, atol=0)
    attn.eval()
    out_eval, _, _ = _core_run(attn, mixed, go, groups, j, five=True)
    assert not torch.allclose(out_eval, out_a, atol=1e-3)


# ------------------------------------------------------------------ whole layer vs megatron's SelfAttention
def _layer_pair(cfg, mask_type=AttnMaskType.causal, qk_norm=False):
    norm = mcore_compat.TorchRMSNorm if qk_norm else None
    sub = SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=SDPAttention,
                                  linear_proj=RowParallelLinear, q_layernorm=norm, k_layernorm=norm)
    torch.manual_seed(0)
    ref = SelfAttention(cfg, sub, layer_number=1, attn_mask_type=mask_type)
    new = GroupedQuerySelfAttention(cfg, sub, layer_number=1, attn_mask_type=mask_type)
    new.load_state_dict(ref.state_dict())
    return ref, new


def _query_ndims(layer) -> list:
    ndims = []
    layer.core_attention.register_forward_pre_hook(lambda mod, args: ndims.append(args[0].dim()))
    return ndims


def _layer_run(layer, x, go, **kw):
    xx = x.clone().requires_grad_()
    out, bias = layer(xx, **kw)
    assert bias is None
    out.backward(go)
    return out.detach(), xx.grad, {n: p.grad for n, p in layer.named_parameters()}


def _assert_layers_match(ref, new, x, go, **kw):
    r = _layer_run(ref, x, go, **kw)
    n = _layer_run(new, x, go, **kw)
    torch.testing.assert_close(n[0], r[0], **TOL)
    torch.testing.assert_close(n[1], r[1], **TOL)
    assert n[2].keys() == r[2].keys()
    for name, grad in r[2].items():
        torch.testing.assert_close(n[2][name], grad, **TOL, msg=lambda m: f"{name}: {m}")


def _xgo(s=29, b=3, hidden=64, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s, b, hidden, generator=g), torch.randn(s, b, hidden, generator=g)


@pytest.mark.parametrize("heads,groups,five", [(8, 2, True), (8, 1, True), (4, 4, False)])
def test_grouped_layer_matches_self_attention(mp, heads, groups, five):
    """GQA takes the 5-D path; MHA (megatron's reshape is already a view there) keeps megatron's."""
    ref, new = _layer_pair(_cfg(heads, groups))
    ref_nd, new_nd = _query_ndims(ref), _query_ndims(new)
    x, go = _xgo()
    _assert_layers_match(ref, new, x, go, attention_mask=None)
    assert ref_nd == [4] and new_nd == [5 if five else 4]
    assert not new._grouped_query  # the per-call flag does not outlive the call


def test_grouped_layer_query_is_a_view_of_the_qkv_projection(mp):
    _, new = _layer_pair(_cfg())
    proj = []
    new.linear_qkv.register_forward_hook(lambda mod, args, out: proj.append(out[0]))
    seen = _spy_sdpa(new.core_attention)
    x, _ = _xgo()
    new(x, attention_mask=None)
    q, k, v = seen[0]
    for t in (q, k, v):
        assert t.untyped_storage().data_ptr() == proj[0].untyped_storage().data_ptr()


def test_grouped_layer_selective_recompute_matches(mp):
    """recompute core_attn: megatron's _checkpointed_attention_forward passes the 5-D query through."""
    cfg = _cfg(recompute_granularity="selective", recompute_modules=["core_attn"])
    ref, new = _layer_pair(cfg)
    assert new.checkpoint_core_attention
    new_nd = _query_ndims(new)
    x, go = _xgo()
    _assert_layers_match(ref, new, x, go, attention_mask=None)
    assert new_nd and set(new_nd) == {5}  # forward and the backward recompute


def test_grouped_layer_eval_forward_matches(mp):
    ref, new = _layer_pair(_cfg())
    ref.eval()
    new.eval()
    new_nd = _query_ndims(new)
    x, _ = _xgo()
    with torch.no_grad():
        torch.testing.assert_close(new(x, attention_mask=None)[0], ref(x, attention_mask=None)[0], **TOL)
    assert new_nd == [5]


def test_grouped_layer_falls_back_with_rope(mp):
    ref, new = _layer_pair(_cfg())
    new_nd = _query_ndims(new)
    x, go = _xgo()
    rope = RotaryEmbedding(kv_channels=HN, rotary_percent=1.0)(x.size(0))
    _assert_layers_match(ref, new, x, go, attention_mask=None, rotary_pos_emb=rope)
    assert new_nd == [4]
    # RoPE took effect (the comparison is not vacuous)
    with torch.no_grad():
        assert not torch.allclose(new(x, attention_mask=None)[0], new(x, attention_mask=None, rotary_pos_emb=rope)[0],
                                  atol=1e-4)


def test_grouped_layer_falls_back_with_qk_layernorm(mp):
    ref, new = _layer_pair(_cfg(), qk_norm=True)
    new_nd = _query_ndims(new)
    x, go = _xgo()
    _assert_layers_match(ref, new, x, go, attention_mask=None)
    assert new_nd == [4]


def test_grouped_layer_with_explicit_padding_mask_matches(mp):
    """Non-causal mask type: the layer passes the 5-D query, SDPAttention lays it out 4-D for the mask."""
    ref, new = _layer_pair(_cfg(), mask_type=AttnMaskType.padding)
    new_nd = _query_ndims(new)
    s, b = 29, 3
    x, go = _xgo(s, b)
    mask = torch.rand(b, 1, s, s, generator=torch.Generator().manual_seed(5)) < 0.3
    mask[..., 0] = False
    _assert_layers_match(ref, new, x, go, attention_mask=mask)
    assert new_nd == [5]


def test_grouped_layer_checkpoint_keys_match_self_attention(mp):
    ref, new = _layer_pair(_cfg())
    assert list(new.state_dict()) == list(ref.state_dict())
    prefix = "decoder.layers.3.self_attention."
    r_sd, n_sd = ref.sharded_state_dict(prefix=prefix), new.sharded_state_dict(prefix=prefix)
    assert n_sd.keys() == r_sd.keys()
    for k, t in r_sd.items():
        if hasattr(t, "global_shape"):
            assert (n_sd[k].key, tuple(n_sd[k].global_shape)) == (t.key, tuple(t.global_shape))


# ------------------------------------------------------------------ spec wiring
@pytest.mark.parametrize("impl,cls", [("sdpa", GroupedQuerySelfAttention), ("unfused", SelfAttention)])
def test_spec_self_attention_class(mp, impl, cls):
    model = build_model(compose(["model=tiny", "kernels.backend=torch", f"model.attention_impl={impl}",
                                 "model.seq_length=64"]))
    attn = [m for m in model.modules() if isinstance(m, SelfAttention)]
    assert attn and all(type(m) is cls for m in attn)
    if impl == "sdpa":
        assert all(m._grouped_query_layer_ok for m in attn)  # tiny is GQA (4 heads, 2 groups)
