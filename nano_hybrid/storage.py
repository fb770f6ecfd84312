"""Storage preflight: before any work, the run and checkpoint directories must take a write and the
checkpoint filesystem must have room for the checkpoints the run keeps.

The expected checkpoint size follows from the model's state: every checkpointed model tensor's global
shape (:func:`nano_hybrid.checkpoint.model_signature`) times the bytes a parameter costs in a checkpoint:
its own dtype, plus 8 bytes of Adam moments (fp32) and, for bf16 parameters, 4 bytes of fp32 main weights.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
from pathlib import Path

from nano_hybrid.errors import RunError

GB = 1e9
PROBE_BYTES = 1 << 16
MARGIN = 1.05  # metadata, RNG files, config


class StorageError(RunError):
    """An unwritable directory or too little free space; one-line message."""


def _why(e: OSError) -> str:
    name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__
    return f"{os.strerror(e.errno) if e.errno else e} [{name}]"


def check_writable(path: str | Path, what: str) -> None:
    """Create ``path`` if needed, then write, fsync and remove a probe file there; StorageError if any step fails."""
    path = Path(path)
    probe = path / f".nano_hybrid_write_probe.{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"\0" * PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
        probe.unlink()
        dfd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
        raise StorageError(f"{what} {path} is not writable: {_why(e)}") from None


def checkpoint_bytes(signature: dict[str, list], param_bytes: int, has_optimizer: bool = True) -> int:
    """Expected size of one checkpoint from the model's global tensor shapes (``model_signature``)."""
    numel = sum(math.prod(s) for s in signature.values() if s and s != ["object"])
    per = param_bytes + ((8 + (4 if param_bytes < 4 else 0)) if has_optimizer else 0)
    return int(numel * per * MARGIN)


def check_free_space(ckpt_dir: str | Path, one_checkpoint: int, extra: int, keep_last: int) -> None:
    """StorageError unless the checkpoint filesystem has room for ``extra`` more checkpoints of ``one_checkpoint`` bytes."""
    ckpt_dir = Path(ckpt_dir)
    free = free_bytes(ckpt_dir)
    need = one_checkpoint * extra
    if free < need:
        keep = f"checkpoint.keep_last={keep_last}" if keep_last else "checkpoint.keep_last=0 (keeps every checkpoint)"
        raise StorageError(
            f"checkpoint.dir {ckpt_dir}: {free / GB:.1f} GB free, this run needs about {need / GB:.1f} GB "
            f"({extra} more checkpoint(s) of ~{one_checkpoint / GB:.1f} GB; {keep}, plus the one being written); "
            "free space, lower checkpoint.keep_last or checkpoint.interval, or set checkpoint.check_free_space=false"
        )


def free_bytes(path: str | Path) -> int:
    path = Path(path)
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free
