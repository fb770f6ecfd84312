"""The shape space of the helion backend's Mamba-2 ops, stated once and checked before any work.

================  ==================================================================================================
dim               supported
================  ==================================================================================================
batch, seqlen     any >= 1 (lengths that are not a multiple of the chunk are padded to whole chunks internally;
                  a kernel whose arguments reach past 2^31 elements runs with 64-bit indices)
nheads            any >= 1
ngroups           1 .. nheads, dividing nheads (Mamba2 layouts: 1 group; Nemotron-H / Nano: 8)
headdim           a power of two, 8 .. 256 (each head's (headdim, dstate) state is one tile)
dstate            a power of two, 8 .. 256
chunk_size        a power of two, 16 .. 256 (Megatron: 128, Mamba2 checkpoints: 256)
tiles             headdim x dstate, chunk x headdim and chunk x dstate each at most 128 KiB in the input dtype
                  (whole tiles in shared memory; 16-bit dtypes: every size above; float32: each at most 32768
                  elements, so 256 x 256 states, or chunk 256 with headdim 256 or dstate 256, are refused)
conv width        2 .. 4 (run as width 4 with zero leading taps)
seq_idx           None, or int (batch, seqlen) document ids (packed documents; negative ids mark padding)
dtype (x/zxbcdt)  bfloat16, float16, float32
================  ==================================================================================================

``check_supported`` refuses anything else with one ``UnsupportedShapeError`` naming the dim, before any kernel runs.
Within this space, a kernel that this GPU refuses to launch with every config (``kernels.first_use.tuned_call``) is
one ``UnsupportedShapeError`` naming the kernel and the shape.
CPU tests in interpret mode cover the grid at small sizes (``tests/test_shape_space.py``), and its GPU tests the
corners (state 256 x 256 at chunk 256 in bf16; in fp32 state 128 x 256 at chunk 128 and state 128 x 128 at chunk
256; dims of 8 with 3 heads); on the
GPU the grid benchmark (``scripts/bench_shape_grid.py``) runs the Mamba-2 layouts of several models.
"""

from __future__ import annotations

import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
POW2_RANGES = {"headdim": (8, 256), "dstate": (8, 256), "chunk_size": (16, 256)}
CONV_WIDTHS = (2, 3, 4)
# A head's (headdim, dstate) state and a chunk's (chunk, headdim) and (chunk, dstate) blocks are single tiles of the
# SSD kernels' dots; above this many bytes no config of ssd_bwd_dc_dcb fits a Hopper block's 227 KiB of shared memory
# (fp32 state 256 x 256: 272 KiB with the smallest block size; fp32 B block 256 x 256: 256 KiB at every block size).
MAX_TILE_BYTES = 128 * 1024


def padded_len(l: int, chunk_size: int) -> int:
    """The sequence length the Mamba-2 kernels run at: l rounded up to a multiple of ``chunk_size``."""
    return -(-l // chunk_size) * chunk_size


class UnsupportedShapeError(ValueError):
    """A dim or option of a call that the helion backend does not support (one line naming it)."""


def _pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


def check_supported(*, nheads: int, headdim: int, ngroups: int, dstate: int, chunk_size: int,
                    dtype: torch.dtype | None = None, conv_width: int | None = None, seq_idx=None,
                    batch: int | None = None, seqlen: int | None = None, op: str = "helion backend") -> None:
    """Raise ``UnsupportedShapeError`` for the first dim outside the supported space (see the module doc)."""
    def refuse(what: str) -> None:
        raise UnsupportedShapeError(f"{op}: {what} is not supported (supported shapes: kernels/shapes.py)")

    if not isinstance(nheads, int) or nheads < 1:
        refuse(f"nheads={nheads!r}")
    if not isinstance(ngroups, int) or ngroups < 1 or ngroups > nheads or nheads % ngroups:
        refuse(f"ngroups={ngroups!r} with nheads={nheads} (ngroups must divide nheads)")
    for name, v in (("headdim", headdim), ("dstate", dstate), ("chunk_size", chunk_size)):
        lo, hi = POW2_RANGES[name]
        if not _pow2(v) or not lo <= v <= hi:
            refuse(f"{name}={v!r} (a power of two in {lo}..{hi})")
    if dtype is not None and dtype not in DTYPES:
        refuse(f"dtype {dtype} (bfloat16, float16 or float32)")
    if dtype is not None:
        size = torch.empty((), dtype=dtype).element_size()
        for what, elems in ((f"headdim x dstate = {headdim} x {dstate}", headdim * dstate),
                            (f"chunk_size x headdim = {chunk_size} x {headdim}", chunk_size * headdim),
                            (f"chunk_size x dstate = {chunk_size} x {dstate}", chunk_size * dstate)):
            if elems * size > MAX_TILE_BYTES:
                refuse(f"{what} in {str(dtype).replace('torch.', '')} ({elems * size // 1024} KiB tiles; at most "
                       f"{MAX_TILE_BYTES // 1024} KiB: {MAX_TILE_BYTES // size} elements)")
    if conv_width is not None and conv_width not in CONV_WIDTHS:
        refuse(f"conv width {conv_width} (2..4)")
    if batch is not None and batch < 1:
        refuse(f"batch={batch}")
    if seqlen is not None and seqlen < 1:
        refuse(f"seqlen={seqlen}")
    if seq_idx is not None:
        if seq_idx.dtype.is_floating_point or seq_idx.dtype == torch.bool:
            refuse(f"seq_idx of dtype {seq_idx.dtype} (integer document ids)")
        if batch is not None and seqlen is not None and tuple(seq_idx.shape) != (batch, seqlen):
            refuse(f"seq_idx of shape {tuple(seq_idx.shape)} (must be (batch, seqlen) = {(batch, seqlen)})")
