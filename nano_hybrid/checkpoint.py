"""Checkpoint and resume with megatron-core ``dist_checkpointing`` (Megatron ``torch_dist`` layout).

Layout of ``checkpoint.dir``::

    iter_0000050/                         one checkpoint
        .metadata, __*.distcp, common.pt  dist_checkpointing: model + optimizer (sharded), scheduler,
        metadata.json                     train state, W&B run id (common part)
        rng/rank_00000.pt ...             every RNG stream of every rank
        config.yaml                       the resolved config of the run that saved it
        nano_hybrid_checkpoint.json       written last, atomically: its presence = checkpoint complete
    latest_checkpointed_iteration.txt     tracker (Megatron name), replaced atomically after completion

A checkpoint is complete only once ``nano_hybrid_checkpoint.json`` exists; it is written by rank 0 after
every rank has finished writing, then the tracker is replaced. A crash at any point before leaves the
previous checkpoint as the one that loads. Incomplete directories are removed at the next start
(``checkpoint.load=auto``).

Integrity: the manifest holds the size and CRC-32 checksums (per 64 MiB chunk, :mod:`nano_hybrid.integrity`)
of every other file of the checkpoint. A load verifies them first (``checkpoint.verify``, default on): a
missing, truncated or corrupt file is one line naming it. With ``checkpoint.load=auto`` a checkpoint that
fails verification is moved to ``<dir>/corrupt/`` (never deleted) and the newest one that verifies loads,
with a loud message. A model with a non-finite value is never saved; a save that fails (disk full, I/O
error, permission) is one line naming the cause, its partial directory is removed and the previous
checkpoint stays the one that loads.

Before touching dist_checkpointing, a resume compares the saved ``nano_hybrid_checkpoint.json`` with
the current model (every tensor's global shape, so vocab and layer pattern too) and parallel layout,
and refuses an incompatible checkpoint with one line (:class:`CheckpointError`).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nano_hybrid import integrity
from nano_hybrid.errors import EXIT_FAILED, RunError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
META_FILE = "nano_hybrid_checkpoint.json"
FORMAT = "nano-hybrid-checkpoint/1"
# Sharding of Megatron's DistributedOptimizer state. ``dp_reshardable`` is the format that saves and
# loads on CPU and GPU in megatron-core 0.16.1 (see docs/ and ../shared/reference/megatron_core_cpu_notes.md).
DISTRIB_OPTIM_SHARDING = "dp_reshardable"
CORRUPT_DIR = "corrupt"  # <checkpoint.dir>/corrupt/: checkpoints that failed verification, kept for inspection


class CheckpointError(RunError):
    """A checkpoint that cannot be loaded (missing, incomplete, corrupt or incompatible); one-line message."""


class CheckpointSaveError(CheckpointError):
    """A save that failed (the previous checkpoint stays the one that loads); one-line message."""

    exit_code = EXIT_FAILED


@dataclass
class LoadedCheckpoint:
    path: Path
    train_state: dict  # step, consumed_samples, consumed_tokens (the loop's TrainState fields)
    wandb_run_id: str | None
    meta: dict
    rng_state: dict | None  # this rank's RNG streams (None when the world size changed)


def iter_dir_name(step: int) -> str:
    return f"iter_{step:07d}"


# ----------------------------------------------------------------------------------------- helpers
def _dist() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank() -> int:
    return torch.distributed.get_rank() if _dist() else 0


def _world() -> int:
    return torch.distributed.get_world_size() if _dist() else 1


def _barrier() -> None:
    if _dist():
        torch.distributed.barrier()


def _log(msg: str) -> None:
    if _rank() == 0:
        print(f"[checkpoint] {msg}", flush=True)


def _atomic_write_text(path: Path, text: str) -> None:
    """Write temp file + fsync + os.replace + fsync(dir): readers see the old or the new file, never half."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


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


def _start_checkpoint_writer_queue() -> None:
    """Start dist_checkpointing's result-queue manager process now, immune to SIGTERM/SIGINT, ending with the trainer.

    megatron-core's checkpoint writer (dist_checkpointing/strategies/filesystem_async.py:51-56) sends its
    results through a ``multiprocessing`` Manager queue whose server process it spawns on the first save and
    caches in the module global ``_results_queue``. Slurm, ``timeout`` and Ctrl-C signal the whole process
    group, so that server died with the trainer's SIGTERM/SIGINT and the final save failed with
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


_WRITER_MANAGER: list = []


def _unwrap(model):
    from megatron.core.utils import unwrap_model

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [unwrap_model(m) for m in chunks]


def _model_sharded_state_dict(model) -> dict:
    chunks = _unwrap(model)
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(chunks)}


def model_signature(model) -> dict[str, list[int]]:
    """Every checkpointed model tensor's key -> global shape (independent of TP/PP/EP layout)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    sd = _model_sharded_state_dict(model)
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
    if _world() > 1:
        import torch

        parts: list = [None] * _world()
        torch.distributed.all_gather_object(parts, sig)
        for part in parts:
            sig.update(part)
        sig = dict(sorted(sig.items()))
    return sig


def parallel_layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {"world_size": _world(), "tp": 1, "pp": 1, "cp": 1, "ep": 1, "etp": 1, "dp": _world()}
    return {
        "world_size": _world(),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


def _distrib_optimizers(optimizer) -> list:
    """The megatron DistributedOptimizer instances inside ``optimizer`` (a ChainedOptimizer or a single one)."""
    if optimizer is None:
        return []
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    return [o for o in opts if isinstance(o, DistributedOptimizer)]


def _uses_distributed_optimizer(optimizer) -> bool:
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


# ------------------------------------------------------------------------------ directory queries
def read_meta(ckpt: Path) -> dict | None:
    """The completion manifest (None when absent); an unreadable one is a CheckpointError naming it."""
    f = Path(ckpt) / META_FILE
    if not f.is_file():
        return None
    try:
        meta = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: unreadable checkpoint manifest ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{f}: unreadable checkpoint manifest (not a JSON object)")
    return meta


def verify_checkpoint(ckpt: Path, workers: int | None = None) -> dict:
    """Check every file of a complete checkpoint against the manifest's sizes and checksums; return the manifest.

    Raises CheckpointError naming the first missing, truncated or corrupt file.
    """
    ckpt = Path(ckpt)
    meta = read_meta(ckpt)
    if meta is None:
        raise CheckpointError(f"{ckpt}: not a complete checkpoint (no {META_FILE})")
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{ckpt / META_FILE}: lists no file checksums (saved by an older nano-hybrid?); "
                              "load it with checkpoint.verify=false")
    if meta.get("checksum") != integrity.ALGORITHM:
        raise CheckpointError(f"{ckpt / META_FILE}: checksum algorithm {meta.get('checksum')!r}, expected {integrity.ALGORITHM!r}")
    t0 = time.perf_counter()
    problem = integrity.verify_files(ckpt, files, workers)
    if problem is not None:
        raise CheckpointError(f"checkpoint {ckpt} fails verification: {problem}")
    nbytes = sum(int(v["size"]) for v in files.values())
    dt = time.perf_counter() - t0
    _log(f"verified {ckpt} ({len(files)} files, {nbytes / 1e9:.2f} GB checksummed in {dt:.2f}s, "
         f"{nbytes / max(dt, 1e-9) / 1e9:.2f} GB/s)")
    return meta


def set_aside(ckpt: Path, reason: str) -> Path:
    """Move a checkpoint that fails verification to ``<root>/corrupt/`` (never deleted); return the new path."""
    ckpt = Path(ckpt)
    dest_root = ckpt.parent / CORRUPT_DIR
    dest_root.mkdir(exist_ok=True)
    dest = dest_root / ckpt.name
    n = 1
    while dest.exists():
        dest = dest_root / f"{ckpt.name}.{n}"
        n += 1
    os.replace(ckpt, dest)
    (dest / "WHY.txt").write_text(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {reason}\n")
    return dest


def is_complete(ckpt: Path) -> bool:
    return (Path(ckpt) / META_FILE).is_file()


def list_checkpoints(root: Path) -> tuple[list[tuple[int, Path]], list[Path]]:
    """(complete checkpoints sorted by iteration, incomplete iter_* directories) under ``root``."""
    complete, incomplete = [], []
    if not Path(root).is_dir():
        return complete, incomplete
    for d in sorted(Path(root).glob("iter_*")):
        if not d.is_dir():
            continue
        try:
            it = int(d.name[len("iter_"):])
        except ValueError:
            continue
        (complete if is_complete(d) else incomplete).append((it, d))
    return sorted(complete), [d for _, d in sorted(incomplete)]


def read_tracker(root: Path) -> int | None:
    f = Path(root) / TRACKER_FILE
    if not f.is_file():
        return None
    text = f.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{f} holds {text!r}, not an iteration number")
    return int(text)


def latest_complete(root: Path) -> Path | None:
    """The tracker's checkpoint if it is complete, else the newest complete iter_* dir, else None."""
    complete, _ = list_checkpoints(root)
    it = read_tracker(root)
    if it is not None:
        d = Path(root) / iter_dir_name(it)
        if is_complete(d):
            return d
        _log(f"tracker {Path(root) / TRACKER_FILE} names iteration {it} but {d} is not complete; "
             "using the newest complete checkpoint")
    return complete[-1][1] if complete else None


def remove_incomplete(root: Path) -> None:
    """Rank 0 deletes iter_* dirs that never completed (a crash during save)."""
    if _rank() == 0:
        _remove_incomplete_here(root)
    _barrier()


def _remove_incomplete_here(root: Path) -> None:
    for d in list_checkpoints(root)[1]:
        _log(f"removing incomplete checkpoint {d}")
        shutil.rmtree(d, ignore_errors=True)


def _newest_verified(root: Path, verify: bool) -> Path | None:
    """``auto``: the newest complete checkpoint under ``root`` that verifies; the ones that fail are set aside."""
    root = Path(root)
    _remove_incomplete_here(root)
    set_aside_now: list[str] = []
    while True:
        try:
            ckpt = latest_complete(root)
        except CheckpointError:  # an unreadable tracker: the newest complete checkpoint decides
            (root / TRACKER_FILE).unlink()
            ckpt = latest_complete(root)
        if ckpt is None:
            if set_aside_now:
                raise CheckpointError(
                    f"no checkpoint in {root} verifies (set aside: {', '.join(set_aside_now)}); "
                    "refusing to start from scratch (load one with checkpoint.load=<path> or start over with "
                    "checkpoint.load=none)"
                )
            return None
        try:
            if verify:
                verify_checkpoint(ckpt)
            else:
                read_meta(ckpt)
        except CheckpointError as e:
            dest = set_aside(ckpt, str(e))
            set_aside_now.append(str(dest))
            _log(f"WARNING: {e}")
            _log(f"WARNING: moved {ckpt} to {dest} (kept for inspection); falling back to the previous checkpoint")
            continue
        if set_aside_now:
            _atomic_write_text(root / TRACKER_FILE, f"{int(ckpt.name[len('iter_'):])}\n")
            _log(f"WARNING: resuming from {ckpt}, an older checkpoint; {len(set_aside_now)} newer one(s) failed verification")
        return ckpt


def resolve_load_path(load: str | None, ckpt_dir: str | Path, *, verify: bool = True) -> Path | None:
    """``checkpoint.load`` -> checkpoint dir to load, or None for a fresh start. Rank 0 decides, all ranks get it.

    ``none``/null: fresh start. ``auto``: newest complete checkpoint in ``ckpt_dir`` that verifies (fresh start
    if there is none; one that fails verification is set aside and the previous one is used). A path: an
    ``iter_*`` checkpoint dir, or a checkpoints dir with a tracker file; it must exist, be complete and
    verify, else CheckpointError (never a silent fresh start).
    """
    if load is None or str(load).lower() in ("none", "null", ""):
        return None
    found, error = None, None
    if _rank() == 0:
        try:
            p = _resolve_here(str(load), Path(ckpt_dir), verify)
            found = None if p is None else str(p)
        except CheckpointError as e:
            error = str(e)
    if _world() > 1:
        box = [found, error]
        torch.distributed.broadcast_object_list(box, src=0)
        found, error = box
    if error is not None:
        raise CheckpointError(error, collective=True)
    return None if found is None else Path(found)


REFUSE_FRESH = " (refusing to start from scratch)"  # the training wording; tools that only read a checkpoint drop it


def _resolve_here(load: str, ckpt_dir: Path, verify: bool) -> Path | None:
    if load == "auto":
        return _newest_verified(ckpt_dir, verify) if ckpt_dir.is_dir() else None
    p = Path(load)
    if not p.exists():
        raise CheckpointError(f"checkpoint.load={load}: no such checkpoint{REFUSE_FRESH}")
    found = None
    if is_complete(p):
        found = p
    elif (p / TRACKER_FILE).is_file() or list_checkpoints(p)[0]:
        found = latest_complete(p)
    if found is None:
        raise CheckpointError(
            f"checkpoint.load={load}: not a complete checkpoint (no {META_FILE}; a save was interrupted?)"
            f"{REFUSE_FRESH}"
        )
    if verify:
        verify_checkpoint(found)
    else:
        read_meta(found)
    return found


# ---------------------------------------------------------------------------------- compatibility
def check_compatible(meta: dict, model, optimizer, path: Path) -> None:
    """Refuse, with one line, a checkpoint this model/layout cannot load. Runs before dist_checkpointing."""
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {meta.get('format')!r} (expected {FORMAT})")
    saved, cur = meta["model_signature"], global_model_signature(model)
    missing, unexpected = sorted(set(cur) - set(saved)), sorted(set(saved) - set(cur))
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: model structure differs from the checkpoint ({len(missing)} tensors only in this model, "
            f"e.g. {missing[:2]}; {len(unexpected)} only in the checkpoint, e.g. {unexpected[:2]}; "
            f"the checkpoint was saved by model {meta.get('model_name')!r})"
        )
    for key in cur:
        if saved[key] != cur[key]:
            what = "vocab size" if "embedding" in key or "output_layer" in key else "model shape"
            raise CheckpointError(
                f"{path}: {what} differs: {key} is {saved[key]} in the checkpoint but {cur[key]} in this model"
            )
    if optimizer is not None and meta.get("has_optimizer"):
        s_dist = bool(meta.get("distributed_optimizer"))
        if s_dist != _uses_distributed_optimizer(optimizer):
            raise CheckpointError(
                f"{path}: optimizer state was saved with parallel.use_distributed_optimizer={s_dist}; "
                f"this run uses {not s_dist}; resume with the same setting"
            )
        if s_dist:
            s_lay, c_lay = meta["parallel"], parallel_layout()
            fixed = ("tp", "pp", "cp", "ep", "etp")
            diff = [f"{k} {s_lay[k]}->{c_lay[k]}" for k in fixed if s_lay.get(k) != c_lay[k]]
            if diff:
                raise CheckpointError(
                    f"{path}: distributed-optimizer state ({DISTRIB_OPTIM_SHARDING}) reshards only across data "
                    f"parallel; this run changes {', '.join(diff)}"
                )
    elif optimizer is not None and not meta.get("has_optimizer"):
        raise CheckpointError(f"{path}: checkpoint has no optimizer state; cannot resume training from it")


# -------------------------------------------------------------------------------------- save/load
def _agree(error: str | None) -> str | None:
    """Collective: the first rank's error message (None when every rank succeeded)."""
    if _world() == 1:
        return error
    errors: list = [None] * _world()
    torch.distributed.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


def _os_cause(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``: its chain, or a rank's failure inside torch.distributed.checkpoint."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return None


def describe_save_failure(exc: BaseException, where: Path) -> str:
    """One line: the OS error (ENOSPC, EIO, EACCES/EPERM, ...) behind a failed write, or the exception."""
    os_err = _os_cause(exc)
    if os_err is not None:
        name = errno.errorcode.get(os_err.errno, str(os_err.errno))
        fname = f" ({os_err.filename})" if os_err.filename else ""
        return f"{os.strerror(os_err.errno)} [{name}]{fname}"
    first = (str(exc).strip().splitlines() or [""])[0]
    try:  # writers that lose the errno (torch.save: "unexpected pos ...") on a full disk
        free = shutil.disk_usage(where if where.exists() else where.parent).free
    except OSError:
        free = None
    hint = f"; {free / 2**20:.0f} MiB free on that filesystem (disk full?)" if free is not None and free < 2**30 else ""
    return f"{type(exc).__name__}: {first}{hint}"


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


def _write_state(ckpt: Path, state: dict) -> None:
    """Every rank: the sharded state (dist_checkpointing) and this rank's RNG streams."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(state, str(ckpt))
    (ckpt / "rng").mkdir(exist_ok=True)
    torch.save(get_rng_state(), ckpt / "rng" / f"rank_{_rank():05d}.pt")


def _publish(root: Path, ckpt: Path, meta: dict, cfg_yaml: str | None, keep_last: int | None) -> float:
    """Rank 0, after every rank wrote: config, checksums, manifest (= complete), tracker, pruning.

    Returns the seconds spent on checksums."""
    if cfg_yaml is not None:
        (ckpt / "config.yaml").write_text(cfg_yaml)
    t0 = time.perf_counter()
    files = integrity.list_files(ckpt, exclude=(META_FILE,))
    meta["checksum"] = integrity.ALGORITHM
    meta["files"] = integrity.checksum_files(ckpt, files)
    t_sum = time.perf_counter() - t0
    _atomic_write_text(ckpt / META_FILE, json.dumps(meta, indent=1) + "\n")  # complete from here on
    _atomic_write_text(root / TRACKER_FILE, f"{meta['iteration']}\n")
    if keep_last:
        prune(root, keep_last)
    return t_sum


def save_checkpoint(
    root: str | Path,
    train_state,
    model,
    optimizer=None,
    scheduler=None,
    *,
    config: Any = None,
    wandb_run_id: str | None = None,
    model_name: str | None = None,
    keep_last: int | None = None,
) -> Path:
    """Save everything needed to resume at ``train_state.step`` and publish it atomically. All ranks call it.

    ``train_state`` is the loop's dataclass (step, consumed_samples, consumed_tokens). A model holding a
    non-finite value is refused; a failed write raises CheckpointSaveError (one line, same on every rank)
    after removing the partial directory, so the previous checkpoint stays the one that loads.
    """
    t0 = time.perf_counter()
    root = Path(root)
    step = int(train_state.step)
    ckpt = root / iter_dir_name(step)

    bad = nonfinite_parameters(model)
    problem = _agree(f"{bad} on rank {_rank()}" if bad else None)
    if problem is not None:
        raise CheckpointSaveError(f"refusing to save step {step}: non-finite values in {problem}; the previous "
                                  "checkpoint stays the one that loads", collective=True)

    def attempt(fn) -> None:
        try:
            fn()
            err = None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 (torch's CheckpointException is a BaseException)
            err = describe_save_failure(e, ckpt)
        err = _agree(err)
        if err is not None:
            if _rank() == 0 and ckpt.exists():
                (ckpt / META_FILE).unlink(missing_ok=True)
                shutil.rmtree(ckpt, ignore_errors=True)
            prev = latest_complete(root) if root.is_dir() else None
            keeps = f"{prev} stays the checkpoint that loads" if prev else "no earlier checkpoint exists"
            raise CheckpointSaveError(f"saving checkpoint step {step} to {ckpt} failed: {err}; {keeps}", collective=True)

    def prepare_dir():
        if _rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            if ckpt.exists():  # a leftover from an interrupted save, or an older timeline: unpublish, then replace
                (ckpt / META_FILE).unlink(missing_ok=True)
                shutil.rmtree(ckpt)
            ckpt.mkdir(parents=True)

    attempt(prepare_dir)

    if _world() > 1:  # only rank 0 talks to W&B; the common part must agree on every rank
        box = [wandb_run_id]
        torch.distributed.broadcast_object_list(box, src=0)
        wandb_run_id = box[0]
    signature = global_model_signature(model)  # collective, as the broadcast above: every rank, before any write
    model_sd = _model_sharded_state_dict(model)
    state: dict[str, Any] = dict(model_sd)
    if optimizer is not None:
        state["optimizer"] = _optimizer_sharded_state_dict(optimizer, model_sd, is_loading=False)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    state["train_state"] = asdict(train_state)
    state["wandb_run_id"] = wandb_run_id
    attempt(lambda: _write_state(ckpt, state))

    t_sum = [0.0]

    def publish():
        if _rank() != 0:
            return
        dist_opt = _uses_distributed_optimizer(optimizer)
        meta = {
            "format": FORMAT,
            "iteration": step,
            "train_state": asdict(train_state),
            "wandb_run_id": wandb_run_id,
            "model_name": model_name,
            "model_signature": signature,
            "parallel": parallel_layout(),
            "has_optimizer": optimizer is not None,
            "distributed_optimizer": dist_opt,
            "distrib_optim_sharding_type": DISTRIB_OPTIM_SHARDING if dist_opt else None,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "torch": torch.__version__,
        }
        cfg_yaml = None
        if config is not None:
            from omegaconf import OmegaConf

            cfg_yaml = OmegaConf.to_yaml(config, resolve=True) if OmegaConf.is_config(config) else str(config)
        t_sum[0] = _publish(root, ckpt, meta, cfg_yaml, keep_last)

    attempt(publish)
    _log(f"saved {ckpt} (step {step}) in {time.perf_counter() - t0:.2f}s (checksums {t_sum[0]:.2f}s)")
    return ckpt


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints (never the tracker's). Rank 0 only."""
    complete, _ = list_checkpoints(root)
    tracked = read_tracker(root)
    for it, d in complete[:-keep_last] if keep_last > 0 else []:
        if it == tracked:
            continue
        (d / META_FILE).unlink(missing_ok=True)  # unpublish first: a crash mid-delete leaves it incomplete
        shutil.rmtree(d, ignore_errors=True)


def load_checkpoint(path: str | Path, model, optimizer=None, scheduler=None, *, restore_rng: bool = True) -> LoadedCheckpoint:
    """Load a complete checkpoint into model/optimizer/scheduler; restore this rank's RNG streams unless told not to.

    (A DataLoader draws from the global torch RNG when its iterator is created: restore the RNG after
    building the data iterator, with ``restore_rng=False`` here and :func:`set_rng_state` later.)
    """
    from megatron.core import dist_checkpointing

    path = Path(path)
    meta = read_meta(path)
    if meta is None:
        raise CheckpointError(f"{path}: not a complete checkpoint (no {META_FILE})")
    check_compatible(meta, model, optimizer, path)

    model_sd = _model_sharded_state_dict(model)
    template: dict[str, Any] = dict(model_sd)
    if optimizer is not None:
        template["optimizer"] = _optimizer_sharded_state_dict(optimizer, model_sd, is_loading=True)
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
    if scheduler is not None:
        if "scheduler" not in loaded:
            raise CheckpointError(f"{path}: checkpoint has no scheduler state")
        scheduler.load_state_dict(loaded["scheduler"])

    rng_file = path / "rng" / f"rank_{_rank():05d}.pt"
    rng_state = None
    if meta["parallel"]["world_size"] == _world():
        if not rng_file.is_file():
            raise CheckpointError(f"{rng_file}: missing (this rank's RNG streams)")
        try:
            rng_state = torch.load(rng_file, weights_only=False)
        except Exception as e:  # noqa: BLE001 (torch.load raises many types for a damaged file)
            raise CheckpointError(f"{rng_file}: unreadable ({type(e).__name__}: {e})") from None
        if restore_rng:
            set_rng_state(rng_state)
    else:
        _log(f"world size changed ({meta['parallel']['world_size']} -> {_world()}): RNG streams are not restored; "
             "the run continues but is not bitwise reproducible")
    ts = dict(loaded["train_state"])
    _log(f"loaded {path} (step {ts['step']}, {ts['consumed_samples']} samples, {ts['consumed_tokens']} tokens)")
    return LoadedCheckpoint(path=path, train_state=ts, wandb_run_id=loaded.get("wandb_run_id"), meta=meta,
                            rng_state=rng_state)


class Checkpointer:
    """The training loop's handle on ``cfg.checkpoint``. All ranks call every method.

    Usage in a training loop::

        ckpt = Checkpointer(cfg)
        ckpt.locate()                    # early: ckpt.resume_wandb_run_id is known before W&B starts
        ckpt.resume(model, optimizer, scheduler, state)   # fills the TrainState dataclass in place
        data_iterator = ...              # starts at state.consumed_samples
        ckpt.restore_rng()               # after the data iterator (DataLoader.__iter__ draws from the RNG)
        ... after each step: ckpt.maybe_save(state, model, optimizer, scheduler, wandb_run_id=...)
        ... on a stop request or at the end: ckpt.save_final(state, ...)
    """

    def __init__(self, cfg):
        c = cfg.checkpoint
        if c.dir in (None, ""):
            raise CheckpointError("checkpoint.dir is empty")
        self.cfg = cfg
        self.dir = Path(str(c.dir))
        self.interval = int(c.interval or 0)
        self.keep_last = int(c.keep_last or 0)
        self.load = None if c.load is None else str(c.load)
        self.save_on_exit = bool(c.save_on_exit)
        self.verify = bool(c.get("verify", True))
        if self.interval < 0 or self.keep_last < 0:
            raise CheckpointError(f"checkpoint.interval ({self.interval}) and keep_last ({self.keep_last}) must be >= 0")
        self.last_saved_step: int | None = None
        _start_checkpoint_writer_queue()
        self._located = False
        self.load_path: Path | None = None
        self.load_meta: dict | None = None
        self._rng_state: dict | None = None

    def locate(self) -> Path | None:
        """Resolve ``checkpoint.load`` once (raises CheckpointError for a bad explicit path)."""
        if not self._located:
            self.load_path = resolve_load_path(self.load, self.dir, verify=self.verify)
            self.load_meta = read_meta(self.load_path) if self.load_path is not None else None
            self._located = True
        return self.load_path

    @property
    def resume_wandb_run_id(self) -> str | None:
        self.locate()
        return None if self.load_meta is None else self.load_meta.get("wandb_run_id")

    def resume(self, model, optimizer, scheduler, train_state, *, init_from_hf: str | None = None) -> LoadedCheckpoint | None:
        """Load the located checkpoint (None: fresh start, from the initial weights or from ``init_from_hf``, the
        Hugging Face folder they were loaded from); RNG waits for :meth:`restore_rng`."""
        path = self.locate()
        if path is None:
            start = f"the Hugging Face weights in {init_from_hf}" if init_from_hf else "freshly initialised weights"
            _log(f"no checkpoint to resume (checkpoint.load={self.load}, dir {self.dir}); training starts from {start}")
            return None
        loaded = load_checkpoint(path, model, optimizer, scheduler, restore_rng=False)
        names = {f.name for f in fields(train_state)}
        if set(loaded.train_state) != names:
            raise CheckpointError(f"{path}: train state has fields {sorted(loaded.train_state)}, expected {sorted(names)}")
        for k, v in loaded.train_state.items():
            setattr(train_state, k, v)
        self._rng_state = loaded.rng_state
        self.last_saved_step = train_state.step
        return loaded

    @property
    def resume_step(self) -> int:
        """The step the run continues from (0 for a fresh start)."""
        self.locate()
        return 0 if self.load_meta is None else int(self.load_meta["iteration"])

    def extra_checkpoints(self, train_iters: int) -> int:
        """How many more checkpoints than the directory holds now this run needs room for at its peak
        (a new one is written before the oldest beyond ``keep_last`` is pruned)."""
        start = self.resume_step
        new = (train_iters // self.interval - start // self.interval) if self.interval else 0
        new += int(self.save_on_exit and (not self.interval or train_iters % self.interval != 0))
        have = len(list_checkpoints(self.dir)[0]) if self.dir.is_dir() else 0
        peak = have + new if not self.keep_last else min(have + new, self.keep_last + 1)
        return max(min(new, 1), peak - have)

    def check_free_space(self, model, optimizer, train_iters: int) -> int:
        """Rank 0: StorageError unless ``dir`` has room for the checkpoints this run adds; returns one's bytes."""
        from nano_hybrid import storage

        params = [p for m in _unwrap(model) for p in m.parameters()]
        one = storage.checkpoint_bytes(model_signature(model), params[0].element_size() if params else 4,
                                       has_optimizer=optimizer is not None)
        storage.check_free_space(self.dir, one, self.extra_checkpoints(train_iters), self.keep_last)
        return one

    def restore_rng(self) -> None:
        if self._rng_state is not None:
            set_rng_state(self._rng_state)
            self._rng_state = None

    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0 and step != self.last_saved_step

    def save(self, train_state, model, optimizer=None, scheduler=None, *, wandb_run_id=None) -> Path | None:
        if train_state.step == self.last_saved_step:
            return None  # already saved at this step
        model_name = self.cfg.model.get("name") if "model" in self.cfg else None
        path = save_checkpoint(self.dir, train_state, model, optimizer, scheduler, config=self.cfg,
                               wandb_run_id=wandb_run_id, model_name=model_name, keep_last=self.keep_last)
        self.last_saved_step = train_state.step
        return path

    def maybe_save(self, train_state, model, optimizer=None, scheduler=None, *, wandb_run_id=None) -> Path | None:
        if self.due(train_state.step):
            return self.save(train_state, model, optimizer, scheduler, wandb_run_id=wandb_run_id)
        return None

    def save_final(self, train_state, model, optimizer=None, scheduler=None, *, wandb_run_id=None) -> Path | None:
        """At the end of training or on a stop request: save unless ``checkpoint.save_on_exit=false``."""
        if not self.save_on_exit or train_state.step == 0:
            return None
        return self.save(train_state, model, optimizer, scheduler, wandb_run_id=wandb_run_id)
