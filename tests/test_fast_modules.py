"""Production-speed modules vs megatron's reference modules, CPU fp32, small shapes.

- SDPAttention (torch SDPA, causal GQA) vs megatron DotProductAttention (unfused): outputs and grads.
- GroupedGemmExperts (torch._grouped_mm) vs megatron SequentialMLP with the same weights: outputs and
  grads; sharded_state_dict keys/shapes; a whole tiny model (router, expert bias, shared expert)
  gives the same loss and gradients with either implementation pair.
"""

from __future__ import annotations

import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

from megatron.core.activations import squared_relu  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.mlp import MLPSubmodules  # noqa: E402
from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402

from nano_hybrid import mcore_compat  # noqa: E402
from nano_hybrid.config import compose  # noqa: E402
from nano_hybrid.model import build_model  # noqa: E402
from nano_hybrid.model.attention import SDPAttention  # noqa: E402
from nano_hybrid.model.experts import GroupedGemmExperts, copy_grouped_weights  # noqa: E402


def _cfg(**kw):
    base = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        add_bias_linear=False, use_cpu_initialization=True, bias_dropout_fusion=False,
        masked_softmax_fusion=False, normalization="RMSNorm", attention_dropout=0.0, hidden_dropout=0.0,
    )
    base.update(kw)
    return TransformerConfig(**base)


@pytest.mark.parametrize("groups", [2, 4])
def test_sdpa_matches_unfused_dot_product_attention(mp, groups):
    cfg = _cfg(num_query_groups=groups)
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
    ref = DotProductAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=pgs)
    new = SDPAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=pgs)
    s, b, h, g, d = 37, 3, 4, groups, 16
    torch.manual_seed(0)
    q = torch.randn(s, b, h, d)
    k = torch.randn(s, b, g, d)
    v = torch.randn(s, b, g, d)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    grads = []
    outs = []
    for mod in (ref, new):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = mod(qq, kk, vv, mask)
        go = torch.randn_like(out, generator=torch.Generator().manual_seed(1))
        out.backward(go)
        outs.append(out.detach())
        grads.append([qq.grad, kk.grad, vv.grad])
    assert outs[0].shape == (s, b, h * d)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for a, r in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


def test_sdpa_explicit_mask_for_non_causal_mask_type(mp):
    """With a non-causal mask type the megatron bool mask (True = masked) is honoured, as unfused does."""
    cfg = _cfg()
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
    ref = DotProductAttention(cfg, 1, AttnMaskType.padding, "self", pg_collection=pgs)
    new = SDPAttention(cfg, 1, AttnMaskType.padding, "self", pg_collection=pgs)
    s, b = 20, 2
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(s, b, 4, 16, generator=g), torch.randn(s, b, 2, 16, generator=g), torch.randn(s, b, 2, 16, generator=g)
    mask = torch.rand(b, 1, s, s, generator=g) < 0.3
    mask[..., 0] = False  # every row keeps at least one key
    torch.testing.assert_close(new(q, k, v, mask), ref(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_sdpa_rejects_unsupported_settings(mp):
    with pytest.raises(ValueError, match="context_parallel_size"):
        SDPAttention(_cfg(context_parallel_size=2), 1, AttnMaskType.causal, "self")


def _experts_pair(n_exp=4, hidden=32, ffn=48):
    cfg = _cfg(hidden_size=hidden, num_moe_experts=n_exp, moe_ffn_hidden_size=ffn, ffn_hidden_size=ffn,
               moe_router_topk=2, activation_func=mcore_compat.uncompiled(squared_relu), gated_linear_unit=False)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    seq = SequentialMLP(n_exp, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                        pg_collection=pgs)
    grp = GroupedGemmExperts(n_exp, cfg, pg_collection=pgs)
    with torch.no_grad():
        for e, exp in enumerate(seq.local_experts):
            grp.weight1[e].copy_(exp.linear_fc1.weight)
            grp.weight2[e].copy_(exp.linear_fc2.weight)
    return seq, grp


def test_grouped_experts_match_sequential_mlp(mp):
    seq, grp = _experts_pair()
    torch.manual_seed(0)
    tpe = torch.tensor([5, 0, 11, 3])  # includes an expert with no tokens
    x = torch.randn(int(tpe.sum()), 32)
    probs = torch.rand(int(tpe.sum()))
    results = []
    for mod in (seq, grp):
        xx, pp = x.clone().requires_grad_(), probs.clone().requires_grad_()
        out, bias = mod(xx, tpe, pp)
        assert bias is None
        out.backward(torch.ones_like(out) * 0.5 + out.detach())
        results.append((out.detach(), xx.grad, pp.grad))
    for a, r in zip(results[1], results[0]):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
    for e, exp in enumerate(seq.local_experts):
        torch.testing.assert_close(grp.weight1.grad[e], exp.linear_fc1.weight.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grp.weight2.grad[e], exp.linear_fc2.weight.grad, rtol=1e-5, atol=1e-5)
    assert grp.weight1.grad[1].abs().max() == 0  # the empty expert gets a zero gradient


def test_grouped_experts_backward_with_expanded_grad(mp):
    """torch._grouped_mm's CPU backward rejects zero-stride grads; out.sum().backward() must work."""
    _, grp = _experts_pair()
    tpe = torch.tensor([2, 2, 2, 2])
    x = torch.randn(8, 32, requires_grad=True)
    out, _ = grp(x, tpe, torch.ones(8))
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_grouped_experts_no_tokens(mp):
    _, grp = _experts_pair()
    out, _ = grp(torch.zeros(0, 32), torch.zeros(4, dtype=torch.long), torch.zeros(0))
    assert out.shape == (0, 32)
    out.sum().backward()
    assert grp.weight1.grad is not None


def test_grouped_experts_checkpoint_keys_match_sequential(mp):
    seq, grp = _experts_pair()
    s_sd = seq.sharded_state_dict(prefix="decoder.layers.1.mlp.experts.")
    g_sd = grp.sharded_state_dict(prefix="decoder.layers.1.mlp.experts.")
    # SequentialMLP also saves the linears' (empty) _extra_state objects; weights must match exactly
    s_keys = {(t.key, tuple(t.global_shape)) for t in s_sd.values() if not t.key.endswith("_extra_state")}
    g_keys = {(t.key, tuple(t.global_shape)) for t in g_sd.values()}
    assert g_keys == s_keys


def _tiny(impls, *overrides):
    attn, experts = impls
    cfg = compose(["model=tiny", "kernels.backend=torch", f"model.attention_impl={attn}",
                   f"model.moe_experts_impl={experts}", "model.seq_length=64", *overrides])
    torch.manual_seed(0)
    return build_model(cfg)


def test_tiny_model_fast_modules_match_reference_modules(mp):
    fast = _tiny(("sdpa", "grouped"))
    ref = _tiny(("unfused", "sequential"))
    copy_grouped_weights(fast, ref)
    b, s = 2, 64
    tok = torch.randint(0, 512, (b, s), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(s)[None].expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    losses = []
    for m in (fast, ref):
        loss = m(tok, pos, mask, labels=tok).mean()
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    f_grads = {n: p.grad for n, p in fast.named_parameters()}
    for n, p in ref.named_parameters():
        if "local_experts." in n:
            pre, rest = n.split("local_experts.")
            e, lin = rest.split(".", 1)
            g = f_grads[pre + ("weight1" if lin.startswith("linear_fc1") else "weight2")][int(e)]
        else:
            g = f_grads[n]
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("experts,recompute", [("grouped", []), ("sequential", []),
                                               ("grouped", ["model.recompute=selective", "model.recompute_modules=[moe]"])],
                         ids=["grouped", "sequential", "grouped-recompute-moe"])
def test_moe_dispatcher_keeps_no_autograd_graph(mp, experts, recompute):
    """After the forward (and after the backward, which reruns it under recompute) no MoE token dispatcher holds
    a tensor of the step's autograd graph: megatron's dispatchers keep the last routing probabilities
    (``local_probs``), which would keep the graph's nodes and, through Megatron DDP's gradient hooks on the
    parameters' accumulator nodes, a dropped DDP model alive (model/moe.py)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from nano_hybrid.model.moe import GraphReleasingMoELayer

    model = _tiny(("sdpa", experts), *recompute)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert len(layers) == 2 and all(isinstance(m, GraphReleasingMoELayer) for m in layers)

    def graph_tensors():
        return [(i, k) for i, m in enumerate(layers) for k, v in vars(m.token_dispatcher).items()
                if isinstance(v, torch.Tensor) and v.grad_fn is not None]

    b, s = 2, 64
    tok = torch.randint(0, 512, (b, s), generator=torch.Generator().manual_seed(3))
    loss = model(tok, torch.arange(s)[None].expand(b, s), None, labels=tok).mean()
    assert graph_tensors() == []
    assert all(isinstance(m.token_dispatcher.local_map, torch.Tensor) for m in layers)  # the dispatchers did run
    loss.backward()
    assert graph_tensors() == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_experts_bf16_on_gpu_match_sequential(mp):
    """On GPU torch._grouped_mm runs the bf16 grouped GEMM; compare with SequentialMLP in bf16."""
    seq, grp = _experts_pair(n_exp=8, hidden=128, ffn=192)
    seq, grp = seq.cuda().bfloat16(), grp.cuda().bfloat16()
    tpe = torch.tensor([40, 0, 17, 64, 3, 9, 30, 13], device="cuda")
    x = torch.randn(int(tpe.sum()), 128, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(int(tpe.sum()), device="cuda")
    outs = [m(x, tpe, probs)[0].float() for m in (seq, grp)]
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sdpa_bf16_on_gpu_matches_unfused(mp):
    cfg = _cfg(num_query_groups=2, bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=False)
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
    ref = DotProductAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=pgs)
    new = SDPAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=pgs)
    s, b = 256, 2
    q = torch.randn(s, b, 4, 16, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(s, b, 2, 16, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(s, b, 2, 16, device="cuda", dtype=torch.bfloat16)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device="cuda"), 1)[None, None]
    torch.testing.assert_close(new(q, k, v, mask).float(), ref(q, k, v, mask).float(), rtol=2e-2, atol=2e-2)


def test_topk_permute_matches_megatron_permute_unpermute():
    """PermuteTopK / UnpermuteTopK give megatron's permute/unpermute values and gradients (fp64)."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    from nano_hybrid.model.moe import PermuteTopK, UnpermuteTopK

    g = torch.Generator().manual_seed(0)
    T, E, k, H = 37, 8, 3, 5
    top = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, top, True)
    x = torch.randn(T, H, dtype=torch.float64, generator=g)
    w = torch.randn(T * k, H, dtype=torch.float64, generator=g)  # stands in for the experts
    results = []
    for impl in ("megatron", "topk"):
        xx = x.clone().requires_grad_()
        if impl == "megatron":
            perm, _, idx = permute(xx, routing_map)
            out = unpermute(perm * w, idx, restore_shape=xx.shape, routing_map=routing_map)
        else:
            idx = torch.arange(T).unsqueeze(0).expand(E, -1).masked_select(routing_map.T.contiguous())
            inv = torch.argsort(idx, stable=True).view(T, k)
            perm = PermuteTopK.apply(xx, idx, inv)
            out = UnpermuteTopK.apply(perm * w, idx, inv)
        out.backward(torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
        results.append((perm.detach(), out.detach(), xx.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_grouped_moe_layer_uses_topk_dispatcher_and_falls_back_for_ep(mp):
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from nano_hybrid.model.moe import TopKAllGatherTokenDispatcher

    fast = _tiny(("sdpa", "grouped"))
    ref = _tiny(("unfused", "sequential"))
    fast_d = [m.token_dispatcher for m in fast.modules() if hasattr(m, "token_dispatcher")]
    ref_d = [m.token_dispatcher for m in ref.modules() if hasattr(m, "token_dispatcher")]
    assert fast_d and all(type(d) is TopKAllGatherTokenDispatcher for d in fast_d)
    assert ref_d and all(type(d) is MoEAllGatherTokenDispatcher for d in ref_d)
    d = fast_d[0]
    assert d._fast_ok()
    d.num_local_experts = d.config.num_moe_experts // 2  # as under expert parallelism: megatron's path
    assert not d._fast_ok()


def _topk_map(t: int, e: int, k: int, seed: int = 0) -> torch.Tensor:
    """A [t, e] routing map with exactly k experts per token, as megatron's top-k router builds it."""
    scores = torch.rand(t, e, generator=torch.Generator().manual_seed(seed))
    return torch.zeros(t, e, dtype=torch.bool).scatter(1, scores.topk(k, dim=1).indices, True)


def test_topk_dispatcher_matches_megatron_dispatch_postprocess(mp):
    """The sync-free dispatch gives megatron's permuted tokens, tokens per expert and permuted probs, and the same
    gradients of the tokens and the routing probabilities (fp64)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from nano_hybrid.model.moe import TopKAllGatherTokenDispatcher

    d = next(m.token_dispatcher for m in _tiny(("sdpa", "grouped")).modules() if hasattr(m, "token_dispatcher"))
    assert type(d) is TopKAllGatherTokenDispatcher and d._fast_ok()
    t, e, k, h = 37, d.config.num_moe_experts, d.config.moe_router_topk, 16
    rmap = _topk_map(t, e, k)
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(t, h, dtype=torch.float64, generator=g)
    p0 = torch.rand(t, e, dtype=torch.float64, generator=g) * rmap
    w_out = torch.randn(t * k, h, dtype=torch.float64, generator=g)
    w_p = torch.randn(t * k, dtype=torch.float64, generator=g)
    results = []
    for fn in (TopKAllGatherTokenDispatcher.dispatch_postprocess, MoEAllGatherTokenDispatcher.dispatch_postprocess):
        x, p = x0.clone().requires_grad_(), p0.clone().requires_grad_()
        d.routing_map = rmap.clone()
        perm, tpe, probs = fn(d, x, p)
        ((perm * w_out).sum() + (probs * w_p).sum()).backward()
        results.append((perm.detach(), tpe.cpu(), probs.detach(), x.grad, p.grad))
    assert results[0][1].tolist() == rmap.sum(0).tolist()
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_selected_positions_needs_exactly_the_count():
    """``selected_positions`` gives the True entries' indices in order, and refuses a mask with another count
    (a routing map where a token lost or gained an expert) instead of returning unwritten slots."""
    from nano_hybrid.model.moe import selected_positions

    mask = _topk_map(11, 6, 2, seed=2).T.contiguous().view(-1)
    assert selected_positions(mask, 22).tolist() == mask.nonzero().view(-1).tolist()
    for flip in (mask.nonzero()[0], (~mask).nonzero()[0]):  # one expert fewer, one more
        bad = mask.clone()
        bad[flip] = ~bad[flip]
        with pytest.raises(RuntimeError, match="exactly topk"):
            selected_positions(bad, 22)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_topk_dispatch_makes_no_host_sync_on_gpu(mp):
    """The MoE permutation, its un-permutation and their backward never wait for the device
    (``torch.cuda.set_sync_debug_mode('error')`` raises on any synchronising call)."""
    from nano_hybrid.model.moe import PermuteTopK, SelectPositions, UnpermuteTopK, selected_positions

    t, e, k, h = 4096, 16, 4, 512
    rmap = _topk_map(t, e, k).cuda()
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    p = torch.rand(t, e, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mask = rmap.T.contiguous().view(-1)
        pos = selected_positions(mask, t * k)
        idx = pos % t
        inv = torch.argsort(idx, stable=True).view(t, k)
        perm = PermuteTopK.apply(x, idx, inv)
        probs = SelectPositions.apply(p.T.contiguous().view(-1), pos, mask)
        out = UnpermuteTopK.apply(perm * probs.unsqueeze(-1).to(perm.dtype), idx, inv)
        out.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = rmap.T.contiguous().view(-1).nonzero().view(-1)
    assert torch.equal(pos, ref) and x.grad is not None and p.grad is not None
