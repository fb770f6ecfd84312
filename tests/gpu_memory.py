"""GPU memory leases for pytest-xdist workers that share one GPU (test-only).

Each GPU test holds a lease of its estimated peak memory (``@pytest.mark.gpu_mem(GiB)``, else ``DEFAULT_GIB``) while it
runs; a worker whose test does not fit beside the leases held waits, so the tests that run at once fit the GPU
(``budget_gib``: 85% of its memory, less a CUDA context per worker). A test larger than the budget runs alone. The
leases live in one JSON file per test run, changed under an exclusive ``flock``; the lease of a worker that died is
dropped. After each test the worker returns its cached blocks to the GPU (``torch.cuda.empty_cache``), so a lease ends
with the memory it stood for.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

# The estimates: the fp32 torch reference of the mixer op at Nano widths, forward + backward, peaks at 0.76 GiB at
# 1 x 1024 and 1.16 GiB at 1 x 2048 (measured on the CPU): 0.4 GiB per 1024 tokens over 0.4 GiB, so 6.8 GiB at
# 2 x 8192; a Nano-shape test that also runs the op and keeps gradients is marked 12. A test without a mark runs
# small shapes.
DEFAULT_GIB = 4.0
CONTEXT_GIB = 1.0  # one CUDA context (and the allocator's slack) per worker
GPU_FRACTION = 0.85


def budget_gib(total_bytes: int, workers: int) -> float:
    """GiB that the tests running at once may hold on a GPU of ``total_bytes`` shared by ``workers`` processes."""
    return max(GPU_FRACTION * total_bytes / 2**30 - workers * CONTEXT_GIB, 1.0)


def _start_time(pid: int) -> str:
    """The process's start time (clock ticks since boot, /proc/PID/stat) where /proc has it, else "": a lease names
    its process by (pid, start time), so a pid reused by another process does not keep a dead worker's lease."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return not start or _start_time(pid) == start


class Leases:
    """The leases of one test run in ``path`` (a JSON object pid -> [GiB, the process's start time])."""

    def __init__(self, path: Path, budget: float):
        self.path, self.budget = Path(path), budget

    @contextmanager
    def _locked(self):
        """The leases of live processes ({pid: [GiB, start time]}), changed under the lock and written back whole
        (a temporary file replaced: a worker killed mid-write leaves the previous file)."""
        with open(self.path.with_suffix(".lock"), "a+") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            try:
                try:
                    held = json.loads(self.path.read_text())
                except (OSError, ValueError):
                    held = {}
                held = {pid: v for pid, v in held.items() if pid.isdigit() and isinstance(v, list) and len(v) == 2
                        and _alive(int(pid), v[1])}
                yield held
                tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(held))
                os.replace(tmp, self.path)
            finally:
                fcntl.flock(lk, fcntl.LOCK_UN)

    def try_acquire(self, gib: float, pid: int | None = None) -> bool:
        """Take a lease of ``gib`` for ``pid`` if it fits beside the other processes' leases (or they hold none);
        True if taken."""
        pid = pid or os.getpid()
        with self._locked() as held:
            others = sum(v[0] for k, v in held.items() if k != str(pid))
            if others and others + gib > self.budget:
                return False
            held[str(pid)] = [gib, _start_time(pid)]
            return True

    def acquire(self, gib: float, poll_s: float = 0.2) -> float:
        """Wait for a lease of ``gib``; the seconds waited."""
        t0 = time.monotonic()
        while not self.try_acquire(gib):
            time.sleep(poll_s)
        return time.monotonic() - t0

    def release(self, pid: int | None = None) -> None:
        with self._locked() as held:
            held.pop(str(pid or os.getpid()), None)

    def held(self) -> dict[str, float]:
        """{pid: GiB} of the leases held."""
        with self._locked() as held:
            return {pid: v[0] for pid, v in held.items()}


def run_leases() -> Leases | None:
    """The leases of this xdist run on this machine's GPU; None outside xdist (one process needs no lease)."""
    import torch

    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not uid or not torch.cuda.is_available():
        return None
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return Leases(Path(tempfile.gettempdir()) / f"nano_hybrid_gpu_leases_{uid}.json", budget_gib(total, workers))
