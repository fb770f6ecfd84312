"""The checkpoint package's adapter to megatron-core 0.16.1: every megatron call and internal a save or a load uses.

Beside :mod:`nano_hybrid.mcore_compat`, this is the one other place that touches megatron internals: the
dist_checkpointing writer's result queue (``filesystem_async._results_queue``) and the DistributedOptimizer's
per-parameter Adam state. It also holds the public megatron calls of a checkpoint: sharded state dicts,
``dist_checkpointing.save``/``load``, the model signature, the RNG tracker streams. (file:line refer to the
installed megatron-core 0.16.1; see shared/reference/megatron_core_cpu_notes.md.)
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nano_hybrid.checkpoint.layout import CheckpointError, describe_save_failure, rng_file
from nano_hybrid.checkpoint.ranks import gather, run_layout

# Sharding of Megatron's DistributedOptimizer state. ``dp_reshardable`` is the format that saves and
# loads on CPU and GPU in megatron-core 0.16.1 (see docs/ and ../shared/reference/megatron_core_cpu_notes.md).
DISTRIB_OPTIM_SHARDING = "dp_reshardable"


# ---------------------------------------------------------------------------- writer result queue
def _end_with_parent(parent_pid: int) -> None:
    """In a helper process: die when the trainer ``parent_pid`` dies, even by SIGKILL.

    Linux ``PR_SET_PDEATHSIG`` delivers SIGKILL when the parent exits; a watchdog thread that checks the
    parent pid every second covers other platforms and the race before the prctl call.
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass

    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(1.0)

    threading.Thread(target=watch, name="end-with-trainer", daemon=True).start()


def _writer_helper_init(parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _end_with_parent(parent_pid)


_WRITER_MANAGER: list = []


def start_writer_queue() -> None:
    """Start dist_checkpointing's result-queue manager process now, immune to SIGTERM/SIGINT, ending with the trainer.

    megatron-core's checkpoint writer (dist_checkpointing/strategies/filesystem_async.py:51-56) sends its
    results through a ``multiprocessing`` Manager queue whose server process it spawns on the first save and
    caches in the module global ``_results_queue``. Slurm, ``timeout`` and Ctrl-C signal the whole process
    group: a server spawned on demand dies with the trainer's SIGTERM/SIGINT and the final save fails with
    BrokenPipeError. Started here, before any stop signal can arrive, with those signals ignored, it lives
    until the trainer exits: the manager is shut down at interpreter exit, and a trainer killed with
    SIGKILL takes it along (:func:`_end_with_parent`).
    """
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=mp.get_context("spawn"))  # what filesystem_async does, plus the initializer
        manager.start(initializer=_writer_helper_init, initargs=(os.getpid(),))
        filesystem_async._results_queue = manager.Queue()
        _WRITER_MANAGER.append(manager)  # keep the server alive as long as the queue is used


# ------------------------------------------------------------------------------------------ model
def _unwrap(model) -> list:
    from megatron.core.utils import unwrap_model

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [unwrap_model(m) for m in chunks]


def model_sharded_state_dict(model) -> dict:
    """``{"model": ...}`` for one model chunk, ``{"model0": ..., "model1": ...}`` for virtual pipeline chunks."""
    chunks = _unwrap(model)
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(chunks)}


def model_signature(model) -> dict[str, list[int]]:
    """Every checkpointed model tensor's key -> global shape (independent of TP/PP/EP layout)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    sd = model_sharded_state_dict(model)
    apply_factories(sd)
    sig: dict[str, list[int]] = {}
    for v in nested_values(sd):
        if isinstance(v, ShardedTensor):
            sig[v.key] = list(v.global_shape)
        elif isinstance(v, ShardedObject):
            sig[v.key] = ["object"]
    return dict(sorted(sig.items()))


def global_model_signature(model) -> dict[str, list[int]]:
    """model_signature over every rank (collective): with pipeline parallelism each rank holds only its stage's
    layers, so the checkpoint's signature is the union of all ranks' (global keys, global shapes)."""
    sig = model_signature(model)
    if run_layout().world_size > 1:
        for part in gather(sig):
            sig.update(part)
        sig = dict(sorted(sig.items()))
    return sig


def param_element_size(model) -> int:
    """Bytes per element of the model's parameters (4 for a model without parameters)."""
    params = [p for m in _unwrap(model) for p in m.parameters()]
    return params[0].element_size() if params else 4


def nonfinite_parameters(model, limit: int = 3) -> list[str]:
    """Names of (up to ``limit``) model parameters or buffers holding NaN/Inf on this rank."""
    bad = []
    for m in _unwrap(model):
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad.append(name)
                if len(bad) >= limit:
                    return bad
    return bad


# -------------------------------------------------------------------------------------- optimizer
def _distrib_optimizers(optimizer) -> list:
    """The megatron DistributedOptimizer instances inside ``optimizer`` (a ChainedOptimizer or a single one)."""
    if optimizer is None:
        return []
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    return [o for o in opts if isinstance(o, DistributedOptimizer)]


def uses_distributed_optimizer(optimizer) -> bool:
    return bool(_distrib_optimizers(optimizer))


def _init_empty_distrib_optimizer_state(optimizer) -> None:
    """Give a fresh DistributedOptimizer the per-parameter state its ``state_dict()`` expects before a load.

    megatron-core 0.16.1 without Apex/TE falls back to torch Adam, whose ``step`` lives in the per-parameter
    state; ``DistributedOptimizer.state_dict()`` asserts one common step (distrib_optimizer.py:642) and fails
    on an optimizer that has not stepped yet. Zero ``exp_avg``/``exp_avg_sq`` (megatron's own ``init_state_fn``)
    and ``step`` are placeholders that the checkpoint load overwrites in place.
    """
    for o in _distrib_optimizers(optimizer):
        if o.init_state_fn is None:
            continue
        inner = o.optimizer
        if any(len(inner.state[p]) for g in inner.param_groups for p in g["params"]):
            continue
        o.init_state_fn(inner, o.config)
        for g in inner.param_groups:
            for p in g["params"]:
                inner.state[p].setdefault("step", torch.tensor(0.0))


def _restore_adam_steps(optimizer) -> None:
    """Set every parameter's own Adam ``step`` from the loaded param-group step after a DistributedOptimizer load.

    Without Apex/TE (torch Adam keeps ``step`` per parameter), ``DistributedOptimizer.load_state_dict``
    (megatron-core 0.16.1, distrib_optimizer.py:818-823, 939-940) leaves the placeholder step of a fresh
    optimizer in place or one step tensor shared by all parameters, which torch Adam then increments once
    per parameter: the bias correction after a resume is wrong and the run drifts from the uninterrupted
    one. The checkpointed step is in each param group (``param_group["step"]``, written by ``state_dict()``).
    """
    for o in _distrib_optimizers(optimizer):
        for group in o.optimizer.param_groups:
            if group.get("step") is None:
                continue  # Apex/TE fused Adam: the step lives in the param group itself
            for p in group["params"]:
                st = o.optimizer.state.get(p)
                if st and isinstance(st.get("step"), torch.Tensor):
                    st["step"] = torch.tensor(float(group["step"]), dtype=st["step"].dtype)


def _optimizer_sharded_state_dict(optimizer, model_sd: dict, is_loading: bool) -> dict:
    if not hasattr(optimizer, "sharded_state_dict"):
        raise CheckpointError(
            f"optimizer {type(optimizer).__name__} has no sharded_state_dict(): checkpointing needs a "
            "megatron-core optimizer (megatron.core.optimizer.get_megatron_optimizer)"
        )
    if is_loading:
        _init_empty_distrib_optimizer_state(optimizer)
    metadata = {"distrib_optim_sharding_type": DISTRIB_OPTIM_SHARDING}
    msd = model_sd["model"] if "model" in model_sd else model_sd
    return optimizer.sharded_state_dict(msd, is_loading=is_loading, metadata=metadata)


def sharded_state(model, optimizer, *, is_loading: bool) -> dict[str, Any]:
    """The sharded state dict of the model chunks and (when given) the optimizer under ``"optimizer"``."""
    model_sd = model_sharded_state_dict(model)
    state: dict[str, Any] = dict(model_sd)
    if optimizer is not None:
        state["optimizer"] = _optimizer_sharded_state_dict(optimizer, model_sd, is_loading=is_loading)
    return state


# ------------------------------------------------------------------------------------------- RNG
def get_rng_state() -> dict:
    """python, numpy, torch CPU, CUDA (when present) and Megatron's tracker streams of this rank."""
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
        "tracker": None,
    }
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if tracker.is_initialized():
        # model-parallel, data-parallel and expert-parallel streams (names as Megatron registers them)
        state["tracker"] = {k: v.clone() for k, v in tracker.get_states().items()}
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state["tracker"] is not None:
        tracker = tensor_parallel.get_cuda_rng_tracker()
        current = set(tracker.get_states()) if tracker.is_initialized() else set()
        if current and current != set(state["tracker"]):
            raise CheckpointError(
                f"RNG tracker streams differ: checkpoint has {sorted(state['tracker'])}, this run {sorted(current)}"
            )
        tracker.set_states({k: v.clone() for k, v in state["tracker"].items()})


# ------------------------------------------------------------------------------------ write, read
def write_state(ckpt: Path, state: dict) -> None:
    """Every rank: the sharded state (dist_checkpointing) and this rank's RNG streams."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(state, str(ckpt))
    f = rng_file(ckpt, run_layout().rank)
    f.parent.mkdir(exist_ok=True)
    torch.save(get_rng_state(), f)


def load_state(path: Path, model, optimizer) -> dict:
    """Every rank: read ``path`` (dist_checkpointing) into the model chunks and the optimizer; return what was read.

    The returned dict also holds the common part (``scheduler``, ``train_state``, ``wandb_run_id``).
    """
    from megatron.core import dist_checkpointing

    template = sharded_state(model, optimizer, is_loading=True)
    try:
        loaded = dist_checkpointing.load(template, str(path))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 (torch's CheckpointException is a BaseException)
        raise CheckpointError(f"{path}: cannot be read ({describe_save_failure(e, path)})") from None
    chunks = _unwrap(model)
    if len(chunks) == 1:
        chunks[0].load_state_dict(loaded["model"], strict=True)
    else:
        for i, m in enumerate(chunks):
            m.load_state_dict(loaded[f"model{i}"], strict=True)
    if optimizer is not None:
        with torch.no_grad():  # dp_reshardable load copies into leaf views (megatron_core_cpu_notes.md, 5c)
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer)
    return loaded
