"""Helion causal depthwise conv1d vs the torch reference (CPU: HELION_INTERPRET=1) and causal-conv1d (GPU).

CPU tolerances: fp64 inputs, kernel math in fp32 -> 1e-5 absolute.
GPU tolerances (bf16 in/out, fp32 accumulation everywhere): against an fp32 reference from the same
bf16 inputs, out/dx within 2e-2 abs + 2e-2 rel, dweight/dbias (sums over b*l = 16k terms) within
1e-3 of their max magnitude + 1e-2; Helion's error must be no worse than 2x causal-conv1d's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.causal_conv1d import causal_conv1d_ref
from kernels.causal_conv1d_helion import causal_conv1d_bwd_helion, causal_conv1d_fwd_helion, causal_conv1d_helion

CPU = not torch.cuda.is_available()

CASES = [
    # (batch, dim, seqlen, width, seq_idx, activation, channel_last, bias)
    (2, 5, 11, 4, False, "silu", True, True),
    (2, 6, 13, 3, True, "silu", True, False),
    (1, 4, 9, 2, True, None, False, True),
    (2, 3, 7, 4, True, "swish", True, True),
    (1, 7, 5, 4, False, None, False, False),
]


def _make(b, d, l, w, useseq, cl, hasb, dtype, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    if cl:  # channel-last strided view, like xBC inside zxBCdt
        x = torch.randn(b, l, d + 5, generator=g)[:, :, 2 : 2 + d].transpose(1, 2)
    else:
        x = torch.randn(b, d, l, generator=g)
    x = x.to(device=device, dtype=dtype)
    wt = (0.5 * torch.randn(d, w, generator=g)).to(device=device, dtype=dtype)
    bias = (0.2 * torch.randn(d, generator=g)).to(device=device, dtype=dtype) if hasb else None
    seq = None
    if useseq:  # packed sequences: nondecreasing ids per row
        seq = torch.sort(torch.randint(0, 3, (b, l), generator=g), dim=1).values.to(device=device, dtype=torch.int32)
    return x, wt, bias, seq


def _fwd_bwd(fn, x, wt, bias, seq, act, dy, lo=1, hi=1):
    """Gradients through ``fn``; a channel-last x is a slice [lo, lo + d) of a wider (b, l, lo + d + hi)
    leaf buffer, like xBC inside zxBCdt."""
    b, d, l = x.shape
    if x.stride(1) == 1:  # keep the strided channel-last layout: leaf is a wider (b, l, lo+d+hi) buffer
        leaf = torch.zeros(b, l, lo + d + hi, dtype=x.dtype, device=x.device)
        leaf[:, :, lo : lo + d] = x.detach().transpose(1, 2)
        leaf.requires_grad_()
        xx = leaf[:, :, lo : lo + d].transpose(1, 2)
        assert xx.stride(1) == 1 and not xx.is_contiguous()
    else:
        leaf = x.detach().clone().requires_grad_()
        xx = leaf
    ins = [leaf] + [t.detach().clone().requires_grad_() for t in ([wt] + ([bias] if bias is not None else []))]
    y = fn(xx, ins[1], ins[2] if bias is not None else None, seq_idx=seq, activation=act)
    return (y, *torch.autograd.grad(y, ins, dy))


@pytest.mark.skipif(not CPU, reason="interpret-mode test (CPU)")
@pytest.mark.parametrize("b,d,l,w,useseq,act,cl,hasb", CASES)
def test_fwd_bwd_matches_reference_interpret(b, d, l, w, useseq, act, cl, hasb):
    """Sequences of 5-13 rows: the ones below MIN_SEQLEN run zero-padded, the others through the lane walk."""
    x, wt, bias, seq = _make(b, d, l, w, useseq, cl, hasb, torch.float64)
    dy = torch.randn(b, d, l, dtype=torch.float64)
    got = _fwd_bwd(causal_conv1d_helion, x, wt, bias, seq, act, dy)
    ref = _fwd_bwd(causal_conv1d_ref, x, wt, bias, seq, act, dy)
    assert got[0].shape == (b, d, l) and got[0].stride(1) == 1  # channel-last output
    for name, a, r in zip(["out", "dx", "dweight", "dbias"], got, ref):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5, msg=f"{name} differs")


FWD_CASES = CASES + [
    # (batch, dim, seqlen, width, seq_idx, activation, channel_last, bias)
    (1, 5, 67, 4, True, "silu", True, True),  # 67 rows: the default 64-row lanes plus a partial one
    (2, 3, 130, 3, False, None, True, False),
    (1, 4, 66, 2, True, "silu", False, False),
]


@pytest.mark.skipif(not CPU, reason="interpret-mode test (CPU)")
@pytest.mark.parametrize("b,d,l,w,useseq,act,cl,hasb", FWD_CASES)
def test_fwd_matches_reference_interpret(b, d, l, w, useseq, act, cl, hasb):
    x, wt, bias, seq = _make(b, d, l, w, useseq, cl, hasb, torch.float64)
    got = causal_conv1d_fwd_helion(x, wt, bias, seq, act)
    ref = causal_conv1d_ref(x, wt, bias, seq, act)
    assert got.shape == (b, d, l) and got.stride(1) == 1  # channel-last output
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not CPU, reason="interpret-mode test (CPU)")
def test_seq_idx_blocks_cross_sequence_flow():
    """Changing x in sequence 0 must not change outputs (or dx) in sequence 1."""
    x, wt, bias, _ = _make(1, 3, 10, 4, False, True, True, torch.float64)
    seq = torch.tensor([[0] * 5 + [1] * 5], dtype=torch.int32)
    y1 = causal_conv1d_fwd_helion(x, wt, bias, seq, "silu")
    x2 = x.clone()
    x2[:, :, :5] += 1.0
    y2 = causal_conv1d_fwd_helion(x2, wt, bias, seq, "silu")
    torch.testing.assert_close(y1[:, :, 5:], y2[:, :, 5:])
    dout = torch.zeros(1, 3, 10, dtype=torch.float64)
    dout[:, :, 5:] = 1.0
    dx, _, _ = causal_conv1d_bwd_helion(x, wt, bias, dout, seq, "silu")
    assert torch.all(dx[:, :, :5] == 0)


@pytest.mark.skipif(not CPU, reason="interpret-mode test (CPU)")
@pytest.mark.parametrize("cl", [True, False])
@pytest.mark.parametrize("w", [2, 4])
@pytest.mark.parametrize("l", [1, 2, 3, 8])
def test_short_sequences_match_reference_interpret(l, w, cl):
    """Sequences of 1..8 rows (below and at the conv width, below MIN_SEQLEN and at it), with seq_idx and padding:
    outputs and gradients as the reference's."""
    x, wt, bias, _ = _make(2, 3, l, w, False, cl, True, torch.float64)
    seq = torch.tensor([[0, 0, 1, -1, 2, 2, 2, -1][:l], [-1, 0, 0, 0, 1, 1, 1, 1][:l]], dtype=torch.int32)
    dy = torch.randn(2, 3, l, dtype=torch.float64)
    for s in (None, seq):
        got = _fwd_bwd(causal_conv1d_helion, x, wt, bias, s, "silu", dy)
        ref = _fwd_bwd(causal_conv1d_ref, x, wt, bias, s, "silu", dy)
        assert got[0].shape == (2, 3, l)
        for name, a, r in zip(["out", "dx", "dweight", "dbias"], got, ref):
            torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5, msg=f"{name} differs (seq_idx={s is not None})")


@pytest.mark.skipif(not CPU, reason="interpret-mode test (CPU)")
def test_negative_seq_idx_is_padding_interpret():
    """Where seq_idx < 0 (padding in a packed batch) the output is exactly 0, as causal-conv1d's, whatever x, the
    bias and the activation; padding positions get no gradient and pass none to their neighbours."""
    x, wt, bias, _ = _make(1, 4, 20, 4, False, True, True, torch.float64)
    seq = torch.tensor([[0] * 6 + [-1] * 3 + [1] * 8 + [-1] * 3], dtype=torch.int32)
    pad = (seq[0] < 0)
    for act in (None, "silu"):
        y = causal_conv1d_fwd_helion(x, wt, bias, seq, act)
        assert torch.all(y[:, :, pad] == 0) and torch.all(y[:, :, ~pad] != 0)
        torch.testing.assert_close(y, causal_conv1d_ref(x, wt, bias, seq, act), atol=1e-5, rtol=1e-5)
    dout = torch.zeros(1, 4, 20, dtype=torch.float64)
    dout[:, :, pad] = 1.0  # gradient only where the output is constant 0
    dx, dw, db = causal_conv1d_bwd_helion(x, wt, bias, dout, seq, "silu")
    assert torch.all(dx == 0) and torch.all(dw == 0) and torch.all(db == 0)


@pytest.mark.skipif(not CPU, reason="interpret-mode test (CPU)")
def test_bwd_into_preallocated_dx_and_bad_input():
    x, wt, bias, seq = _make(2, 4, 9, 4, True, True, True, torch.float64)
    dout = torch.randn(2, 4, 9, dtype=torch.float64)
    buf = torch.zeros(2, 9, 6, dtype=torch.float64)
    dx_view = buf[:, :, 1:5].transpose(1, 2)
    dx, dw, db = causal_conv1d_bwd_helion(x, wt, bias, dout, seq, "silu", dx=dx_view)
    assert dx.data_ptr() == dx_view.data_ptr()
    ref = _fwd_bwd(causal_conv1d_ref, x, wt, bias, seq, "silu", dout)
    torch.testing.assert_close(buf[:, :, 1:5], ref[1][:, :, 1:5], atol=1e-5, rtol=1e-5)  # ref grad is on the wide leaf
    assert torch.all(buf[:, :, 0] == 0) and torch.all(buf[:, :, 5] == 0)
    with pytest.raises(ValueError, match="width must be 2, 3 or 4"):
        causal_conv1d_fwd_helion(x, torch.randn(4, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_fwd_helion(x, wt, activation="relu")
    with pytest.raises(ValueError, match="seq_idx must be"):
        causal_conv1d_fwd_helion(x, wt, seq_idx=seq[:, :3])


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
@pytest.mark.parametrize("useseq", [False, True])
@pytest.mark.parametrize("b,d,l", [(2, 6144, 8192), (1, 384, 1000)])
def test_gpu_vs_causal_conv1d(b, d, l, useseq):
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError as e:
        pytest.skip(f"causal-conv1d not installed: {e}")
    x, wt, bias, seq = _make(b, d, l, 4, useseq, True, True, torch.bfloat16, device="cuda")
    dy = torch.randn(b, l, d, device="cuda").bfloat16().transpose(1, 2)
    # x is laid out as the fused path has it: xBC = zxBCdt[..., lo:lo + d] with a row stride that is a
    # multiple of 8 and a 16-byte aligned start (causal-conv1d's channel-last path requires both);
    # at the Nano shape exactly z | xBC | dt = 4096 | 6144 | 64 (row stride 10304).
    lo, hi = (4096, 64) if d == 6144 else (64, 64)
    ours = _fwd_bwd(causal_conv1d_helion, x, wt, bias, seq, "silu", dy, lo, hi)
    theirs = _fwd_bwd(lambda a, w_, b_, seq_idx=None, activation=None: causal_conv1d_fn(a, w_, b_, seq_idx=seq_idx, activation=activation), x, wt, bias,
                      seq, "silu", dy, lo, hi)
    ref = _fwd_bwd(causal_conv1d_ref, x.float(), wt.float(), bias.float(), seq, "silu", dy.float(), lo, hi)
    for name, a, t, r in zip(["out", "dx", "dweight", "dbias"], ours, theirs, ref):
        e_ours = (a.float() - r).abs().max().item()
        e_theirs = (t.float() - r).abs().max().item()
        if name in ("dweight", "dbias"):
            # returned in the weight's dtype (bf16, as causal-conv1d does): rounding alone is up to
            # 2**-9 of a value, so allow 2**-8 of the largest one on top of the fp32 reduction error
            assert e_ours <= 2**-8 * r.abs().max().item() + 1e-2, (name, e_ours)
        else:
            torch.testing.assert_close(a.float(), r, atol=2e-2, rtol=2e-2, msg=name)
        assert e_ours <= 2 * e_theirs + 1e-3, f"{name}: helion err {e_ours} vs causal-conv1d {e_theirs}"


def _causal_conv1d_fn():
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError as e:
        pytest.fail(f"causal-conv1d is not importable on this GPU host: {e}")
    return causal_conv1d_fn


def _cl_input(b, d, l, dtype, seed):
    """A channel-last (b, d, l) view of a (b, l, 8 + d + 8) buffer: strides multiple of 8, as causal-conv1d needs."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    buf = torch.randn(b, l, d + 16, generator=g).to(device="cuda", dtype=dtype)
    return buf[:, :, 8:8 + d].transpose(1, 2)


def _channel_last(t):
    """``t`` (b, d, l) copied into a (b, l, d) buffer and viewed as (b, d, l): strides (l*d, 1, d) at every length.
    ``t.transpose(1, 2).contiguous()`` does not give that at l = 1, where the transposed view already counts as
    contiguous and keeps stride 1 along l."""
    b, d, l = t.shape
    return t.new_empty(b, l, d).copy_(t.transpose(1, 2)).transpose(1, 2)


def _padded_docs(b, l, seed):
    """seq_idx with documents of 1..5 tokens (below the conv width) and longer ones, and -1 padding runs."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = []
    for _ in range(b):
        ids, cur = [], 0
        while len(ids) < l:
            n = int(torch.randint(1, 6, (1,), generator=g)) if torch.rand(1, generator=g) < 0.6 else int(
                torch.randint(6, 40, (1,), generator=g))
            pad = bool(torch.rand(1, generator=g) < 0.25)
            ids += [-1 if pad else cur] * n
            cur += 0 if pad else 1
        rows.append(ids[:l])
    return torch.tensor(rows, dtype=torch.int32, device="cuda")


def _vs_causal_conv1d(x, w, bias, seq, act, dy):
    """(ours, causal-conv1d's, fp32 reference) outputs and grads (x, weight, bias) for the same inputs."""
    fn = _causal_conv1d_fn()

    def grads(f, x_, w_, b_, dy_):
        cl = x_.stride(1) == 1 and x_.stride(2) != 1
        leaf = (_channel_last(x_).transpose(1, 2) if cl else x_.contiguous()).detach().requires_grad_()
        xin = leaf.transpose(1, 2) if cl else leaf  # channel-last stays channel-last (causal-conv1d's seq_idx path)
        ins = [leaf] + [t.detach().clone().requires_grad_() for t in ([w_] + ([b_] if b_ is not None else []))]
        y = f(xin, ins[1], ins[2] if b_ is not None else None, seq_idx=seq, activation=act)
        # dout in x's layout: causal-conv1d's channel-last backward needs it channel-last (strides multiple of 8)
        g = list(torch.autograd.grad(y, ins, _channel_last(dy_) if cl else dy_))
        return [y, g[0].transpose(1, 2) if cl else g[0]] + g[1:]

    ours = grads(causal_conv1d_helion, x, w, bias, dy)
    theirs = grads(fn, x, w, bias, dy)
    ref = grads(causal_conv1d_ref, x.float(), w.float(), None if bias is None else bias.float(), dy.float())
    return ours, theirs, ref


def _assert_close_to(ours, theirs, ref, what):
    """Ours within bf16/fp16 rounding of the fp32 reference and no worse than 2x causal-conv1d's error (+ slack)."""
    for name, a, t, r in zip(["out", "dx", "dweight", "dbias"], ours, theirs, ref):
        assert a.shape == r.shape == t.shape, (what, name)
        e_ours = (a.float() - r).abs().max().item()
        e_theirs = (t.float() - r).abs().max().item()
        scale = r.abs().max().item()
        assert e_ours <= 2 * e_theirs + 1e-2 * max(1.0, scale), f"{what} {name}: helion {e_ours:.3e} vs causal-conv1d {e_theirs:.3e}"


CONV_LENGTHS = [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 64, 65, 128, 129, 257]  # below the width, MIN_SEQLEN, lanes (64)


@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
@pytest.mark.parametrize("seq", [None, "padded_docs"])
def test_gpu_lengths_widths_vs_causal_conv1d(seq):
    """Every sequence length of CONV_LENGTHS (1 .. 2 x 128 + 1: each length below the conv width and around the
    padding minimum and the lane size), widths 2-4, bf16, channel-last, bias, SiLU; with seq_idx: documents shorter
    than the width and -1 padding, where both give 0. causal-conv1d's backward uses dout at padding positions (whose
    output is the constant 0), so it is compared with dout zeroed there; with the full dout ours is the fp32
    reference's gradient."""
    d = 64
    for l in CONV_LENGTHS:
        for w in (2, 3, 4):
            x = _cl_input(2, d, l, torch.bfloat16, seed=l * 10 + w)
            g = torch.Generator(device="cpu").manual_seed(l + w)
            wt = (0.5 * torch.randn(d, w, generator=g)).to("cuda", torch.bfloat16)
            bias = (0.2 * torch.randn(d, generator=g)).to("cuda", torch.bfloat16)
            dy = torch.randn(2, d, l, generator=g).to("cuda", torch.bfloat16)
            sq = None if seq is None else _padded_docs(2, l, seed=l * 7 + w)
            if sq is not None:
                dy = dy * (sq >= 0).unsqueeze(1).to(dy.dtype)
            ours, theirs, ref = _vs_causal_conv1d(x, wt, bias, sq, "silu", dy)
            _assert_close_to(ours, theirs, ref, f"l={l} w={w} seq={seq}")
            if sq is not None:
                for r in range(2):
                    assert torch.all(ours[0][r][:, sq[r] < 0] == 0) and torch.all(theirs[0][r][:, sq[r] < 0] == 0)
                # the full dout: ours is the true gradient of the forward it computes (the fp32 reference's)
                dy_full = torch.randn(2, d, l, generator=g).to("cuda", torch.bfloat16)
                o_full = _vs_causal_conv1d(x, wt, bias, sq, "silu", dy_full)
                for name, a, r in zip(["dx", "dweight", "dbias"], o_full[0][1:], o_full[2][1:]):
                    err = (a.float() - r).abs().max().item()
                    assert err <= 2e-2 * max(1.0, r.abs().max().item()), (l, w, name, err)


@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channel_last", [True, False])
def test_gpu_dtypes_layouts_bias_activation_vs_causal_conv1d(dtype, channel_last):
    """fp32 / fp16 / bf16, channel-last and channel-first x, with and without bias and SiLU, widths 2-4, at a length
    below the width (3) and one of two lanes and a partial one (130)."""
    d = 64
    combos = [(True, "silu"), (False, None)] + ([(True, None), (False, "silu")] if dtype == torch.bfloat16 else [])
    for i, (hasb, act) in enumerate(combos):
        for l in (3, 130):
            w = 2 + (i + l) % 3
            g = torch.Generator(device="cpu").manual_seed(i * 100 + l)
            if channel_last:
                x = _cl_input(2, d, l, dtype, seed=i + l)
            else:
                x = torch.randn(2, d, l, generator=g).to("cuda", dtype)
            wt = (0.5 * torch.randn(d, w, generator=g)).to("cuda", dtype)
            bias = (0.2 * torch.randn(d, generator=g)).to("cuda", dtype) if hasb else None
            dy = torch.randn(2, d, l, generator=g).to("cuda", dtype)
            ours, theirs, ref = _vs_causal_conv1d(x, wt, bias, None, act, dy)
            _assert_close_to(ours, theirs, ref, f"{dtype} cl={channel_last} bias={hasb} act={act} l={l} w={w}")


@pytest.mark.skipif(not CPU, reason="interpret-mode test (CPU)")
def test_tuner_compares_final_results_across_lanes_per_program():
    """The conv1d_bwd TuneCase compares dx (written into its argument buffer, poisoned with NaN before
    each checked run) and the summed dweight/dbias, so configs with different lanes per program (different
    partial counts) pass the tuner's check."""
    from kernels import tuner, tuning
    from kernels.causal_conv1d_helion import TUNABLE_KERNELS

    import helion

    case = TUNABLE_KERNELS["conv1d_bwd"](dict(b=1, l=64, h=2, p=8, g=1, n=8, c=16, w=4), torch.device("cpu"))
    assert case.finalize is not None and case.prepare is not None
    c1 = helion.Config(num_warps=4, block_sizes=[1, 16], l_per_lane=16)
    c2 = helion.Config(num_warps=8, block_sizes=[4, 32], l_per_lane=16)

    def run(cfg):
        return tuner.checked_outputs(lambda *a: tuning.run_with_config(case.kernel, a, cfg), case.args,
                                      case.finalize, case.prepare)

    ref = [t.clone() for t in tuner.flatten_outputs(run(c1))]
    assert torch.isfinite(ref[0]).all()  # every dx element written after the NaN poisoning
    got = run(c2)
    ok, err = tuner.outputs_close(got, ref, case.atol, case.rtol)
    assert ok, err
    raw = tuning.run_with_config(case.kernel, case.args, c2)
    assert raw[0].shape[1] == 1 and ref[1].shape == (4, 32)  # 1 partial vs 4; summed (taps, channels)


@pytest.mark.skipif(not CPU, reason="code generation check (CPU)")
@pytest.mark.parametrize("useseq,hasb", [(False, True), (True, False)])
def test_triton_codegen(useseq, hasb, monkeypatch):
    """The conv kernels generate Triton code for strided channel-last input (a zxBCdt slice), with and
    without seq_idx / bias (Helion-side compile errors show up here, on CPU)."""
    import helion

    from kernels import causal_conv1d_helion as cc

    monkeypatch.delenv("HELION_INTERPRET", raising=False)
    b, l, d = 1, 256, 384
    zx = torch.randn(b, l, d + 128).bfloat16()
    x = zx[:, :, 64:64 + d]
    w = torch.randn(d, 4).bfloat16()
    bias = torch.randn(d).bfloat16() if hasb else None
    seq = torch.zeros(b, l, dtype=torch.int32) if useseq else None
    fwd = helion.kernel(cc.causal_conv1d_fwd_kernel.fn, static_shapes=True)
    assert "@triton.jit" in fwd.bind((x, w, bias, seq, True)).to_triton_code(cc.CONV_FWD_DEFAULT)
    bwd = helion.kernel(cc.causal_conv1d_bwd_kernel.fn, static_shapes=True)
    dx = torch.empty_like(zx)[:, :, 64:64 + d]
    code = bwd.bind((x, w, bias, torch.randn(b, l, d).bfloat16(), seq, dx, True)).to_triton_code(cc.CONV_BWD_DEFAULT)
    assert "@triton.jit" in code and code.count("def _helion_") == 1


# ------------------------------------------------------------------------------ lane walk


def _bwd_grads(run, x, wt, bias, seq, act, dy):
    """dx, dweight, dbias from ``causal_conv1d_bwd_kernel`` run by ``run(kernel, args)`` (args as
    ``causal_conv1d_bwd_helion`` builds them), summed as the wrapper does."""
    from kernels import causal_conv1d_helion as cc

    xx, w4, bb, sq, silu, _, _ = cc._conv_prep(x, wt, bias, seq, act)
    dx = torch.full_like(dy.transpose(1, 2), float("nan"))  # (b, l, d); poisoned: every element must be written
    args = (xx.transpose(1, 2), w4, bb, dy.transpose(1, 2), sq, dx, silu)
    dwp, dbp = run(cc.causal_conv1d_bwd_kernel, args)
    w = wt.shape[1]
    dweight = dwp.sum(dim=(0, 1)).t()[:, 4 - w:].to(wt.dtype)
    return dx.transpose(1, 2), dweight, None if bias is None else dbp.sum(dim=(0, 1)).to(bias.dtype)


def _ref_grads(x, wt, bias, seq, act, dy):
    ins = [x.detach().clone().requires_grad_(), wt.detach().clone().requires_grad_()]
    if bias is not None:
        ins.append(bias.detach().clone().requires_grad_())
    y = causal_conv1d_ref(ins[0], ins[1], ins[2] if bias is not None else None, seq, act)
    g = torch.autograd.grad(y, ins, dy)
    return g[0], g[1], g[2] if bias is not None else None


LANE_CASES = [
    # (batch, dim, seqlen, width, seq_idx ("sorted" / "random" / "padded" / None), activation, bias)
    (2, 5, 75, 4, None, "silu", True),  # 5 lanes of 16 rows, the last one partial
    (1, 6, 64, 3, "sorted", "silu", False),  # lanes end exactly at seqlen
    (2, 4, 37, 2, "random", None, True),  # seq ids in any order: only equality matters
    (1, 3, 50, 4, "random", "silu", True),
    (1, 7, 18, 4, "sorted", None, False),
    (2, 5, 41, 4, "padded", "silu", True),  # ids -1..2 in any order: -1 is padding
]


def _lane_case(b, d, l, w, seqkind, act, hasb, dtype):
    x, wt, bias, _ = _make(b, d, l, w, False, True, hasb, dtype)
    g = torch.Generator(device="cpu").manual_seed(1)
    seq = None
    if seqkind is not None:
        seq = torch.randint(-1 if seqkind == "padded" else 0, 3, (b, l), generator=g)
        seq = (torch.sort(seq, dim=1).values if seqkind == "sorted" else seq).to(torch.int32)
    dy = torch.randn(b, d, l, generator=g, dtype=dtype)
    return x, wt, bias, seq, dy


@pytest.mark.skipif(not CPU, reason="interpret-mode test (CPU)")
@pytest.mark.parametrize("b,d,l,w,seqkind,act,hasb", LANE_CASES)
def test_bwd_lane_boundaries_interpret(b, d, l, w, seqkind, act, hasb):
    """The backward with 16-row lanes (the walk's halo rows cross lane boundaries) matches the reference,
    also for seq_idx that is not sorted (an input counts only where its seq id equals the output's)."""
    import helion

    from kernels import tuner, tuning

    x, wt, bias, seq, dy = _lane_case(b, d, l, w, seqkind, act, hasb, torch.float64)
    cfg = helion.Config(block_sizes=[2, 4], num_warps=4, l_per_lane=16)
    got = _bwd_grads(lambda k, a: tuning.run_interpret(k, a, cfg), x, wt, bias, seq, act, dy)
    ref = _ref_grads(x, wt, bias, seq, act, dy)
    for name, a, r in zip(["dx", "dweight", "dbias"], got, ref):
        if r is not None:
            torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5, msg=f"{name} differs")


@pytest.mark.skipif(not CPU, reason="interpret-mode test (CPU)")
@pytest.mark.parametrize("b,d,l,w,seqkind,act,hasb", LANE_CASES)
def test_fwd_lane_boundaries_interpret(b, d, l, w, seqkind, act, hasb):
    """The forward with 16-row lanes (each lane's 3 halo rows are the previous lane's) matches the
    reference, also for unsorted seq_idx; every output element is written."""
    import helion

    from kernels import causal_conv1d_helion as cc
    from kernels import tuner, tuning

    x, wt, bias, seq, _ = _lane_case(b, d, l, w, seqkind, act, hasb, torch.float64)
    xx, w4, bb, sq, silu, _, _ = cc._conv_prep(x, wt, bias, seq, act)
    cfg = helion.Config(block_sizes=[2, 4], num_warps=4, l_per_lane=16)
    got = tuning.run_interpret(cc.causal_conv1d_fwd_kernel, (xx.transpose(1, 2), w4, bb, sq, silu), cfg)
    torch.testing.assert_close(got.transpose(1, 2), causal_conv1d_ref(x, wt, bias, seq, act), atol=1e-5, rtol=1e-5)


def _fwd_out(run, x, wt, bias, seq, act):
    from kernels import causal_conv1d_helion as cc

    xx, w4, bb, sq, silu, _, _ = cc._conv_prep(x, wt, bias, seq, act)
    return run(cc.causal_conv1d_fwd_kernel, (xx.transpose(1, 2), w4, bb, sq, silu)).transpose(1, 2)


def _triton_interpreter_main(seqkind, act, hasb, kind="bwd"):
    """Run in a fresh process with TRITON_INTERPRET=1 (Triton fixes interpret mode for its own
    @jit helpers such as tl.sum at import): the Triton code Helion generates, executed by
    Triton's CPU interpreter, against the reference. This checks the compiled path (loop-carried
    rolling window, masks), which Helion's eager interpret mode does not go through."""
    import importlib.util
    import tempfile

    import helion

    assert os.environ.get("TRITON_INTERPRET") == "1" and "HELION_INTERPRET" not in os.environ
    x, wt, bias, seq, dy = _lane_case(1, 20, 45, 4, seqkind, act, hasb, torch.float32)
    # 2 lanes x 16 channels per program: 3 programs along seqlen (the last one half empty), the
    # second channel tile masked (20 channels)
    cfg = helion.Config(block_sizes=[2, 16], num_warps=4, l_per_lane=16)
    fns = {}

    def run(kernel, args):
        if "f" not in fns:
            code = helion.kernel(kernel.fn, static_shapes=True).bind(args).to_triton_code(cfg)
            # Triton 3.6's interpreter cannot turn a loop bound built from a constexpr argument (a
            # 1-element numpy array there) into a Python int under numpy 2: give range plain ints.
            code = code.replace("tl.range(", "_interp_range(")
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "conv_generated.py")
                with open(path, "w") as f:
                    f.write(code)
                spec = importlib.util.spec_from_file_location("conv_generated", path)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)

            def as_int(v):
                return int(v.handle.data.item()) if hasattr(v, "handle") else int(v)

            mod._interp_range = lambda *a: range(*[as_int(v) for v in a])
            fns["f"] = getattr(mod, kernel.fn.__name__)
        return fns["f"](*args)

    if kind == "fwd":
        out = _fwd_out(run, x, wt, bias, seq, act)
        torch.testing.assert_close(out, causal_conv1d_ref(x, wt, bias, seq, act), atol=1e-4, rtol=1e-4)
        print("forward generated Triton code matches the reference")
        return
    got = _bwd_grads(run, x, wt, bias, seq, act, dy)
    ref = _ref_grads(x, wt, bias, seq, act, dy)
    for name, a, r in zip(["dx", "dweight", "dbias"], got, ref):
        if r is not None:
            torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4, msg=f"{name} differs")
    print("backward generated Triton code matches the reference")


@pytest.mark.skipif(not CPU, reason="Triton interpreter test (CPU)")
@pytest.mark.parametrize("kind", ["bwd", "fwd"])
@pytest.mark.parametrize("seqkind,act,hasb", [(None, "silu", True), ("padded", "silu", False)])
def test_generated_triton_code_interpreted(seqkind, act, hasb, kind):
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "HELION_INTERPRET"}
    env["TRITON_INTERPRET"] = "1"
    cmd = (f"import sys; sys.path[:0] = [{str(root)!r}, {str(root / 'tests')!r}]; "
           f"from test_causal_conv1d import _triton_interpreter_main as m; m({seqkind!r}, {act!r}, {hasb!r}, {kind!r})")
    res = subprocess.run([sys.executable, "-c", cmd], check=False, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
