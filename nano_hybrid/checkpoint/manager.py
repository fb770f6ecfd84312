"""The training loop's checkpoint logic: the settings check, which checkpoint to resume, save and load, and
:class:`Checkpointer` (save policy, resume, RNG restore).

Files come from :mod:`nano_hybrid.checkpoint.layout`, megatron calls from :mod:`nano_hybrid.checkpoint.mcore_io`,
the rank and the collectives from :mod:`nano_hybrid.checkpoint.ranks`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from nano_hybrid.checkpoint import layout, mcore_io
from nano_hybrid.checkpoint.layout import FORMAT, META_FILE, TRACKER_FILE, CheckpointError, CheckpointSaveError
from nano_hybrid.checkpoint.mcore_io import DISTRIB_OPTIM_SHARDING, global_model_signature, uses_distributed_optimizer
from nano_hybrid.checkpoint.ranks import agree, log, run_layout, share_from_rank0
from nano_hybrid.config import ConfigError
from nano_hybrid.schema import CheckpointSchema, optional_defaults

# the schema's defaults, for the keys a plain mapping (tests, tools) may leave out
_CHECKPOINT_DEFAULTS = optional_defaults(CheckpointSchema)
REFUSE_FRESH = " (refusing to start from scratch)"  # the training wording; tools that only read a checkpoint drop it


@dataclass
class LoadedCheckpoint:
    path: Path
    train_state: dict  # step, consumed_samples, consumed_tokens (the loop's TrainState fields)
    wandb_run_id: str | None
    meta: dict
    rng_state: dict | None  # this rank's RNG streams (None when the world size changed)


# --------------------------------------------------------------------------------------- settings
def check_settings(c) -> None:
    """ConfigError naming the first bad ``checkpoint.*`` setting; ``c`` is ``cfg.checkpoint``. Validation calls it."""
    for key in ("interval", "keep_last"):
        v = c.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ConfigError(f"checkpoint.{key}={v!r} must be a whole number or null")
    for key in ("verify", "check_free_space", "allow_data_change"):
        v = c.get(key, _CHECKPOINT_DEFAULTS[key])
        if not isinstance(v, bool):
            raise ConfigError(f"checkpoint.{key}={v!r} must be true or false")
    if c.get("dir") in (None, ""):
        raise ConfigError("checkpoint.dir is empty")
    interval, keep_last = int(c.get("interval") or 0), int(c.get("keep_last") or 0)
    if interval < 0 or keep_last < 0:
        raise ConfigError(f"checkpoint.interval ({interval}) and keep_last ({keep_last}) must be >= 0")


# ------------------------------------------------------------------------------- resume choice
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
    if run_layout().rank == 0:
        try:
            p = _resolve_here(str(load), Path(ckpt_dir), verify)
            found = None if p is None else str(p)
        except CheckpointError as e:
            error = str(e)
    found, error = share_from_rank0(found, error)
    if error is not None:
        raise CheckpointError(error, collective=True)
    return None if found is None else Path(found)


def _check_readable(ckpt: Path, verify: bool) -> None:
    if verify:
        layout.verify_checkpoint(ckpt)
    else:
        layout.read_meta(ckpt)


def _resolve_here(load: str, ckpt_dir: Path, verify: bool) -> Path | None:
    if load == "auto":
        return _newest_verified(ckpt_dir, verify) if ckpt_dir.is_dir() else None
    p = Path(load)
    if not p.exists():
        raise CheckpointError(f"checkpoint.load={load}: no such checkpoint{REFUSE_FRESH}")
    found = None
    if layout.is_complete(p):
        found = p
    elif (p / TRACKER_FILE).is_file() or layout.list_checkpoints(p)[0]:
        found = layout.latest_complete(p)
    if found is None:
        raise CheckpointError(
            f"checkpoint.load={load}: not a complete checkpoint (no {META_FILE}; a save was interrupted?)"
            f"{REFUSE_FRESH}"
        )
    _check_readable(found, verify)
    return found


def _progress_without_checkpoint(root: Path) -> str | None:
    """What says that the run in ``root`` had saved progress when no checkpoint is left: the tracker's iteration or
    the checkpoints set aside in ``corrupt/``; None for neither (a fresh run)."""
    said = []
    try:
        tracked = layout.read_tracker(root)
    except CheckpointError:
        tracked = None
    if tracked is not None:
        said.append(f"its tracker names iteration {tracked}")
    corrupt = root / layout.CORRUPT_DIR
    aside = sorted(p.name for p in corrupt.iterdir()) if corrupt.is_dir() else []
    if aside:
        said.append(f"{corrupt} holds {len(aside)} checkpoint(s) that failed verification ({', '.join(aside[:3])}"
                    f"{', ...' if len(aside) > 3 else ''})")
    return " and ".join(said) or None


def _newest_verified(root: Path, verify: bool) -> Path | None:
    """``auto``: the newest complete checkpoint under ``root`` that verifies; the ones that fail are set aside."""
    root = Path(root)
    set_aside_now = [str(d) for d in layout.remove_incomplete(root)]
    unreadable_tracker = None
    while True:
        try:
            ckpt = layout.latest_complete(root)
        except CheckpointError as e:  # an unreadable tracker: the newest complete checkpoint decides
            unreadable_tracker = str(e)
            (root / TRACKER_FILE).unlink()
            ckpt = layout.latest_complete(root)
        if ckpt is None:
            progress = _progress_without_checkpoint(root) or (
                unreadable_tracker and f"it had a tracker file ({unreadable_tracker})")
            if progress and not set_aside_now:
                raise CheckpointError(
                    f"{root} holds no checkpoint that verifies, but {progress}; refusing to start from scratch (load "
                    "one with checkpoint.load=<path> or start over with checkpoint.load=none)"
                )
            if set_aside_now:
                raise CheckpointError(
                    f"no checkpoint in {root} verifies (set aside: {', '.join(set_aside_now)}); "
                    "refusing to start from scratch (load one with checkpoint.load=<path> or start over with "
                    "checkpoint.load=none)"
                )
            return None
        try:
            _check_readable(ckpt, verify)
        except CheckpointError as e:
            dest = layout.set_aside(ckpt, str(e))
            set_aside_now.append(str(dest))
            log(f"WARNING: {e}")
            log(f"WARNING: moved {ckpt} to {dest} (kept for inspection); falling back to the previous checkpoint")
            continue
        if set_aside_now:
            layout.write_tracker(root, layout.iteration_of(ckpt))
            log(f"WARNING: resuming from {ckpt}, an older checkpoint; {len(set_aside_now)} newer one(s) set aside in "
                f"{root / layout.CORRUPT_DIR}")
        return ckpt


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
        if s_dist != uses_distributed_optimizer(optimizer):
            raise CheckpointError(
                f"{path}: optimizer state was saved with parallel.use_distributed_optimizer={s_dist}; "
                f"this run uses {not s_dist}; resume with the same setting"
            )
        if s_dist:
            s_lay, c_lay = meta["parallel"], run_layout().as_dict()
            fixed = ("tp", "pp", "cp", "ep", "etp")
            diff = [f"{k} {s_lay[k]}->{c_lay[k]}" for k in fixed if s_lay.get(k) != c_lay[k]]
            if diff:
                raise CheckpointError(
                    f"{path}: distributed-optimizer state ({DISTRIB_OPTIM_SHARDING}) reshards only across data "
                    f"parallel; this run changes {', '.join(diff)}"
                )
    elif optimizer is not None and not meta.get("has_optimizer"):
        raise CheckpointError(f"{path}: checkpoint has no optimizer state; cannot resume training from it")


# ------------------------------------------------------------------------------------- resume settings
# The settings that place a run in its training data: under another value the checkpoint's consumed samples count
# samples of another length, shuffle, corpus, blend or tokenization.
DATA_KEYS = ("train.seq_length", "seed", "data.kind", "data.paths", "data.weights", "data.split",
             "data.tokenizer.type", "data.tokenizer.path", "data.tokenizer.vocab_size",
             "data.tokenizer.num_special_tokens", "data.tokenizer.pattern")
_ABSENT = "<not set>"


def saved_run_config(ckpt: Path) -> dict | None:
    """The resolved run config saved beside checkpoint ``ckpt`` (its ``config.yaml``; None when it has none)."""
    f = Path(ckpt) / "config.yaml"
    if not f.is_file():
        return None
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(OmegaConf.load(f), resolve=False)
    except Exception as e:  # noqa: BLE001 (yaml and OmegaConf raise several types)
        raise CheckpointError(f"{f}: unreadable ({type(e).__name__}: {e})") from None


def _select(tree, dotted: str):
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def resume_changes(saved: dict, cfg) -> tuple[dict, dict]:
    """(LR-schedule changes, training-data changes) from the checkpoint's run config ``saved`` to ``cfg``: ``{key:
    (saved value, this run's)}``, schedule keys as ``nano_hybrid.optim.SCHEDULE_KEYS``, data keys as ``DATA_KEYS``."""
    from omegaconf import OmegaConf

    from nano_hybrid.optim import lr_schedule

    now = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg
    before, after = lr_schedule(saved), lr_schedule(now)
    schedule = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    data = {k: (_select(saved, k), _select(now, k)) for k in DATA_KEYS if _select(saved, k) != _select(now, k)}
    return schedule, data


def check_resume_settings(cfg, ckpt: Path, step: int) -> list[str]:
    """Rank 0, before any work: refuse (CheckpointError, one line) to resume checkpoint ``ckpt`` (at ``step``) past
    ``train.train_iters``, under another LR schedule than the one it was saved with unless ``optim.override_scheduler``, or on other training data
    unless ``checkpoint.allow_data_change``; returns the notices to print for the changes those settings accept."""
    iters = int(cfg.train.train_iters)
    if step > iters:
        raise CheckpointError(f"{ckpt} is at step {step}, past train.train_iters={iters}: there is nothing to train "
                              f"(set train.train_iters above {step} to train on)")
    saved = saved_run_config(ckpt)
    if saved is None:
        return [f"{ckpt} holds no config.yaml: this run's LR schedule and data settings are not checked against it"]
    from nano_hybrid.optim import SCHEDULE_KEYS

    schedule, data = resume_changes(saved, cfg)
    notes = []
    if schedule:
        said = "; ".join(f"{SCHEDULE_KEYS[k]} {a} -> {b}" for k, (a, b) in schedule.items())
        if not bool(cfg.optim.get("override_scheduler", False)):
            hint = ""
            if ("decay_iters" in schedule and set(schedule) <= {"decay_iters", "wsd_decay_iters"}
                    and _select(saved, "optim.lr_decay_iters") in (None, _ABSENT)):
                hint = f"; to train on past the checkpoint's schedule, set optim.lr_decay_iters={schedule['decay_iters'][0]}"
            raise CheckpointError(
                f"{ckpt}: this run's LR schedule differs from the checkpoint's ({said}); resume with the checkpoint's "
                f"values, or set optim.override_scheduler=true to follow this config's schedule from step {step}{hint}")
        notes.append(f"resuming step {step} on this config's LR schedule (optim.override_scheduler=true): {said}")
    if data:
        said = "; ".join(f"{k} {a} -> {b}" for k, (a, b) in data.items())
        if not bool(cfg.checkpoint.get("allow_data_change", False)):
            raise CheckpointError(
                f"{ckpt}: this run's training data differs from the checkpoint's ({said}), so its "
                f"consumed samples would point elsewhere; resume with the checkpoint's values, or set "
                f"checkpoint.allow_data_change=true to continue after the checkpoint's consumed samples on this data")
        notes.append(f"resuming step {step} on changed training data (checkpoint.allow_data_change=true), after the "
                     f"checkpoint's consumed samples: {said}")
    if step == iters:
        notes.append(f"{ckpt} is at step {step} = train.train_iters: nothing to train")
    return notes


# ------------------------------------------------------------------------------------------- save
def _save_stage(fn, root: Path, ckpt: Path, step: int) -> None:
    """Run one stage of a save on every rank; when any rank fails, remove the partial directory and raise one line
    (the same on every rank)."""
    try:
        fn()
        err = None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 (torch's CheckpointException is a BaseException)
        err = layout.describe_save_failure(e, ckpt)
    err = agree(err)
    if err is None:
        return
    if run_layout().rank == 0 and ckpt.exists():
        layout.remove_step_dir(ckpt)
    prev = layout.latest_complete(root) if root.is_dir() else None
    keeps = f"{prev} stays the checkpoint that loads" if prev else "no earlier checkpoint exists"
    raise CheckpointSaveError(f"saving checkpoint step {step} to {ckpt} failed: {err}; {keeps}", collective=True)


def _manifest(train_state, optimizer, *, wandb_run_id, model_name, signature) -> dict:
    """The completion manifest of a save (the file checksums are added when it is published)."""
    dist_opt = uses_distributed_optimizer(optimizer)
    return {
        "format": FORMAT,
        "iteration": int(train_state.step),
        "train_state": asdict(train_state),
        "wandb_run_id": wandb_run_id,
        "model_name": model_name,
        "model_signature": signature,
        "parallel": run_layout().as_dict(),
        "has_optimizer": optimizer is not None,
        "distributed_optimizer": dist_opt,
        "distrib_optim_sharding_type": DISTRIB_OPTIM_SHARDING if dist_opt else None,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
    }


def _config_yaml(config: Any) -> str | None:
    if config is None:
        return None
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(config, resolve=True) if OmegaConf.is_config(config) else str(config)


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
    ckpt = root / layout.iter_dir_name(step)
    rank0 = run_layout().rank == 0

    bad = mcore_io.nonfinite_parameters(model)
    problem = agree(f"{bad} on rank {run_layout().rank}" if bad else None)
    if problem is not None:
        raise CheckpointSaveError(f"refusing to save step {step}: non-finite values in {problem}; the previous "
                                  "checkpoint stays the one that loads", collective=True)

    _save_stage(lambda: layout.fresh_step_dir(root, ckpt) if rank0 else None, root, ckpt, step)
    (wandb_run_id,) = share_from_rank0(wandb_run_id)  # only rank 0 talks to W&B; the common part must agree
    signature = global_model_signature(model)  # collective, as the broadcast above: every rank, before any write
    state = mcore_io.sharded_state(model, optimizer, is_loading=False)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    state["train_state"] = asdict(train_state)
    state["wandb_run_id"] = wandb_run_id
    _save_stage(lambda: mcore_io.write_state(ckpt, state), root, ckpt, step)

    t_sum = [0.0]

    def publish():
        if rank0:
            meta = _manifest(train_state, optimizer, wandb_run_id=wandb_run_id, model_name=model_name,
                             signature=signature)
            t_sum[0] = layout.publish(root, ckpt, meta, _config_yaml(config), keep_last)

    _save_stage(publish, root, ckpt, step)
    log(f"saved {ckpt} (step {step}) in {time.perf_counter() - t0:.2f}s (checksums {t_sum[0]:.2f}s)")
    return ckpt


# ------------------------------------------------------------------------------------------- load
def _read_rng(path: Path, meta: dict) -> dict | None:
    """This rank's RNG streams from checkpoint ``path`` (None when the world size changed)."""
    here = run_layout()
    saved_world = meta["parallel"]["world_size"]
    if saved_world != here.world_size:
        log(f"world size changed ({saved_world} -> {here.world_size}): RNG streams are not restored; "
            "the run continues but is not bitwise reproducible")
        return None
    f = layout.rng_file(path, here.rank)
    if not f.is_file():
        raise CheckpointError(f"{f}: missing (this rank's RNG streams)")
    try:
        return torch.load(f, weights_only=False)
    except Exception as e:  # noqa: BLE001 (torch.load raises many types for a damaged file)
        raise CheckpointError(f"{f}: unreadable ({type(e).__name__}: {e})") from None


def _override_param_group_lrs(scheduler, saved: dict) -> None:
    """optim.override_scheduler: megatron's parameter groups carry their own ``max_lr`` / ``min_lr``, which the
    optimizer's state restored from the checkpoint; scale them to this config's schedule (keeping any per-group
    multiplier) and set this step's lr again, or the loaded peak and floor would stay in force."""
    old_max, old_min = float(saved.get("max_lr", scheduler.max_lr)), float(saved.get("min_lr", scheduler.min_lr))
    for group in scheduler.optimizer.param_groups:
        if "max_lr" in group:
            group["max_lr"] = group["max_lr"] * scheduler.max_lr / old_max if old_max > 0 else scheduler.max_lr
        if "min_lr" in group:
            group["min_lr"] = group["min_lr"] * scheduler.min_lr / old_min if old_min > 0 else scheduler.min_lr
    scheduler.step(increment=0)


def load_checkpoint(path: str | Path, model, optimizer=None, scheduler=None, *, restore_rng: bool = True) -> LoadedCheckpoint:
    """Load a complete checkpoint into model/optimizer/scheduler; restore this rank's RNG streams unless told not to.

    (A DataLoader draws from the global torch RNG when its iterator is created: restore the RNG after
    building the data iterator, with ``restore_rng=False`` here and :func:`set_rng_state` later.)
    """
    path = Path(path)
    meta = layout.read_meta(path)
    if meta is None:
        raise CheckpointError(f"{path}: not a complete checkpoint (no {META_FILE})")
    check_compatible(meta, model, optimizer, path)
    loaded = mcore_io.load_state(path, model, optimizer)
    if scheduler is not None:
        if "scheduler" not in loaded:
            raise CheckpointError(f"{path}: checkpoint has no scheduler state")
        try:
            scheduler.load_state_dict(loaded["scheduler"])
        except AssertionError as e:  # megatron: a schedule value differs and no override was asked for
            raise CheckpointError(f"{path}: {e} (set optim.override_scheduler=true to follow this config's "
                                  "schedule)") from None
        if getattr(scheduler, "override_opt_param_scheduler", False):
            _override_param_group_lrs(scheduler, loaded["scheduler"])
    rng_state = _read_rng(path, meta)
    if rng_state is not None and restore_rng:
        mcore_io.set_rng_state(rng_state)
    ts = dict(loaded["train_state"])
    log(f"loaded {path} (step {ts['step']}, {ts['consumed_samples']} samples, {ts['consumed_tokens']} tokens)")
    return LoadedCheckpoint(path=path, train_state=ts, wandb_run_id=loaded.get("wandb_run_id"), meta=meta,
                            rng_state=rng_state)


# ------------------------------------------------------------------------------------- the handle
class Checkpointer:
    """The training loop's handle on ``cfg.checkpoint`` (checked by :func:`check_settings`); every rank calls each method.

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
        self.cfg = cfg
        self.dir = Path(str(c.dir))
        self.interval = int(c.interval or 0)
        self.keep_last = int(c.keep_last or 0)
        self.load = None if c.load is None else str(c.load)
        self.save_on_exit = bool(c.save_on_exit)
        self.verify = bool(c.get("verify", _CHECKPOINT_DEFAULTS["verify"]))
        self.last_saved_step: int | None = None
        mcore_io.start_writer_queue()
        self._located = False
        self.load_path: Path | None = None
        self.load_meta: dict | None = None
        self._rng_state: dict | None = None

    def locate(self) -> Path | None:
        """Resolve ``checkpoint.load`` once (raises CheckpointError for a bad explicit path)."""
        if not self._located:
            self.load_path = resolve_load_path(self.load, self.dir, verify=self.verify)
            self.load_meta = layout.read_meta(self.load_path) if self.load_path is not None else None
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
            log(f"no checkpoint to resume (checkpoint.load={self.load}, dir {self.dir}); training starts from {start}")
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

    def check_resume(self, cfg) -> list[str]:
        """Rank 0, before any work: ``check_resume_settings`` for the located checkpoint (no notices on a fresh
        start)."""
        path = self.locate()
        return [] if path is None else check_resume_settings(cfg, path, self.resume_step)

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
        have = len(layout.list_checkpoints(self.dir)[0]) if self.dir.is_dir() else 0
        peak = have + new if not self.keep_last else min(have + new, self.keep_last + 1)
        return max(min(new, 1), peak - have)

    def check_free_space(self, model, optimizer, train_iters: int) -> int:
        """Rank 0: StorageError unless ``dir`` has room for the checkpoints this run adds; returns one's bytes."""
        from nano_hybrid import storage

        one = storage.checkpoint_bytes(mcore_io.model_signature(model), mcore_io.param_element_size(model),
                                       has_optimizer=optimizer is not None)
        storage.check_free_space(self.dir, one, self.extra_checkpoints(train_iters), self.keep_last)
        return one

    def restore_rng(self) -> None:
        if self._rng_state is not None:
            mcore_io.set_rng_state(self._rng_state)
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
