"""The runtime every training step calls: config store and lookup, the fit check, the launch cache, the fast launcher.

The bottom layer of config handling: ``kernels.tuner`` (the search) is above it and ``kernels.first_use`` (what
kernel wrappers call: ``tuned_call``, ``select_config`` with the first-use search) above both; this module imports
neither.

Files
-----
Committed: ``kernels/configs/<arch>/<kernel_name>.json`` (arch = ``current_arch()``, e.g. ``sm90`` for H100/H200,
``sm100`` for B200). Per user: ``<kernels.helion.cache_dir>/<arch>/<kernel_name>.json`` (default cache dir
``~/.cache/nano_hybrid/helion``), written by first-use tuning (``kernels.helion.autotune``). Both hold::

    {"kernel": "rmsnorm_bwd", "arch": "sm90",
     "entries": {"<shape_key>": {"dims": {...}, "config": {<helion.Config dict>},
                                 "time_ms": 0.123, "date": "2026-11-29T...", "gpu": "NVIDIA H200",
                                 "meta": {...}}}}

Choosing a config (``kernels.first_use.select_config``), at the first call of a kernel with a given argument signature
-----------------------------------------------------------------------------------------------------------------------
1. a kernel in Helion's eager reference mode (``HELION_INTERPRET=1``) or arch ``cpu``: the kernel's default;
2. the exact committed entry for ``shape_key(**dims)``, else the exact user-cache entry;
3. with ``kernels.helion.autotune`` on: a search at this call (``kernels.first_use.tune_first_use``; on a GPU in a
   child process killed at ``kernels.helion.autotune_budget_s`` plus a margin), stored in the user cache under a
   file lock (the first rank to take the lock tunes, the others then read its entry); a search that gives no config
   is one warning, and steps 4-5 give the config;
4. the nearest tuned shapes (committed and user cache; log-space L1 distance over the integer dims, same
   non-integer dims; ties broken by the sorted shape key), in distance order;
5. the kernel's generic default, and last the bound kernel's spec default (``config_spec.default_config()``),
   valid for every shape by construction.
Every candidate is first fitted (``fit_config``: flat pid, per-access and per-loop lists and block sizes fitted to
this specialisation) and checked against the bound kernel's config spec at the call's shape with Helion's own
normalization (``ConfigSpec.normalized_config``, which raises ``helion.exc.InvalidConfig`` for a config that does
not fit this binding even so, e.g. one with another number of block sizes). A candidate that does not fit is
skipped with one warning per (kernel, shape) naming the tuned shape it came from; using a nearest shape or a
default says so once per kernel; an arch without committed configs says so once, with the command that tunes it.
A config can fit the spec and still be refused by this GPU at its first launch (shared memory, registers, a Triton
compile failure: ``launch_misfit``); ``kernels.first_use.tuned_call`` then launches the next candidates of steps 4-5
(``Choice.fallbacks``) in turn, says once per kernel and shape which config failed and which runs, and raises
``kernels.shapes.UnsupportedShapeError`` when none launches.
This module holds the chain without step 3: ``Choice`` (``choice_for``: ``exact`` is step 2, ``fallbacks`` steps 4-5)
and ``stored_config``.

Calling a kernel with a chosen config
-------------------------------------
On GPU: ``kernel.bind(args).compile_config(config)`` gives a compiled callable, cached per (kernel, argument
signature: dtype/shape/stride/device of tensors and values of scalars, config), so a training step pays one dict
lookup per launch; ``kernels.compile_cache`` keeps the chosen config and the generated module for later processes.
Wrappers never call ``kernel(*args)`` on GPU, so Helion's own autotuner never runs. Under
``HELION_INTERPRET=1`` (CPU) the kernel function runs in Helion's eager reference mode with the config visible to
``hl.register_tunable``.

State
-----
What depends on the backend's settings (fast launch, autotune, its budget and cache directory) lives in a
``Runtime``, one per ``HelionSettings`` (``runtime_for``), with its own compiled-kernel and launch caches. The
helion backend's ops run inside ``use(settings)``; outside any, the default settings' runtime applies. Two
backends with different settings in one process share no switch.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
import dataclasses
import datetime as _dt
import fcntl
import functools
import json
import math
import os
import socket
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

import helion
from triton import knobs as triton_knobs

from kernels import debug
from kernels.settings import HelionSettings

CONFIG_ROOT = Path(__file__).resolve().parent / "configs"

# Helion warnings that say nothing about our kernels: ProcessGroupNameNotFound is printed at every bind in a
# process with torch.distributed initialized when the torch build cannot tell symmetric-memory tensors apart
# (helion/_dist_utils.py); none of our kernels is a distributed kernel. Every kernel in kernels/ ignores these.
IGNORED_HELION_WARNINGS: list = [helion.exc.ProcessGroupNameNotFound]

_WARNED: set[tuple[str, str]] = set()
_FILE_CACHE: dict[Path, dict] = {}


# ----------------------------------------------------------------------------------------------
# the per-settings runtime


@dataclasses.dataclass(eq=False)
class Runtime:
    """The state of one helion backend's settings: its switches and its compile / launch caches."""

    settings: HelionSettings
    compiled: dict = dataclasses.field(default_factory=dict)  # (id(kernel), signature, config json) -> callable
    # (tag, id(kernel), argument signature) -> compiled callable: the per-call fast path (no config lookup, no
    # Config objects, no JSON per call once a signature has been seen)
    fast: dict = dataclasses.field(default_factory=dict)
    # per-shape choices between kernel paths made from the stored configs (e.g. ``ssd_helion.choose_state_passing``)
    decisions: dict = dataclasses.field(default_factory=dict)
    # first calls by how their kernel was made ready: "loaded" from the compile cache, "bound" (bound and chosen now)
    first_calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def cache_root(self) -> Path:
        return user_cache_root(self.settings.cache_dir)

    def clear(self) -> None:
        self.compiled.clear()
        self.fast.clear()
        self.decisions.clear()
        self.first_calls.clear()


_RUNTIMES: dict[HelionSettings, Runtime] = {}
_ACTIVE: contextvars.ContextVar[Runtime | None] = contextvars.ContextVar("nano_hybrid_helion_runtime", default=None)


def runtime_for(settings: HelionSettings | None = None) -> Runtime:
    """The runtime of ``settings`` (the defaults when None), one per distinct settings value."""
    settings = HelionSettings() if settings is None else settings
    rt = _RUNTIMES.get(settings)
    if rt is None:
        rt = _RUNTIMES[settings] = Runtime(settings)
    return rt


def runtime() -> Runtime:
    """The runtime of the op being run (``use``), else the default settings' runtime."""
    rt = _ACTIVE.get()
    return rt if rt is not None else runtime_for(None)


@contextlib.contextmanager
def use(settings: HelionSettings | None) -> Iterator[Runtime]:
    """Run the kernels called inside with the runtime of ``settings`` (None: keep the active one). Autograd runs a
    backward on its own thread: a Function's backward enters it again."""
    if settings is None:
        yield runtime()
        return
    token = _ACTIVE.set(runtime_for(settings))
    try:
        yield _ACTIVE.get()
    finally:
        _ACTIVE.reset(token)


def with_runtime(fn: Callable, settings: HelionSettings) -> Callable:
    """``fn`` running inside ``use(settings)`` (what the registry binds into the helion backend's ops)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with use(settings):
            return fn(*args, **kwargs)

    wrapped.settings = settings
    return wrapped


# ----------------------------------------------------------------------------------------------
# basic helpers


def interpret_mode() -> bool:
    return os.environ.get("HELION_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def current_arch() -> str:
    """``"sm90"``, ``"sm100"``, ... from the current CUDA device capability; ``"cpu"`` without CUDA."""
    if not torch.cuda.is_available():
        return "cpu"
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


def user_cache_root(cache_dir: str = "") -> Path:
    """The per-user config cache: ``cache_dir`` (``kernels.helion.cache_dir``), else ``~/.cache/nano_hybrid/helion``
    (under ``$XDG_CACHE_HOME`` when set)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nano_hybrid" / "helion"


_DIM_ORDER = ("b", "l", "m", "d", "h", "p", "g", "n", "c", "w", "gs")


def shape_key(**dims: Any) -> str:
    """Canonical key: known dim letters first in the order b l m d h p g n c w gs, others sorted.

    ``shape_key(b=2, l=8192, h=64, p=64, g=8, n=128, c=128) == "b2_l8192_h64_p64_g8_n128_c128"``.
    Values must be ints, bools (written 0/1) or short alphanumeric strings.
    """
    if not dims:
        raise ValueError("shape_key needs at least one dim")
    order = [k for k in _DIM_ORDER if k in dims] + sorted(k for k in dims if k not in _DIM_ORDER)
    parts = []
    for k in order:
        v = dims[k]
        if isinstance(v, bool):
            v = int(v)
        if isinstance(v, int):
            parts.append(f"{k}{v}")
        elif isinstance(v, str) and v.replace("-", "").isalnum():
            parts.append(f"{k}{v}")
        else:
            raise ValueError(f"shape_key: dim {k}={v!r} must be an int, bool or alphanumeric str")
    return "_".join(parts)


def as_config(cfg: helion.Config | Mapping[str, Any]) -> helion.Config:
    """A helion.Config from a Config or its dict form (as stored in the config files)."""
    if isinstance(cfg, helion.Config):
        return cfg
    if isinstance(cfg, Mapping):
        return helion.Config.from_dict(dict(cfg))
    raise TypeError(f"expected helion.Config or dict, got {type(cfg).__name__}")


def config_to_dict(cfg: helion.Config | Mapping[str, Any]) -> dict:
    return json.loads(as_config(cfg).to_json())


def config_path(kernel_name: str, arch: str | None = None, root: Path | None = None) -> Path:
    return Path(root or CONFIG_ROOT) / (arch or current_arch()) / f"{kernel_name}.json"


class ConfigFileError(ValueError):
    """A config file (committed or in the user cache) that cannot be used: unreadable, not JSON, or without its
    ``entries`` of ``dims`` and ``config``. The message is one line naming the file and what to do."""


def read_config_file(path: Path) -> dict:
    """The config file at ``path``, checked (``ConfigFileError`` when it cannot be used)."""
    def bad(what: str) -> ConfigFileError:
        committed = Path(path).resolve().is_relative_to(CONFIG_ROOT)
        fix = ("restore it from git" if committed else
               "delete it (its shapes are then tuned again, or run on the nearest configs)")
        return ConfigFileError(f"Helion config file {path}: {what}; {fix}")

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"unreadable ({type(e).__name__}: {e})") from None
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        raise bad("no 'entries' object")
    for key, entry in entries.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("dims"), dict)
                and isinstance(entry.get("config"), dict)):
            raise bad(f"entry {key!r} has no 'dims' and 'config' objects")
    return data


def check_config_files(roots: Sequence[Path]) -> int:
    """Read every config file under ``roots`` (``<root>/<arch>/<kernel>.json``; the committed configs and a user
    cache), so that a file that cannot be used stops a run before its first step, not at a kernel's first call.
    Returns the number of files read; raises ``ConfigFileError`` at the first bad one."""
    n = 0
    for root in roots:
        for path in sorted(Path(root).glob("*/*.json")):
            if path.name.endswith(".failed.json"):  # first-use failure records (kernels.first_use), not configs
                continue
            read_config_file(path)
            n += 1
    return n


def _load_file(path: Path) -> dict:
    if path in _FILE_CACHE:
        return _FILE_CACHE[path]
    data = read_config_file(path) if path.exists() else {"entries": {}}
    _FILE_CACHE[path] = data
    return data


def clear_caches() -> None:
    """Forget loaded files, compiled kernels and the warnings already given (every runtime)."""
    _FILE_CACHE.clear()
    _WARNED.clear()
    _MARKERS.clear()
    _ZEROS.clear()
    for rt in _RUNTIMES.values():
        rt.clear()


# Flags whose kernels differ only by extra masked loads (``seq``: seq_idx given): a config tuned at the other value
# fits after ``fit_config`` resizes its per-access lists, so it is a nearest shape at this distance (as far as a
# factor of 2 in one dim), not a different kernel.
SOFT_FLAGS = {"seq": 1.0}


def _distance(a: Mapping[str, Any], b: Mapping[str, Any]) -> float | None:
    """Log-space L1 distance between two kernel dims over their integer dims (plus ``SOFT_FLAGS``' cost where such
    a flag differs); None where the dim names, a non-integer value or a zero / negative value differ."""
    if set(a) != set(b):
        return None
    d = 0.0
    for k, va in a.items():
        vb = b[k]
        if k in SOFT_FLAGS and va != vb:
            d += SOFT_FLAGS[k]
            continue
        if isinstance(va, bool) or not isinstance(va, int) or not isinstance(vb, int) or isinstance(vb, bool):
            if va != vb:
                return None
            continue
        if va <= 0 or vb <= 0:
            if va != vb:
                return None
            continue
        d += abs(math.log2(va / vb))
    return d




def _entries(kernel_name: str, arch: str, root: Path | None) -> dict:
    return _load_file(config_path(kernel_name, arch, root))["entries"]


def lookup(kernel_name: str, dims: Mapping[str, Any], arch: str | None = None, root: Path | None = None):
    """Return ``(how, key, entry)`` with how in {"exact", "nearest", "none"}: the committed file's exact entry, else
    its nearest tuned shape (the first of ``nearest_entries``)."""
    key = shape_key(**dims)
    entries = _entries(kernel_name, arch or current_arch(), root)
    if key in entries:
        return "exact", key, entries[key]
    near = nearest_entries(entries, dims)
    if near:
        return "nearest", near[0][0], near[0][1]
    return "none", None, None


def tuned_time_ms(kernel_name: str, dims: Mapping[str, Any], arch: str | None = None, root: Path | None = None,
                  cache_root: Path | None = None) -> float | None:
    """The tuned time (ms) stored with the exact entry for ``dims``: the committed file's (``root``), else the user
    cache's (``cache_root``, when given), the order in which a call takes exact configs; None where neither has an
    entry with a time. (No kernel is bound here: a committed entry whose config no longer fits the kernel, which the
    call then skips for the user cache's, still gives its time.)"""
    key = shape_key(**dims)
    arch = arch or current_arch()
    for where in (root, cache_root) if cache_root is not None else (root,):
        t = _entries(kernel_name, arch, where).get(key, {}).get("time_ms")
        if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0:
            return float(t)
    return None


def nearest_entries(entries: Mapping[str, dict], dims: Mapping[str, Any]) -> list[tuple[str, dict]]:
    """``[(key, entry)]`` of the entries with the same dim names and non-integer values as ``dims`` (``SOFT_FLAGS``
    may differ), nearest first (``_distance``; ties broken by the sorted key); the exact key is left out."""
    key = shape_key(**dims)
    scored = []
    for k in sorted(entries):
        if k == key:
            continue
        d = _distance(dims, entries[k].get("dims", {}))
        if d is not None:
            scored.append((d, k))
    scored.sort(key=lambda t: t[0])  # stable: ties keep the sorted-key order
    return [(k, entries[k]) for _, k in scored]


def arch_has_configs(arch: str, root: Path | None = None) -> bool:
    d = Path(root or CONFIG_ROOT) / arch
    return d.is_dir() and any(d.glob("*.json"))


# the notices of a config choice being made (``recording_notices``): (kernel name, what, message)
_RECORDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("nano_hybrid_helion_notices", default=None)


@contextlib.contextmanager
def recording_notices() -> Iterator[list[tuple[str, str, str]]]:
    """Collect every ``warn_once`` call made inside, said or already said (the compile cache keeps a choice's
    notices with it and says them again when a later process loads the choice)."""
    got: list[tuple[str, str, str]] = []
    token = _RECORDING.set(got)
    try:
        yield got
    finally:
        _RECORDING.reset(token)


def warn_once(kernel_name: str, what: str, msg: str) -> None:
    """One warning per (kernel, what) and process."""
    rec = _RECORDING.get()
    if rec is not None:
        rec.append((kernel_name, what, msg))
    if (kernel_name, what) in _WARNED:
        return
    _WARNED.add((kernel_name, what))
    warnings.warn(msg, stacklevel=3)


TUNE_COMMAND = "python scripts/tune_kernels.py <the run's overrides, e.g. model=... train.micro_batch_size=...>"


def _notice_arch_without_configs(arch: str, root: Path | None) -> None:
    if arch_has_configs(arch, root):
        return
    warn_once("*", f"arch:{arch}",
               f"nano_hybrid kernels: no committed Helion configs for {arch} ({Path(root or CONFIG_ROOT) / arch} has "
               f"none): kernels run with their default configs (or user-cache entries); tune this GPU with "
               f"`{TUNE_COMMAND}` (writes kernels/configs/{arch}/, to commit) or set kernels.helion.autotune=true")


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``<path>.lock`` (ranks of one host, and of hosts sharing a POSIX file system)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def record(
    kernel_name: str,
    dims: Mapping[str, Any],
    config: helion.Config | Mapping[str, Any],
    time_ms: float,
    meta: Mapping[str, Any] | None = None,
    *,
    arch: str | None = None,
    root: Path | None = None,
) -> Path:
    """Write/update the entry for (kernel, shape) in ``<root>/<arch>/<kernel>.json`` (root: the committed configs
    by default), read-modify-written under ``file_lock`` and replaced atomically (a reader never sees half a file)."""
    arch = arch or current_arch()
    path = config_path(kernel_name, arch, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path):
        data = read_config_file(path) if path.exists() else {}
        data.setdefault("kernel", kernel_name)
        data.setdefault("arch", arch)
        entries = data.setdefault("entries", {})
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        entries[shape_key(**dims)] = {
            "dims": dict(dims),
            "config": config_to_dict(config),
            "time_ms": float(time_ms),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "gpu": gpu,
            "meta": dict(meta or {}),
        }
        _write_config_file(path, data)
    return path


def atomic_write_text(path: Path, text: str) -> None:
    """``text`` to ``path`` through a temporary file beside it, renamed over it: a reader sees the old file or the new
    one, never half of one (also from another host on a shared file system). Makes the folder; the temporary file
    is removed when the write fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def _write_config_file(path: Path, data: dict) -> None:
    """``data`` to ``path`` with its entries sorted, replaced atomically (a reader never sees half a file); the
    caller holds ``file_lock(path)``. Forgets the file's cached copy and the runtimes' launch caches."""
    data["entries"] = dict(sorted(data["entries"].items()))
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=False) + "\n")
    _FILE_CACHE.pop(path, None)
    for rt in _RUNTIMES.values():  # their launch caches hold configs read from the old file
        rt.fast.clear()


def merge_config_files(src_root: Path, dst_root: Path | None = None, replace: bool = False,
                       kernels: Sequence[str] | None = None) -> list[dict]:
    """Merge the config files under ``src_root`` (``<arch>/<kernel>.json``: another search's ``--out-root``, a user
    cache) into ``dst_root`` (the committed configs by default). An entry whose shape the destination file lacks is
    added; one it has is kept, or with ``replace`` replaced. Every source and destination file is read and checked
    before anything is written (``ConfigFileError``, one line, at the first bad one: unreadable, a kernel not in
    ``kernels`` when given, an entry whose key is not its dims' shape key); each destination file is
    read-modify-written under ``file_lock`` and replaced atomically. Returns one row per source entry:
    ``{"kernel", "arch", "key", "action"}`` with action added / replaced / kept / same (an identical entry)."""
    dst_root = Path(dst_root or CONFIG_ROOT)
    sources = [q for q in sorted(Path(src_root).glob("*/*.json")) if not q.name.endswith(".failed.json")]
    if not sources:
        raise ConfigFileError(f"no config files (<arch>/<kernel>.json) under {src_root}")
    plan = []
    for src in sources:
        data, arch, kernel = read_config_file(src), src.parent.name, src.stem
        if kernels is not None and kernel not in kernels:
            raise ConfigFileError(f"Helion config file {src}: no tunable kernel is named {kernel!r} (known: "
                                  f"{', '.join(sorted(kernels))}); leave it out")
        for key, entry in data["entries"].items():
            try:
                want_key = shape_key(**entry["dims"])
            except ValueError as e:
                raise ConfigFileError(f"Helion config file {src}: entry {key!r}: {e}") from None
            if key != want_key:
                raise ConfigFileError(f"Helion config file {src}: entry {key!r} has the dims of {want_key!r}; "
                                      "fix or drop it")
        for field, want in (("kernel", kernel), ("arch", arch)):
            if data.get(field, want) != want:
                raise ConfigFileError(f"Helion config file {src}: its {field} is {data[field]!r}, its path says "
                                      f"{want!r}; move it or fix the field")
        dst = config_path(kernel, arch, dst_root)
        if dst.exists():
            read_config_file(dst)
        plan.append((src, data, arch, kernel, dst))
    rows = []
    for src, data, arch, kernel, dst in plan:
        dst.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(dst):
            out = read_config_file(dst) if dst.exists() else {"kernel": kernel, "arch": arch, "entries": {}}
            entries = out["entries"]
            changed = False
            for key, entry in data["entries"].items():
                if key not in entries:
                    action = "added"
                elif entries[key] == entry:
                    action = "same"
                else:
                    action = "replaced" if replace else "kept"
                if action in ("added", "replaced"):
                    entries[key] = entry
                    changed = True
                rows.append({"kernel": kernel, "arch": arch, "key": key, "action": action})
            if changed:
                _write_config_file(dst, out)
    return rows


# ----------------------------------------------------------------------------------------------
# the fit check and the selection chain

# config keys that exist only on some devices (Helion's ConfigSpec.supports_config_key): a config tuned on a
# TMA-capable GPU carries them; a binding on a device without them drops them
DEVICE_KEYS = ("host_tensor_descriptors", "cross_loop_pipeline")


class ConfigMisfit(ValueError):
    """A config that does not fit a kernel bound at a call's shape (Helion's normalization refuses it)."""


def fit_config(bound, cfg: helion.Config | Mapping[str, Any],
               adjust: Callable[[dict], dict] | None = None) -> helion.Config:
    """``cfg`` made ready for ``bound`` (a kernel bound at the call's arguments) and checked against its config spec.

    Fitting: ``adjust`` (a wrapper's own clamps), a flat pid when none is named, per-access and per-loop lists
    (``fit_lists``) and block sizes fitted to this specialisation, device-only keys the binding's device lacks
    dropped. Check: Helion's ``config_spec.normalized_config`` (what ``compile_config`` runs first). Raises
    ``ConfigMisfit`` with Helion's reason; returns the fitted config (not the normalized one: what compiles is what
    was chosen)."""
    try:
        cfg = as_config(cfg)
        if adjust is not None:
            cfg = as_config(adjust(dict(cfg.config)))
        cfg = with_flat_pid(cfg)
        spec = getattr(bound, "config_spec", None)
        if spec is None:
            return cfg
        drop = [k for k in DEVICE_KEYS if k in cfg.config and not spec.supports_config_key(k)]
        if drop:
            cfg = helion.Config(**{k: v for k, v in cfg.config.items() if k not in drop})
        cfg = fit_block_sizes(bound, fit_lists(bound, cfg))
        spec.normalized_config(cfg)
        return cfg
    except (helion.exc.InvalidConfig, ValueError, TypeError, KeyError, IndexError, AssertionError) as e:
        raise ConfigMisfit(f"{type(e).__name__}: {e}") from None


# exception class names that a config causes at compile or first launch on this GPU, whatever their text (Triton's, and
# Helion's InvalidConfig for a combination its code generation refuses after normalization accepted it)
_LAUNCH_MISFIT_TYPES = ("OutOfResources", "PTXASError", "CompilationError", "InvalidConfig")


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocator's out-of-memory error (``torch.OutOfMemoryError``, or a message saying so)."""
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def launch_misfit(err: BaseException) -> str | None:
    """Why ``err``, raised by a kernel's compile or first launch with a config, means that the config does not fit
    this GPU (a shared-memory or register budget, a grid limit, a Triton compile failure at this config), or None for
    any other error: those are not a config's doing and propagate (an out-of-memory error, a CUDA error that leaves
    the context unusable, an error in the kernel's host code). Helion's own autotuner classification decides, as it
    does for its candidates (``helion.autotuner.logger.classify_triton_exception``)."""
    from helion.autotuner.logger import classify_triton_exception, match_unrecoverable_runtime_error

    text = f"{type(err).__name__}: {err}"
    if is_out_of_memory(err):
        return None
    if match_unrecoverable_runtime_error(err):
        return None
    if type(err).__name__ in _LAUNCH_MISFIT_TYPES or classify_triton_exception(err) != "raise":
        return " ".join(text.split())[:300]
    return None


@dataclasses.dataclass
class Choice:
    """Choosing the config of one kernel call from the stored files: the module doc's chain without its search step
    (``kernels.first_use.select_config`` runs the whole chain). Made by ``choice_for``; ``bound`` is the kernel bound
    at the call's arguments."""

    kernel_name: str
    bound: Any
    dims: Mapping[str, Any]
    default: helion.Config | Mapping[str, Any]
    arch: str
    root: Path | None  # the committed configs (None: kernels/configs)
    rt: Runtime
    adjust: Callable[[dict], dict] | None = None

    @property
    def key(self) -> str:
        return shape_key(**self.dims)

    @property
    def cache_path(self) -> Path:
        """The user-cache file of this kernel (``record`` writes it, first-use tuning stores its winners there)."""
        return config_path(self.kernel_name, self.arch, self.rt.cache_root)

    def fit(self, cfg: helion.Config | Mapping[str, Any]) -> helion.Config:
        """``fit_config`` for this call; raises ``ConfigMisfit``."""
        return fit_config(self.bound, cfg, self.adjust)

    def fits(self, cfg, source: str, source_key: str | None) -> helion.Config | None:
        """``cfg`` fitted to this call, or None with one warning per (kernel, shape, source) naming where it came
        from."""
        try:
            return self.fit(cfg)
        except ConfigMisfit as e:
            warn_once(self.kernel_name, f"misfit:{self.key}:{source}:{source_key}",
                       f"nano_hybrid kernels: the {source} config of {self.kernel_name} tuned at {source_key} does not "
                       f"fit the kernel at this call's shape {self.key} ({e}); skipped")
            return None

    def cache_entry(self, reread: bool = False) -> dict | None:
        """The user cache's exact entry for this call's shape (``reread``: from the file as it is now)."""
        if reread:
            _FILE_CACHE.pop(self.cache_path, None)
        return _entries(self.kernel_name, self.arch, self.rt.cache_root).get(self.key)

    def exact(self) -> tuple[helion.Config, str] | None:
        """``(config, "exact")`` from the committed file, else ``(config, "cache")`` from the user cache, for this
        exact shape and fitting this call; None when neither has one."""
        committed = _entries(self.kernel_name, self.arch, self.root)
        if self.key in committed and (cfg := self.fits(committed[self.key]["config"], "committed", self.key)) is not None:
            return cfg, "exact"
        entry = self.cache_entry()
        if entry is not None and (cfg := self.fits(entry["config"], "user-cache", self.key)) is not None:
            return cfg, "cache"
        return None

    def nearest(self) -> list[tuple[str, str, dict]]:
        """``[(source, key, entry)]`` of the other tuned shapes of the committed file and the user cache, nearest
        first (``nearest_entries``' distance; committed before user-cache at equal distance)."""
        near = [("committed", k, e) for k, e in nearest_entries(_entries(self.kernel_name, self.arch, self.root),
                                                                 self.dims)]
        near += [("user-cache", k, e) for k, e in nearest_entries(_entries(self.kernel_name, self.arch,
                                                                           self.rt.cache_root), self.dims)]
        near.sort(key=lambda t: _distance(self.dims, t[2]["dims"]))
        return near

    def fallbacks(self) -> Iterator[tuple[helion.Config, str, str]]:
        """``(config, how, what)`` of the candidates when no exact config applies, in the chain's order: the nearest
        tuned shapes' configs that fit (how "nearest"), the generic default if it fits ("default"), last the bound
        kernel's spec default ("spec-default", valid for every shape). ``what`` names the choice in words. A
        candidate that does not fit is skipped with ``fits``' warning."""
        for source, k, e in self.nearest():
            cfg = self.fits(e["config"], source, k)
            if cfg is not None:
                path = config_path(self.kernel_name, self.arch, self.root if source == "committed" else self.rt.cache_root)
                yield cfg, "nearest", f"the nearest tuned shape {k} from the {source} file {path}"
        cfg = self.fits(self.default, "generic default", "any shape")
        if cfg is not None:
            yield cfg, "default", f"the kernel's generic default config {config_to_dict(cfg)}"
        cfg = fit_config(self.bound, self.bound.config_spec.default_config())
        yield cfg, "spec-default", f"the kernel's Helion spec default config {config_to_dict(cfg)}"

    def fallback(self, notice: bool = True) -> tuple[helion.Config, str, str]:
        """The first of ``fallbacks``: ``(config, how, what)`` when no exact config applies. ``notice``: say the
        choice once per kernel (a caller that says it in its own message passes False)."""
        cfg, how, what = next(self.fallbacks())
        if notice and how == "nearest":
            warn_once(self.kernel_name, "nearest",
                       f"nano_hybrid kernels: no tuned {self.arch} config for {self.kernel_name} at {self.key}; "
                       f"using {what} (said once per kernel)")
        # on an arch with no committed configs, the arch's one notice already says that kernels run their defaults
        elif notice and not (how == "default" and not arch_has_configs(self.arch, self.root)):
            warn_once(self.kernel_name, "default",
                       f"nano_hybrid kernels: no tuned {self.arch} config for {self.kernel_name} at {self.key} that "
                       f"fits (none in {config_path(self.kernel_name, self.arch, self.root)}); using {what} "
                       f"(said once per kernel)")
        return cfg, how, what


def choice_for(
    kernel_name: str,
    kernel,
    args: Sequence[object],
    dims: Mapping[str, Any],
    default: helion.Config | Mapping[str, Any],
    *,
    arch: str | None = None,
    root: Path | None = None,
    rt: Runtime | None = None,
    adjust: Callable[[dict], dict] | None = None,
    bound=None,
) -> Choice | None:
    """The ``Choice`` of this call, or None where no stored config applies: a kernel in Helion's eager reference mode
    or arch ``cpu`` runs its default. ``bound``: the kernel bound at ``args`` if the caller has it. Says once per
    arch when the arch has no committed configs."""
    arch = arch or current_arch()
    if kernel_in_ref_mode(kernel) or arch == "cpu":
        return None
    _notice_arch_without_configs(arch, root)
    return Choice(kernel_name, bound if bound is not None else kernel.bind(tuple(args)), dict(dims), default, arch,
                  root, rt or runtime(), adjust)


def stored_config(
    kernel_name: str,
    kernel,
    args: Sequence[object],
    dims: Mapping[str, Any],
    default: helion.Config | Mapping[str, Any],
    **where: Any,
) -> tuple[helion.Config, str]:
    """The config ``kernel`` runs with at this call from the stored files alone (no search, whatever the runtime's
    ``autotune``), and where it came from ("exact", "cache", "nearest", "default", "spec-default"). ``where``: the
    keywords of ``choice_for``."""
    c = choice_for(kernel_name, kernel, args, dims, default, **where)
    if c is None:
        return as_config(default), "default"
    got = c.exact()
    return got if got is not None else c.fallback()[:2]


# ----------------------------------------------------------------------------------------------
# running a kernel with a fixed config

def _arg_signature(args: Sequence[object]) -> tuple:
    """Hashable signature of kernel arguments: what a compiled Helion kernel is specialised on, and each tensor's
    storage offset (with its shape and strides it decides whether the call needs 64-bit indices,
    ``with_index_dtype_for``).

    Called once per kernel launch (tuned_call's fast path), so it stays cheap: torch.Size, stride
    tuples and torch.device are hashable as they are."""
    sig = []
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append((a.dtype, a.shape, a.stride(), a.device, a.storage_offset()))
        elif a is None or isinstance(a, (int, float, bool, str)):
            sig.append((type(a), a))
        elif isinstance(a, (tuple, list)):
            sig.append(("L", _arg_signature(a)))
        else:
            sig.append(("O", type(a).__name__, repr(a)))
    return tuple(sig)


# Launch a compiled kernel's Triton binary directly after its first launch (see FastLauncher; the helion backend's
# ``HelionSettings.fast_launch``, applied by ``kernels.registry.configure_backend``). On the H200 the fused op's outputs
# and gradients are bitwise equal with and without it
# (tests/test_mamba_split_helion.py::test_fast_launch_gives_bitwise_equal_results), and the RMSNorm
# backward takes 213 us of wall time per call with it against 347 us without (bench_norm_conv --profile).

class FastLauncher:
    """A ``_launcher`` for one compiled Helion kernel that skips Triton's per-call argument binding.

    The generated host code calls ``_launcher(triton_kernel, grid, *args, num_warps=, num_stages=)``; Helion's
    default launcher goes through ``JITFunction.run``, which binds and specialises every argument, builds the
    cache key and looks the binary up on each call (tens of us of host time per launch on the H200 host,
    the RMSNorm backward took 230 us of wall time per call for 107 us of device time). The first
    call, and any call whose launch key differs from the last one, still goes through Helion's launcher and
    keeps the ``CompiledKernel`` it returns; the others call that binary's launcher with the same arguments
    ``JITFunction.run`` would pass (``kernel.run(grid..., stream, function, packed_metadata, launch_metadata,
    hooks, *args)``). A FastLauncher is made by ``with_launcher`` for one compiled kernel, which ``compiled`` keeps
    per argument signature (every tensor's dtype, shape, strides, device and storage offset, every other value); with
    that signature, the launch key (``launch_key``: every tensor's address modulo 16, the exact value of every other
    argument) is stricter than Triton's specialisation. Triton's per-call debug, instrumentation and pre-run hooks
    are not consulted on the fast path: set them before a kernel's first launch. Calls with any other launcher keyword
    (remote copies, persistent state, cooperative grids) always take Helion's path."""

    __slots__ = ("jit", "key", "kernel", "n_fast", "n_slow")

    def __init__(self):
        self.jit = None
        self.key = None
        self.kernel = None
        self.n_fast = 0
        self.n_slow = 0

    @staticmethod
    def launch_key(args: Sequence[object]) -> tuple:
        """Each tensor's address modulo 16 and every other argument's type and value. A FastLauncher belongs to one
        compiled kernel, which ``compiled`` keeps per argument signature: the tensors' dtypes and devices are fixed
        by it (the kernel's own outputs follow its inputs'), so only their alignment can change between calls."""
        return tuple([a.data_ptr() & 15 if isinstance(a, torch.Tensor) else (type(a), a) for a in args])

    def __call__(self, triton_kernel, grid, *args, num_warps, num_stages, **kwargs):
        if not kwargs and self.kernel is not None and triton_kernel is self.jit and self.launch_key(args) == self.key:
            k = self.kernel
            g = tuple(grid)
            stream = _current_stream()
            enter, exit_ = _launch_hooks()
            # Triton's launch_metadata is None without an enter hook; it is only asked for when one is set
            k.run(g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1, stream, k.function, k.packed_metadata,
                  None if enter is None else k.launch_metadata(g, stream, *args), enter, exit_, *args)
            self.n_fast += 1
            return k
        from helion.runtime import default_launcher

        self.n_slow += 1
        k = default_launcher(triton_kernel, grid, *args, num_warps=num_warps, num_stages=num_stages, **kwargs)
        arg_names = getattr(getattr(getattr(k, "src", None), "fn", None), "arg_names", None)
        if kwargs or k is None or arg_names is None or len(arg_names) != len(args):
            self.kernel = None  # defaults or extra launcher arguments: keep Helion's path
        else:
            self.jit, self.key, self.kernel = triton_kernel, self.launch_key(args), k
        return k


_MARKERS: dict[tuple, torch.Tensor] = {}


def _device_key(device) -> torch.device:
    """``device`` as a torch.device with its index (a bare "cuda" is the current device). Called on every backward
    (dtype markers, read-only zeros): a torch.device that already names its card is returned as it is."""
    if isinstance(device, torch.device) and (device.index is not None or device.type != "cuda"):
        return device
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def dtype_marker(dtype: torch.dtype, device) -> torch.Tensor:
    """A zero-size tensor of ``dtype`` on ``device``, what a kernel takes to learn the dtype of an output it
    allocates (its ``like`` argument): one per (dtype, device), kept for the process, so a call allocates none."""
    key = (dtype, _device_key(device))
    t = _MARKERS.get(key)
    if t is None:
        t = _MARKERS[key] = torch.empty(0, dtype=dtype, device=device)
    return t


_ZEROS: dict[tuple, torch.Tensor] = {}


def zeros_input(shape: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    """A zero tensor that kernels only read (a gradient that does not flow, e.g. the final states'), one per (shape,
    dtype, device), kept for the process: a backward without that gradient launches no fill for it. Never write
    into it."""
    key = (tuple(shape), dtype, _device_key(device))
    t = _ZEROS.get(key)
    if t is None:
        t = _ZEROS[key] = torch.zeros(*shape, dtype=dtype, device=device)
    return t


def _current_stream() -> int:
    # the current device's current stream; CUDA is initialised by the time a compiled kernel has launched once
    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())


def _launch_hooks() -> tuple:
    rt = triton_knobs.runtime
    return rt.launch_enter_hook, rt.launch_exit_hook


def launches_on_cuda(args: Sequence[object]) -> bool:
    """FastLauncher drives Triton's CUDA launcher: only kernels whose tensors are on a CUDA device use it."""
    return any(isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in args)



# The largest element offset a kernel indexes with 32-bit integers. Helion picks 64-bit indices by itself only when a
# tensor has more elements than this; a strided view (a slice of zxbcdt, a (b, l, d) view of (l, b, d) memory) can
# have fewer elements and still reach offsets past it, which Helion's code generation refuses (IndexOffsetOutOfRange).
INT32_INDEX_LIMIT = torch.iinfo(torch.int32).max
_INT64_TWINS: dict[int, tuple[Any, Any]] = {}  # id(kernel) -> (kernel, its 64-bit index twin)


def _max_offset(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return t.storage_offset() + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))


def needs_int64_index(args: Sequence[object]) -> bool:
    """Whether any tensor argument has more elements than ``INT32_INDEX_LIMIT`` or an element past that offset in its
    storage (the storage offset included)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.numel() > INT32_INDEX_LIMIT or _max_offset(a) > INT32_INDEX_LIMIT:
                return True
        elif isinstance(a, (list, tuple)) and needs_int64_index(a):
            return True
    return False


def with_index_dtype_for(kernel, args: Sequence[object]):
    """``kernel``, or its twin with 64-bit indices (``index_dtype=torch.int64``, same function, configs and other
    settings; made once per kernel) when ``needs_int64_index(args)`` and the kernel does not fix an index dtype.
    Callers decide once per argument signature (``_arg_signature``: shapes, strides and storage offsets)."""
    if getattr(getattr(kernel, "settings", None), "index_dtype", 0) is not None or not needs_int64_index(args):
        return kernel
    got = _INT64_TWINS.get(id(kernel))
    if got is None or got[0] is not kernel:
        twin = type(kernel)(kernel.fn, configs=kernel.configs,
                            settings=dataclasses.replace(kernel.settings, index_dtype=torch.int64))
        got = _INT64_TWINS[id(kernel)] = (kernel, twin)
    return got[1]


def compiled(kernel, args: Sequence[object], config: helion.Config | Mapping[str, Any], *,
             rt: Runtime | None = None, bound=None, generated: Callable | None = None) -> Callable:
    """Compiled callable of ``kernel`` for this argument signature and config (cached in the runtime); with 64-bit
    indices where an argument reaches past 32-bit offsets (``with_index_dtype_for``; ``bound`` is then ignored unless
    it is the twin's). ``generated``: the function Helion generated for them, loaded from ``kernels.compile_cache``;
    it is used as it is, without binding the kernel or compiling.

    With ``NANO_HELION_DUMP_DIR`` set (``kernels.debug``), each compilation also writes the normalized config and the
    generated Triton source there (``<kernel>_<sha>.py``): a diagnostic for comparing what two
    processes actually run for the same kernel, config and argument signature."""
    rt = rt or runtime()
    wide = with_index_dtype_for(kernel, args)
    if wide is not kernel:
        kernel = wide
        if bound is not None and getattr(bound, "kernel", None) is not wide:
            bound = None
    cfg = with_flat_pid(as_config(config))
    key = (id(kernel), _arg_signature(args), cfg.to_json())
    fn = rt.compiled.get(key)
    if fn is None and generated is not None:
        fn = rt.compiled[key] = with_launcher(generated, args, rt)
    elif fn is None:
        bound = bound if bound is not None else kernel.bind(tuple(args))
        cfg = fit_block_sizes(bound, fit_lists(bound, cfg))
        fn = with_launcher(bound.compile_config(cfg, allow_print=False), args, rt)
        rt.compiled[key] = fn
        dump = debug.dump_dir()
        if dump is not None:
            _dump_code(dump, kernel, bound, cfg, args)
    return fn


def with_launcher(fn: Callable, args: Sequence[object], rt: Runtime) -> Callable:
    """A compiled kernel's callable with the runtime's launcher: a ``FastLauncher`` of its own with
    ``fast_launch`` on CUDA arguments, else Helion's."""
    if rt.settings.fast_launch and launches_on_cuda(args):
        return functools.partial(fn, _launcher=FastLauncher())
    return fn


def fit_block_sizes(bound, cfg: helion.Config) -> helion.Config:
    """``cfg`` with every block size clamped to the dimension it tiles (its next power of two).

    A config found at one shape is also used at others (nearest-shape fallback, generic defaults), and
    Helion compiles a block larger than its dimension as a tile whose extra lanes are masked: wasted
    work, and lanes that load 0 where the kernel's math assumes real data. On the H200 that turned a
    Nano config (row block 128) at a model with chunk 64 into exp(-dA_cumsum) = inf on those lanes and
    NaN gradients after 16 steps. Clamping keeps the same tiling of the real elements."""
    bs = cfg.config.get("block_sizes")
    if not isinstance(bs, list) or not bs:
        return cfg
    spec = getattr(bound, "config_spec", None)
    specs = getattr(spec, "block_sizes", None)
    if specs is None or len(bs) != len(specs):
        return cfg
    fit = []
    for b, sp in zip(bs, specs):
        # size_hint is the tiled dimension (max_size is not: Helion's config generation can raise it)
        cap = max(int(sp.min_size), _next_pow2(int(sp.size_hint)))
        fit.append(min(int(b), cap) if isinstance(b, int) else b)
    if fit == bs:
        return cfg
    name = getattr(getattr(bound, "kernel", None), "name", None) or "kernel"
    warn_once(name, f"block-sizes:{bs}->{fit}",
               f"nano_hybrid kernels: block sizes {bs} of the config exceed this shape's dimensions in {name}; "
               f"using {fit}")
    return helion.Config(**dict(cfg.config, block_sizes=fit))


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# the config lists with one entry per memory access, and those with one entry per loop of a kind (Helion's ConfigSpec)
_ACCESS_LISTS = ("indexing", "load_eviction_policies", "atomic_indexing", "load_cache_modifiers",
                 "store_cache_modifiers")
_LOOP_LISTS = ("loop_orders", "l2_groupings", "flatten_loops", "reduction_loops", "range_unroll_factors",
               "range_warp_specializes", "range_num_stages", "range_multi_buffers", "range_flattens", "static_ranges")


def fit_lists(bound, cfg: helion.Config) -> helion.Config:
    """``cfg`` with its per-access and per-loop lists fitted to this specialisation of the kernel.

    A stored config is keyed by shape only, but some of its lists have one entry per item of the specialisation
    it was tuned on, and another specialisation of the kernel can have more or fewer items:

    - the access lists (``indexing``, ``load_eviction_policies``, ``atomic_indexing``, the cache modifiers), one
      entry per load or store; arguments such as ``seq_idx`` add loads. Helion's code generation refuses a list
      that is too short.
    - the per-loop lists (``static_ranges``, ``range_*``, ``loop_orders``, ``l2_groupings``, ``flatten_loops``,
      ``reduction_loops``), one entry per loop that takes the setting; the shape can change which loops do.
      Helion offers ``static_ranges`` only for a loop of at most 8 iterations known at compile time, so the head
      loop ``hl.grid(h // g)`` of ``ssd_bwd_db`` and ``ssd_bwd_dc_dcb`` has one at 8 heads per group and none at
      80. Helion's normalization refuses a list that is too long.

    A list whose length does not match is resized when all its entries agree (the same setting for every item:
    nothing the tuning chose is lost, and nothing is said); an empty one, or one of mixed settings, is replaced
    by this specialisation's default for that key (said once per kernel for mixed settings). Matching lists are
    kept, and a config whose lists all match is returned as it is. The lengths wanted are those of the bound
    spec's ``default_config()``: a key that the spec supports and its default omits wants an empty list (Helion's
    normalization drops empty lists), a key the spec does not support is left to Helion."""
    d = dict(cfg.config)
    keys = [k for k in (*_ACCESS_LISTS, *_LOOP_LISTS) if isinstance(d.get(k), list)]
    if not keys:
        return cfg
    spec = bound.config_spec
    want = spec.default_config().config
    changed, mixed = False, []
    for k in keys:
        v, w = d[k], want.get(k, [] if spec.supports_config_key(k) else None)
        if not isinstance(w, list) or len(v) == len(w):
            continue
        changed = True
        if v and all(x == v[0] for x in v):
            d[k] = [copy.deepcopy(v[0]) for _ in w]
        else:
            d[k] = copy.deepcopy(w)
            if v:
                mixed.append(k)
    if not changed:
        return cfg
    if mixed:
        name = getattr(getattr(bound, "kernel", None), "name", None) or "kernel"
        warn_once(name, "lists:" + ",".join(mixed),
                   f"nano_hybrid kernels: the config's {', '.join(mixed)} list(s) do not fit this specialisation of "
                   f"{name} (tuned for another argument set or shape, e.g. with seq_idx or another number of heads "
                   f"per group); using this specialisation's defaults there")
    return helion.Config(**d)


def with_flat_pid(cfg: helion.Config) -> helion.Config:
    """``cfg`` with ``pid_type="flat"`` when it names none.

    Helion 1.5.0 fills a missing pid_type from the kernel's allowed list, and in a process where
    torch.distributed is initialized (every Megatron training process, even on one GPU) with torch
    2.11 that list starts with ``persistent_blocked``: measured on an H200 in the training step, the
    generic configs then ran as persistent kernels with one program per SM, 6x slower for
    ssd_bwd_state_passing (1.25 ms vs 0.20 ms), 3.5x for the RMSNorm forward and 2.5x for the conv1d
    backward. Our configs (generic defaults and the tuner's winners) are meant as flat grids, so the
    choice is made explicit here; a config that names a pid_type keeps it."""
    if "pid_type" in cfg.config:
        return cfg
    return helion.Config(**{**cfg.config, "pid_type": "flat"})


def _dump_code(root: Path, kernel, bound, cfg: helion.Config, args: Sequence[object]) -> None:
    import hashlib

    try:
        full = bound.config_spec.normalized_config(cfg)
        code = bound.to_triton_code(full)
    except Exception as e:  # noqa: BLE001 - a diagnostic must not break the run
        code, full = f"# codegen for the dump failed: {type(e).__name__}: {e}\n", cfg
    name = getattr(kernel, "name", None) or getattr(getattr(kernel, "fn", None), "__name__", "kernel")
    sig = repr(_arg_signature(args))
    sha = hashlib.sha1((sig + code).encode()).hexdigest()[:10]
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{name}_{sha}.py").write_text(f"# config {config_to_dict(full)}\n# args {sig}\n{code}")


def full_config(kernel, args: Sequence[object], config: helion.Config | Mapping[str, Any]) -> helion.Config:
    """``config`` with every key Helion would otherwise fill in at compile time made explicit
    (what the tuner writes, so a committed config means the same kernel in every process)."""
    return kernel.bind(tuple(args)).config_spec.normalized_config(as_config(config))


def run_with_config(kernel, args: Sequence[object], config: helion.Config | Mapping[str, Any]):
    """Run ``kernel(*args)`` with ``config`` (compiled once per signature); eager under interpret."""
    if kernel_in_ref_mode(kernel):
        return run_interpret(kernel, args, config)
    return compiled(kernel, args, config)(*args)


def kernel_in_ref_mode(kernel) -> bool:
    """True when ``kernel`` was created under ``HELION_INTERPRET=1`` (Helion fixes this at decoration)."""
    from helion.runtime.ref_mode import RefMode

    return kernel.settings.ref_mode != RefMode.OFF


def run_interpret(kernel, args: Sequence[object], config: helion.Config | Mapping[str, Any]):
    """Helion's eager reference mode (``HELION_INTERPRET=1``) with ``config`` visible to
    ``hl.register_tunable`` (block sizes from ``register_block_size`` are the full extent there)."""
    from helion.runtime.ref_mode import RefModeContext

    bound = kernel.bind(tuple(args))
    with RefModeContext(bound.env, as_config(config)):
        return kernel.fn(*args)

