"""This process's place in the run, as the checkpoint package sees it, and the collectives of a save or a load.

:func:`run_layout` is the package's one way to the rank, the world size and the parallel sizes: the job's layout
record (``nano_hybrid.layout.ParallelDims``, the one ``nano_hybrid.parallel.initialize_parallel`` set up megatron
from). The collectives (:func:`agree`, :func:`share_from_rank0`, :func:`gather`) are no-ops in a single process.
"""

from __future__ import annotations

import torch

from nano_hybrid.layout import ParallelDims


def run_layout() -> ParallelDims:
    """The running job's layout record (rank 0 of 1 without a process group); its ``as_dict()`` is the manifest's
    ``parallel`` record."""
    from nano_hybrid.parallel import active_dims

    return active_dims()


def log(msg: str) -> None:
    """Print ``[checkpoint] msg`` on rank 0."""
    if run_layout().rank == 0:
        print(f"[checkpoint] {msg}", flush=True)


def agree(error: str | None) -> str | None:
    """Collective: the first rank's error message (None when every rank succeeded)."""
    world = run_layout().world_size
    if world == 1:
        return error
    errors: list = [None] * world
    torch.distributed.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


def share_from_rank0(*values):
    """Collective: rank 0's ``values`` on every rank (a tuple, as given)."""
    if run_layout().world_size == 1:
        return values
    box = list(values)
    torch.distributed.broadcast_object_list(box, src=0)
    return tuple(box)


def gather(obj) -> list:
    """Collective: every rank's ``obj``, in rank order."""
    world = run_layout().world_size
    if world == 1:
        return [obj]
    parts: list = [None] * world
    torch.distributed.all_gather_object(parts, obj)
    return parts
