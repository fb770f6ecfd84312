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

Modules:

- :mod:`~nano_hybrid.checkpoint.layout`: the files above (paths, tracker, manifest and checksums,
  atomic writes, publication, pruning, ``corrupt/``); no megatron, no collectives;
- :mod:`~nano_hybrid.checkpoint.mcore_io`: every megatron call of a save or a load (sharded state dicts,
  dist_checkpointing, the writer's result queue, the DistributedOptimizer's Adam steps, RNG streams);
- :mod:`~nano_hybrid.checkpoint.manager`: the settings check, the resume choice, save/load and
  :class:`Checkpointer`;
- :mod:`~nano_hybrid.checkpoint.ranks`: :func:`run_layout`, the one reader of rank, world size and parallel
  sizes, and the collectives.
"""

from nano_hybrid.checkpoint.layout import (
    META_FILE,
    TRACKER_FILE,
    CheckpointError,
    CheckpointSaveError,
    iter_dir_name,
    latest_complete,
    list_checkpoints,
    read_meta,
    verify_checkpoint,
)
from nano_hybrid.checkpoint.manager import (
    REFUSE_FRESH,
    Checkpointer,
    LoadedCheckpoint,
    check_compatible,
    check_settings,
    load_checkpoint,
    resolve_load_path,
    save_checkpoint,
)
from nano_hybrid.checkpoint.mcore_io import get_rng_state, model_signature, set_rng_state
from nano_hybrid.checkpoint.ranks import run_layout

__all__ = [
    "META_FILE",
    "REFUSE_FRESH",
    "TRACKER_FILE",
    "CheckpointError",
    "CheckpointSaveError",
    "Checkpointer",
    "LoadedCheckpoint",
    "check_compatible",
    "check_settings",
    "get_rng_state",
    "iter_dir_name",
    "latest_complete",
    "list_checkpoints",
    "load_checkpoint",
    "model_signature",
    "read_meta",
    "resolve_load_path",
    "run_layout",
    "save_checkpoint",
    "set_rng_state",
    "verify_checkpoint",
]
