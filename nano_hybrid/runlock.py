"""One trainer per run directory: an exclusive lock on ``<run_dir>/.nano_hybrid.lock``, held by rank 0.

The lock is an ``flock`` on the lock file (released by the kernel when the holder dies, however it dies)
and the file names the holder (host, pid, start time, command) so a second trainer can say who runs there.
A lock file left by a dead process (``kill -9``, a node crash) is stale: the next trainer takes it over and
says so. Filesystems without ``flock`` fall back to the holder's pid: a lock whose process no longer runs
on this host is stale; a holder on another host cannot be checked and is named in the error.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from nano_hybrid.errors import RunError

LOCK_FILE = ".nano_hybrid.lock"


class RunLockError(RunError):
    """The run directory is in use by another trainer; one-line message naming it."""


def _holder_text(info: dict | None) -> str:
    if not info:
        return "another process (the lock file names none)"
    cmd = info.get("argv")
    cmd = " ".join(cmd)[:160] if isinstance(cmd, list) else "?"
    return f"pid {info.get('pid')} on {info.get('host')} since {info.get('started')} ({cmd})"


def _read(fd: int) -> dict | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 1 << 16)
        return json.loads(data) if data.strip() else None
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """``with RunLock(run_dir): ...`` or ``acquire()`` / ``release()``. Released at exit in any case."""

    def __init__(self, run_dir: str | Path, log=print):
        self.path = Path(run_dir) / LOCK_FILE
        self.log = log
        self.fd: int | None = None
        self.stale: dict | None = None  # the dead holder a takeover replaced

    def _info(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": list(sys.argv)}

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(20):  # retry when the file was replaced between open and lock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                raise RunLockError(f"run_dir {self.path.parent} is in use by {_holder_text(holder)}; "
                                   f"one trainer per run directory (lock {self.path})") from None
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    os.close(fd)
                    raise
                self._pid_fallback(fd)
                return self
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the previous holder removed the file after we opened it
                os.close(fd)
                continue
            self._take(fd)
            return self
        raise RunLockError(f"could not lock {self.path}: the file keeps being replaced")

    def _pid_fallback(self, fd: int) -> None:
        info = _read(fd)
        if info and info.get("pid") != os.getpid():
            if info.get("host") != socket.gethostname() or _alive(int(info.get("pid", 0))):
                os.close(fd)
                raise RunLockError(f"run_dir {self.path.parent} is in use by {_holder_text(info)}; one trainer per "
                                   f"run directory (lock {self.path}; delete it if that process is gone)")
        self._take(fd)

    def _take(self, fd: int) -> None:
        old = _read(fd)
        if old and old.get("pid") != os.getpid():
            self.stale = old
            self.log(f"[runlock] taking over a stale lock of {_holder_text(old)}: that process is gone")
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(self._info()) + "\n").encode())
        os.fsync(fd)
        self.fd = fd
        atexit.register(self.release)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still holding the lock; waiters re-check the inode
        finally:
            os.close(self.fd)  # drops the flock
            self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
        return False
