"""The on-disk layout of ``checkpoint.dir`` and the integrity manifest (plain files; no megatron, no collectives).

Paths (step directories, the tracker, the per-rank RNG files, ``corrupt/``), atomic writes, the completion
manifest ``nano_hybrid_checkpoint.json`` with its per-file CRC-32 checksums (:mod:`nano_hybrid.integrity`),
publication, pruning, setting aside, and the one-line description of a failed write.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path

from nano_hybrid import integrity
from nano_hybrid.checkpoint.ranks import log
from nano_hybrid.errors import EXIT_FAILED, RunError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
META_FILE = "nano_hybrid_checkpoint.json"
FORMAT = "nano-hybrid-checkpoint/1"
CORRUPT_DIR = "corrupt"  # <checkpoint.dir>/corrupt/: checkpoints that failed verification, kept for inspection
RNG_DIR = "rng"  # <step dir>/rng/rank_00000.pt ...: every RNG stream of every rank


class CheckpointError(RunError):
    """A checkpoint that cannot be loaded (missing, incomplete, corrupt or incompatible); one-line message."""


class CheckpointSaveError(CheckpointError):
    """A save that failed (the previous checkpoint stays the one that loads); one-line message."""

    exit_code = EXIT_FAILED


# ------------------------------------------------------------------------------------------ paths
def iter_dir_name(step: int) -> str:
    return f"iter_{step:07d}"


def iteration_of(ckpt: Path) -> int:
    """The step of an ``iter_*`` directory."""
    return int(Path(ckpt).name[len("iter_"):])


def rng_file(ckpt: Path, rank: int) -> Path:
    """The file holding rank ``rank``'s RNG streams in checkpoint ``ckpt``."""
    return Path(ckpt) / RNG_DIR / f"rank_{rank:05d}.pt"


def atomic_write_text(path: Path, text: str) -> None:
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


def write_tracker(root: Path, step: int) -> None:
    atomic_write_text(Path(root) / TRACKER_FILE, f"{step}\n")


def read_tracker(root: Path) -> int | None:
    f = Path(root) / TRACKER_FILE
    if not f.is_file():
        return None
    text = f.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{f} holds {text!r}, not an iteration number")
    return int(text)


# --------------------------------------------------------------------------------------- manifest
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
    log(f"verified {ckpt} ({len(files)} files, {nbytes / 1e9:.2f} GB checksummed in {dt:.2f}s, "
        f"{nbytes / max(dt, 1e-9) / 1e9:.2f} GB/s)")
    return meta


def publish(root: Path, ckpt: Path, meta: dict, cfg_yaml: str | None, keep_last: int | None) -> float:
    """Rank 0, after every rank wrote: config, checksums, manifest (= complete), tracker, pruning.

    Returns the seconds spent on checksums."""
    if cfg_yaml is not None:
        (ckpt / "config.yaml").write_text(cfg_yaml)
    t0 = time.perf_counter()
    files = integrity.list_files(ckpt, exclude=(META_FILE,))
    meta["checksum"] = integrity.ALGORITHM
    meta["files"] = integrity.checksum_files(ckpt, files)
    t_sum = time.perf_counter() - t0
    atomic_write_text(ckpt / META_FILE, json.dumps(meta, indent=1) + "\n")  # complete from here on
    write_tracker(root, meta["iteration"])
    if keep_last:
        prune(root, keep_last)
    return t_sum


# ------------------------------------------------------------------------------ directory queries
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
            it = iteration_of(d)
        except ValueError:
            continue
        (complete if is_complete(d) else incomplete).append((it, d))
    return sorted(complete), [d for _, d in sorted(incomplete)]


def latest_complete(root: Path) -> Path | None:
    """The tracker's checkpoint if it is complete, else the newest complete iter_* dir, else None."""
    complete, _ = list_checkpoints(root)
    it = read_tracker(root)
    if it is not None:
        d = Path(root) / iter_dir_name(it)
        if is_complete(d):
            return d
        log(f"tracker {Path(root) / TRACKER_FILE} names iteration {it} but {d} is not complete; "
            "using the newest complete checkpoint")
    return complete[-1][1] if complete else None


# ------------------------------------------------------------------------------ directory changes
def remove_step_dir(ckpt: Path, *, ignore_errors: bool = True) -> None:
    """Unpublish (manifest first: a crash mid-delete leaves it incomplete), then delete a step directory."""
    (Path(ckpt) / META_FILE).unlink(missing_ok=True)
    shutil.rmtree(ckpt, ignore_errors=ignore_errors)


def fresh_step_dir(root: Path, ckpt: Path) -> None:
    """Rank 0: an empty ``ckpt`` under ``root``; a leftover (an interrupted save, an older timeline) is replaced."""
    root.mkdir(parents=True, exist_ok=True)
    if ckpt.exists():
        remove_step_dir(ckpt, ignore_errors=False)
    ckpt.mkdir(parents=True)


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints (never the tracker's). Rank 0 only."""
    complete, _ = list_checkpoints(root)
    tracked = read_tracker(root)
    for it, d in complete[:-keep_last] if keep_last > 0 else []:
        if it == tracked:
            continue
        remove_step_dir(d)


def remove_incomplete(root: Path) -> list[Path]:
    """Rank 0: the iter_* dirs without a manifest. The one that the tracker names had completed (the tracker is
    written after the manifest, and pruning never deletes it), unless a save of the same step was replacing it: it
    moves to ``corrupt/``, never deleted. While the tracker is unreadable, so does every one at or below the newest
    complete step. The others are saves that never completed or interrupted deletions (a crash during a save or
    pruning) and are deleted. Returns where the set-aside ones went."""
    complete, incomplete = list_checkpoints(root)
    try:
        tracked, readable = read_tracker(root), True
    except CheckpointError:
        tracked, readable = None, False
    newest = complete[-1][0] if complete else -1
    aside = []
    for d in incomplete:
        it = iteration_of(d)
        if it == tracked or (not readable and it <= newest):
            why = (f"no {META_FILE}, although the tracker names this step (it had completed, or a save of the same "
                   "step was replacing it)" if readable else f"no {META_FILE}, and the tracker is unreadable")
            dest = set_aside(d, why)
            log(f"WARNING: {d}: {why}; moved to {dest} (kept for inspection)")
            aside.append(dest)
            continue
        log(f"removing incomplete checkpoint {d}")
        shutil.rmtree(d, ignore_errors=True)
    return aside


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


# ------------------------------------------------------------------------------------ write errors
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
