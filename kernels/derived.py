"""Tensors derived from an index tensor, built once per tensor and reused.

Every Mamba layer of a step reads the same packed-document ``seq_idx`` (one per micro-batch). What the helion
kernels derive from it (the int32 copy padded to whole chunks, each chunk's last sequence id, the backward's
same-sequence masks) depends on nothing else, so the first call that needs a value builds it and every later call
with the same tensor object, forward or backward, in any layer, gets it with one dictionary lookup.

The values live on the tensor itself (a Python attribute), so they go when the tensor goes: a micro-batch's masks
are freed with its ``seq_idx``, and nothing is keyed by ``id``. A value is rebuilt when the tensor's version counter
has moved since it was built, i.e. after an in-place write through torch (on the tensor or on a view of it). Writes
that torch does not count (through ``.data``, a NumPy or DLPack alias, a custom kernel, a CUDA-graph replay) are not
seen: the index tensors this serves are written by none of them. Under inference mode, or for an inference tensor
(which has no version counter), values are built per call and not kept. The values are shared: callers must not
write to them.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

_ATTR = "_nano_hybrid_derived"  # on the tensor: (its version when the values were built, {key: value})


def derived(t: torch.Tensor, key: Hashable, build: Callable[[], object]):
    """``build()`` the first time ``key`` is asked of tensor ``t`` (and again after ``t`` is written in place);
    the same object afterwards. ``build`` must depend only on ``t``'s values and ``key``, and must not return
    ``t`` itself."""
    if t.is_inference() or torch.is_inference_mode_enabled():
        with torch.no_grad():
            return build()
    entry = t.__dict__.get(_ATTR)
    if entry is None or entry[0] != t._version:
        entry = (t._version, {})
        setattr(t, _ATTR, entry)
    values = entry[1]
    if key not in values:
        with torch.no_grad():
            values[key] = build()
    return values[key]


def cached_keys(t: torch.Tensor) -> list:
    """The keys ``t`` holds values for now (tests, debugging)."""
    entry = t.__dict__.get(_ATTR)
    return [] if entry is None or entry[0] != t._version else list(entry[1])
