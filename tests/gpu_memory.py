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

# The estimates: the fp32 torch reference of the mixer op at Nano widths, forward + backward, peaks at about 0.4 GiB
# per 1024 tokens (measured on the CPU at 1 x 1024 and 1 x 2048): 6.8 GiB at 2 x 8192, so a Nano-shape test that
# also runs the op and keeps gradients is marked 12; a test without a mark runs small shapes.
DEFAULT_GIB = 4.0
CONTEXT_GIB = 1.0  # one CUDA context (and the allocator's slack) per worker
GPU_FRACTION = 0.85


def budget_gib(total_bytes: int, workers: int) -> float:
    """GiB that the tests running at once may hold on a GPU of ``total_bytes`` shared by ``workers`` processes."""
    return max(GPU_FRACTION * total_bytes / 2**30 - workers * CONTEXT_GIB, 1.0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Leases:
    """The leases of one test run in ``path`` (a JSON object pid -> GiB)."""

    def __init__(self, path: Path, budget: float):
        self.path, self.budget = Path(path), budget

    @contextmanager
    def _locked(self):
        with open(self.path.with_suffix(".lock"), "a+") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            try:
                held = json.loads(self.path.read_text()) if self.path.exists() else {}
                held = {pid: gib for pid, gib in held.items() if _alive(int(pid))}
                yield held
                self.path.write_text(json.dumps(held))
            finally:
                fcntl.flock(lk, fcntl.LOCK_UN)

    def try_acquire(self, gib: float, pid: int | None = None) -> bool:
        """Take a lease of ``gib`` for ``pid`` if it fits beside the leases held (or none is held); True if taken."""
        pid = str(pid or os.getpid())
        with self._locked() as held:
            others = sum(v for k, v in held.items() if k != pid)
            if held and others + gib > self.budget:
                return False
            held[pid] = gib
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
        with self._locked() as held:
            return dict(held)


def run_leases() -> Leases | None:
    """The leases of this xdist run on this machine's GPU; None outside xdist (one process needs no lease)."""
    import torch

    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not uid or not torch.cuda.is_available():
        return None
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return Leases(Path(tempfile.gettempdir()) / f"nano_hybrid_gpu_leases_{uid}.json", budget_gib(total, workers))
