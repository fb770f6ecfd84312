"""``spawn_ranks(worker, world, *args)``: ``worker(rank, world, port, *args)`` on ``world`` spawned processes that
meet at a free 127.0.0.1 port (``MASTER_PORT``).

The port is free when picked, but another process (a parallel test worker) can take it before rank 0 listens on it.
That start, and only that (EADDRINUSE at the rendezvous, before any rank ran the test's work), is tried again on a
new port; any other failure raises."""

from __future__ import annotations

import socket

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, world: int, *args, tries: int = 3) -> None:
    for attempt in range(tries):
        try:
            mp.start_processes(worker, args=(world, free_port(), *args), nprocs=world, join=True,
                               start_method="spawn")
            return
        except mp.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == tries - 1:
                raise
