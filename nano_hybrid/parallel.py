"""torch.distributed + megatron initialisation for a run's parallel layout (``nano_hybrid.layout.ParallelDims``).

    dims = initialize_parallel(cfg)           # torch.distributed, megatron parallel_state, RNG seeds
    ...
    destroy_parallel()
"""

from __future__ import annotations

import datetime

import torch
from omegaconf import DictConfig

from nano_hybrid import mcore_compat
from nano_hybrid.config import ConfigError
from nano_hybrid.layout import ParallelDims


def initialize_parallel(cfg: DictConfig, *, dims: ParallelDims | None = None, backend: str | None = None) -> ParallelDims:
    """Initialise torch.distributed, megatron's parallel_state and the model-parallel RNG seeds for ``dims``
    (default: ``ParallelDims.build(cfg)``, the layout of ``cfg.parallel`` in the launcher's world); returns it.

    Under a launcher (``dims.launched``) uses ``env://``; otherwise a single-process world on an in-process store.
    ``backend``: ``None`` -> nccl with CUDA, gloo without. Seeds: ``cfg.seed + 100 * pp_rank`` for torch/python
    RNGs (megatron's rule), then megatron's model-parallel streams (CUDA tracker on GPU, the CPU tracker on CPU).
    Idempotent for an already initialised megatron state of the same sizes. Megatron's ranks are checked against
    the record's (one rank order for both).
    """
    import random

    from megatron.core import parallel_state as ps

    dims = ParallelDims.build(cfg) if dims is None else dims
    if dims.multi_process and not dims.launched:
        raise ConfigError(f"WORLD_SIZE={dims.world_size} but RANK is not set: start multi-process runs with torchrun "
                          "(python -m nano_hybrid.launch)")
    mcore_compat.apply_mcore_compat()
    _init_process_group(dims, backend)
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(), ps.get_context_parallel_world_size())
        if have != (dims.tp, dims.pp, dims.ep, dims.cp):
            raise RuntimeError(f"megatron parallel state already initialised with TP/PP/EP/CP={have}, "
                               f"requested {(dims.tp, dims.pp, dims.ep, dims.cp)}; call destroy_parallel() first")
    else:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp, context_parallel_size=dims.cp,
            expert_model_parallel_size=dims.ep, expert_tensor_parallel_size=dims.etp,
        )
    have = (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    if have != (dims.tp_rank, dims.dp_rank, dims.pp_rank):
        raise RuntimeError(f"megatron placed rank {dims.rank} at TP/DP/PP rank {have}, the layout record at "
                           f"{(dims.tp_rank, dims.dp_rank, dims.pp_rank)}")
    global _ACTIVE
    _ACTIVE = dims
    seed = int(cfg.seed) + 100 * dims.pp_rank
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    mcore_compat.model_parallel_manual_seed(seed)
    return dims


def _init_process_group(dims: ParallelDims, backend: str | None) -> None:
    """This process's CUDA device (LOCAL_RANK) and the torch.distributed process group (if none exists yet)."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if backend is None:
        backend = "nccl" if cuda else "gloo"
    if cuda:
        if dims.local_rank >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK={dims.local_rank} but only {torch.cuda.device_count()} CUDA device(s) "
                              "are visible")
        torch.cuda.set_device(dims.local_rank)
    if not dist.is_initialized():
        # NCCL: the process group is bound to this rank's device (its communicator is created now, megatron's
        # subgroups split from it, and no collective has to guess the device from the rank)
        kw = dict(timeout=datetime.timedelta(minutes=30),
                  device_id=torch.device("cuda", dims.local_rank) if cuda and "nccl" in backend else None)
        if dims.launched:
            dist.init_process_group(backend, init_method="env://", rank=dims.rank, world_size=dims.world_size, **kw)
        else:
            # one process: an in-process store (no port to pick, so processes started side by side cannot race)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
    elif dist.get_world_size() != dims.world_size:
        raise RuntimeError(f"torch.distributed is already initialised with world size {dist.get_world_size()}, "
                           f"expected {dims.world_size}")


# The record megatron's parallel state was initialised from (initialize_parallel), None before and after a run.
_ACTIVE: ParallelDims | None = None


def active_dims() -> ParallelDims:
    """The layout record of the running job: the one ``initialize_parallel`` set up; a single process (rank 0 of 1)
    when no process group exists. A process group of more than one rank that ``initialize_parallel`` did not set
    up is an error (its layout is unknown here)."""
    import torch.distributed as dist

    if _ACTIVE is not None:
        return _ACTIVE
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(f"a process group of {dist.get_world_size()} ranks without a layout record: set up "
                           "multi-process runs with nano_hybrid.parallel.initialize_parallel")
    return ParallelDims.single()


def destroy_parallel() -> None:
    """Tear down megatron's parallel state and the torch.distributed process group (if any)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    global _ACTIVE
    _ACTIVE = None

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
