"""This process's place in the run, as the checkpoint package sees it, and the collectives of a save or a load.

:func:`run_layout` is the one function of the package that reads the rank, the world size and the parallel
sizes (torch.distributed and megatron's ``parallel_state``); everything else asks it. The collectives
(:func:`agree`, :func:`share_from_rank0`, :func:`gather`) are no-ops in a single process.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class RunLayout:
    """Rank, world size and parallel sizes of this process (a single process: rank 0 of 1, dp 1)."""

    rank: int = 0
    world_size: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 1

    def parallel(self) -> dict[str, int]:
        """The manifest's ``parallel`` record: world_size, tp, pp, cp, ep, etp, dp."""
        return {k: v for k, v in asdict(self).items() if k != "rank"}


def run_layout() -> RunLayout:
    """This process's rank, world size and parallel sizes (the package's one reader of them)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return RunLayout()
    from megatron.core import parallel_state as ps

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if not ps.model_parallel_is_initialized():
        return RunLayout(rank=rank, world_size=world, dp=world)
    return RunLayout(
        rank=rank,
        world_size=world,
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
    )


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
