"""Graceful exit for long runs: SIGTERM/SIGINT or a wall-clock limit -> finish the step, save, exit 0.

The handler only sets a flag; the training loop calls :meth:`ExitRequest.should_exit` after each step.
All ranks agree through an all-reduce (MAX) of the local flag, as Megatron does for
``--exit-duration-in-mins`` and ``--exit-signal-handler``, so every rank stops after the same step and
takes part in the final checkpoint. A second SIGINT (Ctrl-C twice) raises KeyboardInterrupt at once.
"""

from __future__ import annotations

import signal
import time

import torch

NONE, TIME_LIMIT, SIGNAL = 0, 1, 2
_REASONS = {TIME_LIMIT: "time limit", SIGNAL: "signal"}


class ExitRequest:
    def __init__(self, exit_after_minutes: float | None = None, signals=(signal.SIGTERM, signal.SIGINT),
                 start_time: float | None = None):
        if exit_after_minutes is not None and exit_after_minutes <= 0:
            raise ValueError(f"train.exit_after_minutes must be > 0 or null, got {exit_after_minutes}")
        self.exit_after_s = None if exit_after_minutes is None else 60.0 * float(exit_after_minutes)
        self.start_time = time.monotonic() if start_time is None else start_time
        self.signals = tuple(signals)
        self.received: int | None = None  # signal number
        self._old: dict = {}

    # context manager: handlers are installed only while the loop runs
    def __enter__(self):
        for s in self.signals:
            self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()
        return False

    def _handle(self, signum, frame):
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: stop now
        if self.received is None:
            print(f"[signals] got {signal.Signals(signum).name}: finishing this step, saving a checkpoint, exiting",
                  flush=True)
        self.received = signum

    def local_reason(self) -> int:
        if self.received is not None:
            return SIGNAL
        if self.exit_after_s is not None and time.monotonic() - self.start_time >= self.exit_after_s:
            return TIME_LIMIT
        return NONE

    def should_exit(self) -> str | None:
        """Collective on all ranks: the reason to stop ("signal", "time limit") or None."""
        reason = self.local_reason()
        if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            dev = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
            t = torch.tensor([reason], dtype=torch.int32, device=dev)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            reason = int(t.item())
        return _REASONS.get(reason)
