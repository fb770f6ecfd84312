"""kernels.derived: what the kernels derive from seq_idx is built once per tensor, rebuilt after an in-place write,
dropped with the tensor, and equal to a fresh build; the mixer hands every layer the same seq_idx object."""

import gc

import pytest
import torch

from kernels import derived as dv
from kernels.ssd import _pad_seq_idx as pad_ref
from kernels.ssd_helion import _pad_seq_idx, _seq_end
from kernels.ssd_helion_bwd import seq_masks


@pytest.fixture(autouse=True)
def _empty():
    dv.clear()
    yield
    dv.clear()


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
    assert len(calls) == 2  # another key builds its own value
    other = torch.arange(6)  # equal values, another tensor: its own entry
    dv.derived(other, "x2", build)
    assert len(calls) == 3 and dv.cached_count() == 2


def test_rebuilt_after_an_in_place_write():
    t = torch.arange(4)
    first = dv.derived(t, "k", lambda: t + 1)
    t.add_(10)
    second = dv.derived(t, "k", lambda: t + 1)
    assert second is not first
    assert torch.equal(second, torch.arange(4) + 11)


def test_entry_goes_with_its_tensor_and_the_number_of_tensors_is_bounded():
    t = torch.arange(3)
    dv.derived(t, "k", lambda: t.clone())
    assert dv.cached_count() == 1
    del t
    gc.collect()
    assert dv.cached_count() == 0
    keep = [torch.arange(3) for _ in range(dv.MAX_TENSORS + 3)]
    for x in keep:
        dv.derived(x, "k", lambda x=x: x + 1)
    assert dv.cached_count() == dv.MAX_TENSORS
    calls = []
    dv.derived(keep[0], "k", lambda: calls.append(1) or keep[0] + 1)  # the oldest went first
    assert calls == [1]
    dv.derived(keep[-1], "k", lambda: calls.append(2) or keep[-1] + 1)  # the newest is still there
    assert calls == [1]


def test_inference_tensors_are_built_per_call():
    with torch.inference_mode():
        t = torch.arange(4)
        calls = []
        a = dv.derived(t, "k", lambda: calls.append(1) or t + 1)
        b = dv.derived(t, "k", lambda: calls.append(1) or t + 1)
    assert len(calls) == 2 and torch.equal(a, b) and dv.cached_count() == 0


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
