"""Tensors derived from an index tensor, built once per tensor and reused.

Every Mamba layer of a step reads the same packed-document ``seq_idx`` (one per micro-batch). What the helion
kernels derive from it (the int32 copy padded to whole chunks, each chunk's last sequence id, the backward's
same-sequence masks) depends on nothing else, so the first layer's call builds it and the other layers', forward
and backward, reuse it: no launches and no host work per layer.

An entry belongs to one tensor object: it is keyed by the object's identity, holds only a weak reference to it
(the entry goes when the tensor does), and is rebuilt when the tensor has been written in place since (its version
counter moved). At most ``MAX_TENSORS`` tensors keep entries (the least recently used goes first), so a long run
holds a few micro-batches' masks, not one per step. The derived tensors are shared: callers must not write to them.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Callable, Hashable

import torch

MAX_TENSORS = 8

# id(tensor) -> (weak reference to it, its version when the entry was made, {key: derived tensor})
_ENTRIES: "OrderedDict[int, tuple[weakref.ref, int, dict]]" = OrderedDict()


def _forget(tid: int, ref: weakref.ref) -> None:
    entry = _ENTRIES.get(tid)
    if entry is not None and entry[0] is ref:
        del _ENTRIES[tid]


def derived(t: torch.Tensor, key: Hashable, build: Callable[[], torch.Tensor]):
    """``build()`` the first time ``key`` is asked of tensor ``t`` (and again after ``t`` is written in place);
    the same result afterwards. ``build`` must depend only on ``t``'s values and ``key``."""
    if t.is_inference():  # no version counter to tell an in-place write: built per call
        with torch.no_grad():
            return build()
    tid = id(t)
    entry = _ENTRIES.get(tid)
    if entry is None or entry[0]() is not t or entry[1] != t._version:
        ref = weakref.ref(t, lambda r, tid=tid: _forget(tid, r))
        entry = (ref, t._version, {})
        _ENTRIES[tid] = entry
        while len(_ENTRIES) > MAX_TENSORS:
            _ENTRIES.popitem(last=False)
    else:
        _ENTRIES.move_to_end(tid)
    values = entry[2]
    if key not in values:
        with torch.no_grad():
            values[key] = build()
    return values[key]


def clear() -> None:
    """Drop every entry (tests; a process that wants the memory back at once)."""
    _ENTRIES.clear()


def cached_count() -> int:
    """How many tensors have entries now."""
    return len(_ENTRIES)
