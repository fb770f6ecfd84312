"""kernels.derived: what the kernels derive from seq_idx is built once per tensor, rebuilt after an in-place write,
dropped with the tensor, and equal to a fresh build; the mixer hands every layer the same seq_idx object."""

import gc
import weakref

import pytest
import torch

from kernels import derived as dv
from kernels.ssd import _pad_seq_idx as pad_ref
from kernels.ssd_helion import _pad_seq_idx, _seq_end
from kernels.ssd_helion_bwd import seq_masks


def _docs(b: int, l: int, cuts: list[int]) -> torch.Tensor:
    s = torch.zeros(b, l, dtype=torch.int32)
    for k in cuts:
        s[:, k:] += 1
    return s


def test_built_once_per_tensor_and_key():
    t = torch.arange(6)
    calls = []

    def build():
        calls.append(1)
        return t * 2

    first = dv.derived(t, "x2", build)
    again = dv.derived(t, "x2", build)
    assert again is first and len(calls) == 1
    assert torch.equal(first, torch.arange(6) * 2)
    dv.derived(t, "other", build)
    assert len(calls) == 2 and dv.cached_keys(t) == ["x2", "other"]  # another key builds its own value
    other = torch.arange(6)  # equal values, another tensor: its own values
    dv.derived(other, "x2", build)
    assert len(calls) == 3 and dv.cached_keys(other) == ["x2"]


def test_rebuilt_after_an_in_place_write_also_through_a_view():
    t = torch.arange(4)
    first = dv.derived(t, "k", lambda: t + 1)
    t.add_(10)
    second = dv.derived(t, "k", lambda: t + 1)
    assert second is not first
    assert torch.equal(second, torch.arange(4) + 11)
    t[2:].zero_()  # a write through a view moves the base's version counter too
    assert dv.cached_keys(t) == []
    assert torch.equal(dv.derived(t, "k", lambda: t + 1), torch.tensor([11, 12, 1, 1]))


def test_values_go_with_their_tensor():
    t = torch.arange(3)
    value = dv.derived(t, "k", lambda: t.clone())
    ref_t, ref_v = weakref.ref(t), weakref.ref(value)
    del t, value
    gc.collect()
    assert ref_t() is None and ref_v() is None  # nothing outside the tensor keeps it or its values alive


def test_inference_mode_builds_per_call_and_keeps_nothing():
    calls = []
    with torch.inference_mode():
        t = torch.arange(4)
        a = dv.derived(t, "k", lambda: calls.append(1) or t + 1)
        b = dv.derived(t, "k", lambda: calls.append(1) or t + 1)
    assert len(calls) == 2 and torch.equal(a, b)
    seq = _docs(1, 32, [9])  # a normal tensor first used under inference mode: an autograd call later still works
    with torch.inference_mode():
        _pad_seq_idx(seq, 48)
    assert dv.cached_keys(seq) == []
    padded = _pad_seq_idx(seq, 48)
    assert not padded.is_inference()

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, s):
            ctx.save_for_backward(s)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2, None

    x = torch.ones(3, requires_grad=True)
    Keep.apply(x, padded).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def _masks_fresh(seq_idx, b, nc, c):
    s = pad_ref(seq_idx, nc * c).reshape(b, nc, c)
    prev_end = torch.cat([torch.zeros_like(s[:, :1, -1]), s[:, :-1, -1]], dim=1)
    return dict(prev_keep=(s == prev_end[:, :, None]).float(), last_keep=(s == s[:, :, -1:]).float(),
                same_seq=(s[:, :, :, None] == s[:, :, None, :]).float(), keep=(s[:, :, -1] == prev_end).float())


@pytest.mark.parametrize("l", [32, 29])  # a whole number of chunks, and a partial last chunk (padded)
def test_seq_masks_pad_and_ends_are_reused_and_follow_the_values(l):
    b, c = 2, 8
    nc = -(-l // c)
    seq = _docs(b, l, [5, 17])
    m1 = seq_masks(seq, b, l, nc, c, seq.device)
    m2 = seq_masks(seq, b, l, nc, c, seq.device)
    assert all(m1[k] is m2[k] for k in m1)
    for k, v in _masks_fresh(seq, b, nc, c).items():
        assert torch.equal(m1[k], v), k
    padded = _pad_seq_idx(seq, nc * c)
    assert _pad_seq_idx(seq, nc * c) is padded
    assert (padded is seq) == (l == nc * c)  # an int32 seq_idx of whole chunks is used as it is
    ends = _seq_end(padded, c)
    assert _seq_end(padded, c) is ends
    assert torch.equal(ends[:, 1:], padded[:, c - 1 :: c]) and bool((ends[:, 0] == 0).all())

    seq[:, 9:] += 1  # a third document boundary, written in place: everything derived follows
    m3 = seq_masks(seq, b, l, nc, c, seq.device)
    for k, v in _masks_fresh(seq, b, nc, c).items():
        assert torch.equal(m3[k], v), k
    assert not torch.equal(m3["same_seq"], m1["same_seq"])
    padded2 = _pad_seq_idx(seq, nc * c)
    assert torch.equal(padded2, pad_ref(seq, nc * c))
    assert torch.equal(_seq_end(padded2, c)[:, 1:], padded2[:, c - 1 :: c])


def test_int64_seq_idx_is_padded_to_int32_once():
    seq = _docs(1, 20, [7]).long()
    p = _pad_seq_idx(seq, 24)
    assert p.dtype == torch.int32 and p.shape == (1, 24) and _pad_seq_idx(seq, 24) is p
    assert torch.equal(p.long(), pad_ref(seq, 24))


def test_mixer_builds_one_seq_idx_per_cu_seqlens():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.ssm.mamba_mixer import MambaMixer

    from nano_hybrid.model.mixer import BackendMambaMixer

    mixer = object.__new__(BackendMambaMixer)  # the method reads only its arguments
    cu = torch.tensor([0, 5, 7, 11], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    first = mixer._create_packed_seq_idx(psp, 16)
    assert mixer._create_packed_seq_idx(psp, 16) is first  # the next layer gets the same object
    assert torch.equal(first, MambaMixer._create_packed_seq_idx(mixer, psp, 16))
    assert first.tolist() == [[0] * 5 + [1] * 2 + [2] * 4 + [3] * 5]
    longer = mixer._create_packed_seq_idx(psp, 20)
    assert longer.shape == (1, 20) and longer is not first
    cu[3] = 12  # written in place: rebuilt from the new values
    assert mixer._create_packed_seq_idx(psp, 16).tolist() == [[0] * 5 + [1] * 2 + [2] * 5 + [3] * 4]
