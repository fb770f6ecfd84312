"""``spawn_ranks(worker, world, *args)``: ``worker(rank, world, *args)`` on ``world`` spawned processes, each with
the launcher's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) set as
torchrun sets it, so that ``init_method="env://"`` (``nano_hybrid.parallel.initialize_parallel`` under a launcher)
joins them.

The calling process hosts the rendezvous store, as torchrun's agent does, on a port the system assigns while it binds
(port 0), and the ranks connect to it as clients (``TORCHELASTIC_USE_AGENT_STORE``): no port is picked free and bound
later, so tests that run side by side cannot take each other's port."""

from __future__ import annotations

import os

import torch.multiprocessing as mp
from torch.distributed import TCPStore


def _rank(rank: int, worker, world: int, port: int, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")  # a client of spawn_ranks' store
    worker(rank, world, *args)


def spawn_ranks(worker, world: int, *args) -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # served until this call returns
    mp.start_processes(_rank, args=(worker, world, store.port, args), nprocs=world, join=True, start_method="spawn")
