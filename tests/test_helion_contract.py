"""The helion backend's public ops against the signatures they replace (mamba-ssm 2.3.2, causal-conv1d 1.7.0).

Every argument of each reference signature is either supported (one call per op with every supported argument at a
non-default value, against the torch reference, on CPU in interpret mode) or rejected with a NotImplementedError that
names it. The reference signatures are written out here (neither library installs on CPU); the GPU tests compare
against the libraries themselves.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from kernels import causal_conv1d_helion as cc
from kernels import mamba_split_helion as msh
from kernels import rmsnorm_gated_helion as R
from kernels import ssd_helion as sh
from kernels.mamba_split import mamba_split_conv1d_scan_combined_ref
from kernels.rmsnorm_gated import rmsnorm_gated_ref
from kernels.ssd import mamba_chunk_scan_combined_ref

INF = float("inf")
# op -> (helion function, reference signature (name, default) in order, {rejected argument: a non-default value})
CONTRACT = {
    "mamba_ssm.ops.triton.ssd_combined.mamba_split_conv1d_scan_combined": (
        msh.mamba_split_conv1d_scan_combined_helion,
        [("zxbcdt", None), ("conv1d_weight", None), ("conv1d_bias", None), ("dt_bias", None), ("A", None), ("D", None),
         ("chunk_size", None), ("initial_states", None), ("seq_idx", None), ("dt_limit", (0.0, INF)),
         ("return_final_states", False), ("activation", "silu"), ("rmsnorm_weight", None), ("rmsnorm_eps", 1e-6),
         ("outproj_weight", None), ("outproj_bias", None), ("headdim", None), ("ngroups", 1),
         ("norm_before_gate", True)],
        {"outproj_weight": "ones", "outproj_bias": "ones"},
    ),
    "mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined": (
        sh.mamba_chunk_scan_combined_helion,
        [("x", None), ("dt", None), ("A", None), ("B", None), ("C", None), ("chunk_size", None), ("D", None), ("z", None),
         ("dt_bias", None), ("initial_states", None), ("seq_idx", None), ("cu_seqlens", None), ("dt_softplus", False),
         ("dt_limit", (0.0, INF)), ("return_final_states", False), ("return_varlen_states", False)],
        {"cu_seqlens": "cu", "return_varlen_states": True},
    ),
    "causal_conv1d.causal_conv1d_fn": (
        cc.causal_conv1d_helion,
        [("x", None), ("weight", None), ("bias", None), ("seq_idx", None), ("initial_states", None),
         ("return_final_states", False), ("final_states_out", None), ("activation", None)],
        {"initial_states": "zeros", "return_final_states": True, "final_states_out": "zeros"},
    ),
    "causal_conv1d.causal_conv1d_update": (
        cc.causal_conv1d_update_helion,
        [("x", None), ("conv_state", None), ("weight", None), ("bias", None), ("activation", None),
         ("cache_seqlens", None), ("conv_state_indices", None)],
        {"conv_state": "zeros"},  # the op itself: decoding with a conv state
    ),
    "mamba_ssm.ops.triton.layernorm_gated.rmsnorm_fn": (
        R.rmsnorm_fn_helion,
        [("x", None), ("weight", None), ("bias", None), ("z", None), ("eps", 1e-6), ("group_size", None),
         ("norm_before_gate", True)],
        {"bias": "ones"},
    ),
    "mamba_ssm.ops.triton.layernorm_gated.layernorm_fn": (
        R.layernorm_fn_helion,
        [("x", None), ("weight", None), ("bias", None), ("z", None), ("eps", 1e-6), ("group_size", None),
         ("norm_before_gate", True), ("is_rms_norm", False)],
        {"is_rms_norm": False, "bias": "ones"},
    ),
}
# extra keyword arguments of the helion functions (not in the reference signatures)
EXTRAS = {"mamba_ssm.ops.triton.ssd_combined.mamba_split_conv1d_scan_combined": {"settings"},
          "mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined": {"state_dtype"}}


@pytest.mark.parametrize("op", list(CONTRACT))
def test_signature_matches_the_reference(op):
    """Same parameter names, order and defaults as the reference, plus the listed extras (keyword, after them)."""
    fn, ref, _ = CONTRACT[op]
    params = list(inspect.signature(fn).parameters.values())
    names = [p.name for p in params]
    assert names[: len(ref)] == [n for n, _ in ref], names
    assert set(names[len(ref):]) == EXTRAS.get(op, set())
    for p, (name, default) in zip(params, ref):
        if default is not None or p.default is not inspect.Parameter.empty:
            assert p.default == default, f"{name}: default {p.default!r}, reference {default!r}"


def _fused_inputs(b=1, l=40, h=4, p=8, g=2, n=8):
    gen = torch.Generator().manual_seed(0)
    dim = h * p
    return dict(
        zxbcdt=torch.randn(b, l, 2 * dim + 2 * g * n + h, generator=gen),
        conv1d_weight=torch.randn(dim + 2 * g * n, 4, generator=gen) * 0.5,
        conv1d_bias=torch.randn(dim + 2 * g * n, generator=gen) * 0.1,
        dt_bias=torch.randn(h, generator=gen), A=-torch.rand(h, generator=gen) - 0.5, D=torch.randn(h, p, generator=gen),
    ), dict(h=h, p=p, g=g, n=n)


def _value(v, like: torch.Tensor):
    if v == "ones":
        return torch.ones_like(like)
    if v == "zeros":
        return torch.zeros_like(like)
    if v == "cu":
        return torch.tensor([0, like.shape[1]], dtype=torch.int32)
    return v


@pytest.mark.parametrize("op", list(CONTRACT))
def test_rejected_arguments_raise_not_implemented_naming_them(op):
    fn, ref, rejected = CONTRACT[op]
    t, d = _fused_inputs()
    gen = torch.Generator().manual_seed(1)
    if op.endswith("mamba_split_conv1d_scan_combined"):
        args = list(t.values()) + [16]
        kw = dict(headdim=d["p"], ngroups=d["g"])
        like = {"outproj_weight": torch.zeros(16, d["h"] * d["p"]), "outproj_bias": torch.zeros(16)}
    elif op.endswith("mamba_chunk_scan_combined"):
        x = torch.randn(1, 16, 2, 8, generator=gen)
        args = [x, torch.randn(1, 16, 2, generator=gen), -torch.rand(2), torch.randn(1, 16, 1, 8, generator=gen),
                torch.randn(1, 16, 1, 8, generator=gen), 16]
        kw, like = {}, {"cu_seqlens": x}
    elif op.endswith("causal_conv1d_fn"):
        x = torch.randn(1, 4, 16, generator=gen)
        args, kw = [x, torch.randn(4, 4, generator=gen)], {}
        like = {"initial_states": torch.zeros(1, 4, 3), "final_states_out": torch.zeros(1, 4, 3)}
    elif op.endswith("causal_conv1d_update"):
        args, kw, like = [torch.randn(1, 4), None, torch.randn(4, 4)], {}, {"conv_state": torch.zeros(1, 4, 3)}
    else:  # rmsnorm_fn / layernorm_fn
        args, kw = [torch.randn(3, 8, generator=gen), torch.ones(8), None], {}
        like = {"bias": torch.zeros(8)}
    names = [n for n, _ in ref]
    for arg, v in rejected.items():
        call_kw = dict(kw)
        if op.endswith("layernorm_fn") and arg == "bias":
            call_kw["is_rms_norm"] = True  # the RMSNorm form, with a bias
        value = _value(v, like[arg]) if arg in like else v
        if arg in names[: len(args)]:
            a = list(args)
            a[names.index(arg)] = value
            call = lambda: fn(*a, **call_kw)  # noqa: E731
        else:
            call = lambda: fn(*args, **{**call_kw, arg: value})  # noqa: E731
        with pytest.raises(NotImplementedError) as ei:
            call()
        msg = str(ei.value)
        assert (arg in msg) or (op.endswith("causal_conv1d_update") and "causal_conv1d_update" in msg), (arg, msg)
        assert "\n" not in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpret-mode check (GPU: the GPU tests)")
def test_fused_op_supported_arguments_match_reference():
    """mamba_split_conv1d_scan_combined with every supported argument away from its default: seq_idx with a document
    of one token, initial states, dt_limit, return_final_states, activation None, D per head-dim, rmsnorm_eps and
    norm_before_gate (no effect without rmsnorm_weight, as in mamba-ssm); then with rmsnorm_weight (the gated norm in
    the op) and norm_before_gate True. chunk_size must be a power of two >= 16 (a ValueError otherwise: the kernels'
    tiles)."""
    t, d = _fused_inputs()
    seq = torch.tensor([[0] * 9 + [1] + [2] * 14 + [3] * 16], dtype=torch.int32)
    init = torch.randn(1, d["h"], d["p"], d["n"], generator=torch.Generator().manual_seed(3))
    kw = dict(initial_states=init, seq_idx=seq, dt_limit=(0.01, 2.0), return_final_states=True, activation=None,
              rmsnorm_eps=1e-3, headdim=d["p"], ngroups=d["g"], norm_before_gate=False)
    ref_out, ref_fin = mamba_split_conv1d_scan_combined_ref(*t.values(), 16, **kw)
    out, fin = msh.mamba_split_conv1d_scan_combined_helion(*t.values(), 16, **kw)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fin, ref_fin, atol=1e-4, rtol=1e-4)
    kw.update(rmsnorm_weight=1 + 0.1 * torch.randn(d["h"] * d["p"], generator=torch.Generator().manual_seed(4)),
              norm_before_gate=True)
    ref_out, _ = mamba_split_conv1d_scan_combined_ref(*t.values(), 16, **kw)
    out, _ = msh.mamba_split_conv1d_scan_combined_helion(*t.values(), 16, **kw)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpret-mode check (GPU: the GPU tests)")
def test_chunk_scan_supported_arguments_match_reference():
    gen = torch.Generator().manual_seed(4)
    b, l, h, p, g, n, c = 1, 37, 4, 8, 2, 8, 16
    x, z = torch.randn(b, l, h, p, generator=gen), torch.randn(b, l, h, p, generator=gen)
    args = (x, torch.randn(b, l, h, generator=gen), -torch.rand(h, generator=gen) - 0.5,
            torch.randn(b, l, g, n, generator=gen), torch.randn(b, l, g, n, generator=gen), c)
    seq = torch.tensor([[0] * 5 + [1] + [2] * 31], dtype=torch.int32)
    kw = dict(D=torch.randn(h, generator=gen), z=z, dt_bias=torch.randn(h, generator=gen),
              initial_states=torch.randn(b, h, p, n, generator=gen), seq_idx=seq, dt_softplus=True, dt_limit=(0.01, 2.0),
              return_final_states=True)
    out, fin = sh.mamba_chunk_scan_combined_helion(*args, **kw)
    ref_out, ref_fin = mamba_chunk_scan_combined_ref(*args, **kw)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fin, ref_fin, atol=1e-4, rtol=1e-4)
    with pytest.raises(NotImplementedError, match="forward-only"):
        sh.mamba_chunk_scan_combined_helion(x.requires_grad_(), *args[1:], **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpret-mode check (GPU: the GPU tests)")
def test_norm_supported_arguments_match_reference():
    gen = torch.Generator().manual_seed(5)
    x, z, w = torch.randn(5, 16, generator=gen), torch.randn(5, 16, generator=gen), torch.randn(16, generator=gen)
    for nbg in (True, False):
        kw = dict(z=z, eps=1e-3, group_size=8, norm_before_gate=nbg)
        ref = rmsnorm_gated_ref(x, w, None, **kw)
        torch.testing.assert_close(R.rmsnorm_fn_helion(x, w, None, **kw), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(R.layernorm_fn_helion(x, w, None, is_rms_norm=True, **kw), ref, atol=1e-5, rtol=1e-5)
