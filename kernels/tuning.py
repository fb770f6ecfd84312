"""Per-GPU Helion configs as committed files, and the config search that produces them.

Files
-----
``kernels/configs/<arch>/<kernel_name>.json`` (arch = ``current_arch()``, e.g. ``sm90`` for H100/H200,
``sm100`` for B200)::

    {"kernel": "rmsnorm_bwd", "arch": "sm90",
     "entries": {"<shape_key>": {"dims": {...}, "config": {<helion.Config dict>},
                                 "time_ms": 0.123, "date": "2026-11-29T...", "gpu": "NVIDIA H200",
                                 "meta": {...}}}}

Lookup (``get_config``)
-----------------------
1. CPU / ``HELION_INTERPRET=1``: the kernel's ``default`` (interpret mode ignores configs anyway).
2. exact ``shape_key(**dims)`` entry in the file for this arch;
3. else the *nearest tuned shape*: among entries whose dims have the same names and identical
   non-integer values, the one minimising ``sum_k |log2(dims[k] / entry[k])|`` (log-space L1
   distance; ties broken by the sorted shape key);
4. else ``default``.
Cases 3 and 4 emit ONE ``warnings.warn`` per (kernel, shape) naming what was used.

Calling a kernel with a chosen config (``run_with_config``)
-----------------------------------------------------------
On GPU: ``kernel.bind(args).compile_config(config)`` gives a compiled callable; it is cached per
(kernel, argument signature: dtype/shape/stride/device of tensors and values of scalars, config), so
a training step pays one dict lookup per launch. Wrappers never call ``kernel(*args)`` on GPU, so
Helion's own autotuner never runs in a training step. Under ``HELION_INTERPRET=1`` (CPU) the kernel
function runs in Helion's eager reference mode with the config visible to ``hl.register_tunable``.

Autotuning at run time
----------------------
Off by default. ``set_autotune(True)`` (what ``kernels.autotune=true`` maps to) makes ``tuned_call``
run ``search`` once per (kernel, shape) that has no exact entry, with the candidates of the
kernel's ``TuneCase`` builder if given, and keep the winner in memory for this process (it is not
written to the committed files; use ``scripts/tune_kernels.py`` for that).

Search (``search``)
-------------------
Helion's own autotuner returned ``NoConfigFound`` on the H200 host (see kernels/README.md), so we
drive the search ourselves: every candidate is compiled as a fixed config, run once, its outputs are
compared with the reference config's outputs (the kernel's default config), and then timed
in-process with CUDA events (``triton.testing.do_bench`` median when available). Candidates that fail
to compile, crash, or disagree are skipped and logged. The wall-clock budget is respected between
candidates.

Registry of tunable kernels
---------------------------
Each kernel module may expose ``TUNABLE_KERNELS: dict[str, Callable[[dict, torch.device], TuneCase]]``;
the callable receives *model dims* (a ``SHAPE_PRESETS`` entry: b, l, h, p, g, n, c, w) and returns a
``TuneCase`` (kernel, args, kernel dims, seed configs, tolerances). ``discover_tunable_kernels()``
imports every ``kernels.*`` module and collects them, so new kernel modules need no edit here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import datetime as _dt
import importlib
import itertools
import json
import math
import os
import pkgutil
import random
import signal
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

import helion

from kernels import debug

CONFIG_ROOT = Path(__file__).resolve().parent / "configs"

# Model-level shape presets (Nemotron-3 Nano mixer dims per rank). Kernel TuneCase builders derive their own kernel
# dims from these. "nano" is the benchmark shape; nano_b1 (recipe nano30b_slice_h200), nano_b4_l4096
# (convergence_ab_h200) and nano_b4_l1024 (convergence_ab_h200_2000*) are what the GPU recipes run
# (tests/test_tuning.py::test_recipe_shapes_have_tuned_configs); nano_tp2 is the mixer at tensor parallel 2.
SHAPE_PRESETS: dict[str, dict[str, int]] = {
    "nano": dict(b=2, l=8192, h=64, p=64, g=8, n=128, c=128, w=4),
    "nano_b1": dict(b=1, l=8192, h=64, p=64, g=8, n=128, c=128, w=4),
    "nano_tp2": dict(b=2, l=8192, h=32, p=64, g=4, n=128, c=128, w=4),
    "nano_b4_l4096": dict(b=4, l=4096, h=64, p=64, g=8, n=128, c=128, w=4),
    "nano_b4_l1024": dict(b=4, l=1024, h=64, p=64, g=8, n=128, c=128, w=4),
    # model=nano_proxy (16 heads of Nano's dims) as recipe convergence_seeds_h200 runs it: micro-batch 4 x 1024
    "nano_proxy": dict(b=4, l=1024, h=16, p=64, g=8, n=128, c=128, w=4),
}

_AUTOTUNE = False
_WARNED: set[tuple[str, str]] = set()
_FILE_CACHE: dict[Path, dict] = {}
_COMPILED: dict[tuple, Callable] = {}
# (kernel name, id(kernel), argument signature) -> compiled callable: the per-call fast path of
# tuned_call (no config lookup, no Config objects, no JSON per call once a signature has been seen)
_FAST: dict[tuple, Callable] = {}
_AUTOTUNED: dict[tuple[str, str], helion.Config] = {}


# ----------------------------------------------------------------------------------------------
# basic helpers


def set_autotune(enabled: bool) -> None:
    """Allow (True) or forbid (False, default) config searches inside ``tuned_call``."""
    global _AUTOTUNE
    _AUTOTUNE = bool(enabled)
    _FAST.clear()


def autotune_enabled() -> bool:
    return _AUTOTUNE


def interpret_mode() -> bool:
    return os.environ.get("HELION_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def current_arch() -> str:
    """``"sm90"``, ``"sm100"``, ... from the current CUDA device capability; ``"cpu"`` without CUDA."""
    if not torch.cuda.is_available():
        return "cpu"
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


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


def _as_config(cfg: helion.Config | Mapping[str, Any]) -> helion.Config:
    if isinstance(cfg, helion.Config):
        return cfg
    if isinstance(cfg, Mapping):
        return helion.Config.from_dict(dict(cfg))
    raise TypeError(f"expected helion.Config or dict, got {type(cfg).__name__}")


def config_to_dict(cfg: helion.Config | Mapping[str, Any]) -> dict:
    return json.loads(_as_config(cfg).to_json())


def config_path(kernel_name: str, arch: str | None = None, root: Path | None = None) -> Path:
    return Path(root or CONFIG_ROOT) / (arch or current_arch()) / f"{kernel_name}.json"


def _load_file(path: Path) -> dict:
    if path in _FILE_CACHE:
        return _FILE_CACHE[path]
    if path.exists():
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data.get("entries"), dict):
            raise ValueError(f"{path}: malformed config file (no 'entries' dict)")
    else:
        data = {"entries": {}}
    _FILE_CACHE[path] = data
    return data


def clear_caches() -> None:
    """Forget loaded files, compiled kernels, warnings already given and in-process autotune results."""
    _FILE_CACHE.clear()
    _COMPILED.clear()
    _FAST.clear()
    _WARNED.clear()
    _AUTOTUNED.clear()


def _distance(a: Mapping[str, Any], b: Mapping[str, Any]) -> float | None:
    if set(a) != set(b):
        return None
    d = 0.0
    for k, va in a.items():
        vb = b[k]
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


def lookup(kernel_name: str, dims: Mapping[str, Any], arch: str | None = None, root: Path | None = None):
    """Return ``(how, key, entry)`` with how in {"exact", "nearest", "none"} (no CPU shortcut)."""
    key = shape_key(**dims)
    entries = _load_file(config_path(kernel_name, arch, root))["entries"]
    if key in entries:
        return "exact", key, entries[key]
    best = None
    for k in sorted(entries):
        e = entries[k]
        d = _distance(dims, e.get("dims", {}))
        if d is not None and (best is None or d < best[0]):
            best = (d, k, e)
    if best is not None:
        return "nearest", best[1], best[2]
    return "none", None, None


def _warn_once(kernel_name: str, what: str, msg: str) -> None:
    """One warning per (kernel, what) and process. The config fallback warns with what="config": once per kernel,
    naming the first shape without a tuned entry."""
    if (kernel_name, what) in _WARNED:
        return
    _WARNED.add((kernel_name, what))
    warnings.warn(msg, stacklevel=3)


def get_config(
    kernel_name: str,
    dims: Mapping[str, Any],
    default: helion.Config | Mapping[str, Any],
    *,
    arch: str | None = None,
    root: Path | None = None,
) -> helion.Config:
    """Config for ``kernel_name`` at ``dims`` on this GPU arch (see module doc for the order)."""
    default = _as_config(default)
    arch = arch or current_arch()
    if arch == "cpu" or interpret_mode():
        return default
    key = shape_key(**dims)
    if (kernel_name, key) in _AUTOTUNED:
        return _AUTOTUNED[(kernel_name, key)]
    how, used_key, entry = lookup(kernel_name, dims, arch, root)
    if how == "exact":
        return _as_config(entry["config"])
    path = config_path(kernel_name, arch, root)
    if how == "nearest":
        _warn_once(
            kernel_name,
            "config",
            f"nano_hybrid kernels: no tuned {arch} config for {kernel_name} at {key}; "
            f"using the nearest tuned shape {used_key} from {path} (warned once per kernel)",
        )
        return _as_config(entry["config"])
    _warn_once(
        kernel_name,
        "config",
        f"nano_hybrid kernels: no tuned {arch} config for {kernel_name} at {key} (no entry in {path}); "
        f"using the kernel's generic default config {config_to_dict(default)} (warned once per kernel)",
    )
    return default


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
    """Write/update the entry for (kernel, shape) in ``configs/<arch>/<kernel>.json``."""
    arch = arch or current_arch()
    path = config_path(kernel_name, arch, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.exists() else {}
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
    data["entries"] = dict(sorted(entries.items()))
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    _FILE_CACHE.pop(path, None)
    _FAST.clear()
    return path


# ----------------------------------------------------------------------------------------------
# running a kernel with a fixed config


def _arg_signature(args: Sequence[object]) -> tuple:
    """Hashable signature of kernel arguments: what a compiled Helion kernel is specialised on.

    Called once per kernel launch (tuned_call's fast path), so it stays cheap: torch.Size, stride
    tuples and torch.device are hashable as they are."""
    sig = []
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append((a.dtype, a.shape, a.stride(), a.device))
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
_FAST_LAUNCH = True


def set_fast_launch(enabled: bool) -> None:
    """Use ``FastLauncher`` (True) or Helion's own launcher (False). A change drops every compiled kernel, so what
    runs from now on follows the new setting."""
    global _FAST_LAUNCH
    if bool(enabled) != _FAST_LAUNCH:
        _FAST_LAUNCH = bool(enabled)
        _COMPILED.clear()
        _FAST.clear()


def fast_launch_enabled() -> bool:
    return _FAST_LAUNCH


class FastLauncher:
    """A ``_launcher`` for one compiled Helion kernel that skips Triton's per-call argument binding.

    The generated host code calls ``_launcher(triton_kernel, grid, *args, num_warps=, num_stages=)``; Helion's
    default launcher goes through ``JITFunction.run``, which binds and specialises every argument, builds the
    cache key and looks the binary up on each call (tens of us of host time per launch on the H200 host,
    the RMSNorm backward took 230 us of wall time per call for 107 us of device time). The first
    call, and any call whose launch key differs from the last one, still goes through Helion's launcher and
    keeps the ``CompiledKernel`` it returns; the others call that binary's launcher with the same arguments
    ``JITFunction.run`` would pass (``kernel.run(grid..., stream, function, packed_metadata, launch_metadata,
    hooks, *args)``). The launch key is stricter than Triton's specialisation: every tensor's dtype, device and
    16-byte alignment, and the exact value of every other argument. Calls with any other launcher keyword
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
        key = []
        for a in args:
            if isinstance(a, torch.Tensor):
                key.append((a.dtype, a.device, a.data_ptr() % 16 == 0))
            else:
                key.append((type(a), a))
        return tuple(key)

    def __call__(self, triton_kernel, grid, *args, num_warps, num_stages, **kwargs):
        if not kwargs and self.kernel is not None and triton_kernel is self.jit and self.launch_key(args) == self.key:
            k = self.kernel
            g = tuple(grid)
            stream = _current_stream()
            hooks = _launch_hooks()
            k.run(g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1, stream, k.function, k.packed_metadata,
                  k.launch_metadata(g, stream, *args), hooks[0], hooks[1], *args)
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


def _current_stream() -> int:
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())


def _launch_hooks() -> tuple:
    from triton import knobs

    return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook


def _launches_on_cuda(args: Sequence[object]) -> bool:
    """FastLauncher drives Triton's CUDA launcher: only kernels whose tensors are on a CUDA device use it."""
    return any(isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in args)


def compiled(kernel, args: Sequence[object], config: helion.Config | Mapping[str, Any]) -> Callable:
    """Compiled callable of ``kernel`` for this argument signature and config (cached).

    With ``NANO_HELION_DUMP_DIR`` set (``kernels.debug``), each compilation also writes the normalized config and the
    generated Triton source there (``<kernel>_<sha>.py``): a diagnostic for comparing what two
    processes actually run for the same kernel, config and argument signature."""
    cfg = with_flat_pid(_as_config(config))
    key = (id(kernel), _arg_signature(args), cfg.to_json())
    fn = _COMPILED.get(key)
    if fn is None:
        bound = kernel.bind(tuple(args))
        cfg = fit_block_sizes(bound, fit_access_lists(bound, cfg))
        fn = bound.compile_config(cfg, allow_print=False)
        if _FAST_LAUNCH and _launches_on_cuda(args):
            fn = functools.partial(fn, _launcher=FastLauncher())
        _COMPILED[key] = fn
        dump = debug.dump_dir()
        if dump is not None:
            _dump_code(dump, kernel, bound, cfg, args)
    return fn


_ACCESS_LISTS = ("indexing", "load_eviction_policies", "atomic_indexing")


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
    _warn_once(name, f"block-sizes:{bs}->{fit}",
               f"nano_hybrid kernels: block sizes {bs} of the config exceed this shape's dimensions in {name}; "
               f"using {fit}")
    return helion.Config(**dict(cfg.config, block_sizes=fit))


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def fit_access_lists(bound, cfg: helion.Config) -> helion.Config:
    """``cfg`` with its per-memory-access lists fitted to this specialisation of the kernel.

    A committed config is keyed by shape only, but its ``indexing`` / ``load_eviction_policies`` /
    ``atomic_indexing`` lists have one entry per load/store of the specialisation it was tuned on.
    Another specialisation of the same shape (e.g. with ``seq_idx`` or initial states, which add loads)
    needs lists of another length, and Helion refuses a list that is too short. A list whose length
    does not match is replaced: ``indexing`` by its single strategy when all entries agree (Helion
    applies a string to every access), else by the kernel's defaults for this specialisation, as are
    the other two lists. Matching lists are kept."""
    d = dict(cfg.config)
    if not any(isinstance(d.get(k), list) for k in _ACCESS_LISTS):
        return cfg
    want = bound.config_spec.default_config().config
    changed = []
    for k in _ACCESS_LISTS:
        v = d.get(k)
        if not isinstance(v, list) or not isinstance(want.get(k), list) or len(v) == len(want[k]):
            continue
        if k == "indexing" and v and all(x == v[0] for x in v):
            d[k] = v[0]
        else:
            d[k] = list(want[k])
        changed.append(k)
    if not changed:
        return cfg
    name = getattr(getattr(bound, "kernel", None), "name", None) or "kernel"
    _warn_once(name, "access-lists:" + ",".join(changed),
               f"nano_hybrid kernels: the config's {', '.join(changed)} list(s) do not fit this specialisation of "
               f"{name} (another argument set than the tuned one, e.g. with seq_idx); using the kernel's defaults there")
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
    return kernel.bind(tuple(args)).config_spec.normalized_config(_as_config(config))


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
    with RefModeContext(bound.env, _as_config(config)):
        return kernel.fn(*args)


def fast_lookup(tag: str, kernel, args: Sequence[object]):
    """(key, compiled callable or None) for ``args`` under ``tag``: the per-call fast path for wrappers
    that choose their config themselves; store with ``fast_store(key, fn)`` after the first call."""
    key = (tag, id(kernel), _arg_signature(args))
    return key, _FAST.get(key)


def fast_store(key: tuple, fn: Callable) -> Callable:
    _FAST[key] = fn
    return fn


def tuned_call(
    kernel_name: str,
    kernel,
    args: Sequence[object],
    dims: Mapping[str, Any],
    default: helion.Config | Mapping[str, Any],
    *,
    seeds: Sequence[helion.Config | Mapping[str, Any]] = (),
    autotune_budget_s: float = 60.0,
    atol: float = 1e-2,
    rtol: float = 1e-2,
    finalize: Callable[[Any, tuple], Any] | None = None,
    prepare: Callable[[tuple], None] | None = None,
):
    """What kernel wrappers call: committed config (or fallback), or a search if autotune is on.
    ``finalize`` / ``prepare``: see ``search`` (kernels whose raw outputs depend on the config).

    After the first call with a given argument signature (dtypes, shapes, strides, devices, scalar
    values) the compiled kernel is looked up by that signature alone: the host cost per call is one
    signature tuple and one dict lookup on top of Helion's launcher."""
    fkey = (kernel_name, id(kernel), _arg_signature(args))
    fn = _FAST.get(fkey)
    if fn is not None:
        return fn(*args)
    if (
        _AUTOTUNE
        and not interpret_mode()
        and torch.cuda.is_available()
        and (kernel_name, shape_key(**dims)) not in _AUTOTUNED
        and lookup(kernel_name, dims)[0] != "exact"
    ):
        cands = candidate_configs(kernel, args, seeds=seeds, n_random=16)
        best, _ = search(kernel, args, cands, budget_s=autotune_budget_s, atol=atol, rtol=rtol,
                         finalize=finalize, prepare=prepare)
        _AUTOTUNED[(kernel_name, shape_key(**dims))] = best
    cfg = get_config(kernel_name, dims, default)
    if kernel_in_ref_mode(kernel):
        return run_interpret(kernel, args, cfg)
    fn = compiled(kernel, args, cfg)
    _FAST[fkey] = fn
    return fn(*args)


# ----------------------------------------------------------------------------------------------
# candidate generation and search


@dataclasses.dataclass
class TuneCase:
    """One tunable kernel at one shape: what ``scripts/tune_kernels.py`` searches."""

    kernel: Any  # a helion Kernel
    args: tuple
    dims: dict  # kernel dims (the shape key of the file entry)
    default: helion.Config | dict  # the generic config used when nothing is tuned
    seeds: list = dataclasses.field(default_factory=list)  # partial config dicts / Configs
    atol: float = 1e-2
    rtol: float = 1e-2
    n_random: int = 24
    # (raw kernel outputs, args) -> the config-independent results the search compares, e.g. the
    # summed dweight instead of per-program partials whose count depends on rows_per_program, plus
    # outputs written into argument buffers. None: compare the raw outputs.
    finalize: Callable[[Any, tuple], Any] | None = None
    # args -> None, run before each candidate's checked run: poison output buffers passed as
    # arguments (e.g. fill with NaN) so a candidate that leaves elements unwritten fails the check.
    prepare: Callable[[tuple], None] | None = None


def grid_seeds(**axes: Iterable[Any]) -> list[dict]:
    """Cartesian product of partial-config values, e.g. ``grid_seeds(block_sizes=[[8],[16]], num_warps=[4,8])``."""
    names = list(axes)
    return [dict(zip(names, vals)) for vals in itertools.product(*(list(axes[n]) for n in names))]


def candidate_configs(
    kernel,
    args: Sequence[object],
    *,
    seeds: Sequence[helion.Config | Mapping[str, Any]] = (),
    n_random: int = 24,
    rng_seed: int = 0,
) -> list[helion.Config]:
    """Default config, then seeds (partial dicts layered over the default), then ``n_random`` random
    configs from the bound kernel's config space (``config_spec.create_config_generation()``).
    Duplicates are removed. Works without a GPU (binding needs no device launch)."""
    bound = kernel.bind(tuple(args))
    spec = bound.config_spec
    default = spec.default_config()
    out: list[helion.Config] = [default]
    for s in seeds:
        d = dict(default.config)
        d.update(config_to_dict(s) if isinstance(s, helion.Config) else dict(s))
        out.append(helion.Config.from_dict(d))
    if n_random > 0:
        state = random.getstate()
        random.seed(rng_seed)
        try:
            gen = spec.create_config_generation()
            for _ in range(n_random):
                try:
                    out.append(gen.random_config())
                except Exception:  # noqa: BLE001 - an unsampleable space only shortens the list
                    break
        finally:
            random.setstate(state)
    uniq, seen = [], set()
    for c in out:
        j = c.to_json()
        if j not in seen:
            seen.add(j)
            uniq.append(c)
    return uniq


def neighbour_configs(cfg: helion.Config | Mapping[str, Any]) -> list[dict]:
    """Configs one step away from ``cfg`` (a committed winner), for a search that starts from it:
    every access through TMA (``indexing="tensor_descriptor"``, Hopper and newer) or block pointers,
    every load with eviction policy "first" / "last", num_warps halved / doubled, num_stages -1 / +1.
    Per-access lists are replaced by one string (Helion applies it to every access)."""
    base = config_to_dict(cfg)
    out: list[dict] = []

    def add(**kw):
        d = dict(base)
        d.update(kw)
        if d != base and d not in out:
            out.append(d)

    add(indexing="tensor_descriptor")
    add(indexing="block_ptr")
    ev = base.get("load_eviction_policies")
    if isinstance(ev, list) and ev:
        add(load_eviction_policies=["first"] * len(ev))
        add(load_eviction_policies=["last"] * len(ev))
    w = int(base.get("num_warps", 4))
    for nw in (w // 2, w * 2):
        if 1 <= nw <= 16:
            add(num_warps=nw)
    st = int(base.get("num_stages", 1))
    for ns in (st - 1, st + 1):
        if 1 <= ns <= 5:
            add(num_stages=ns)
    return out


def _flatten_outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        res = []
        for o in out:
            res.extend(_flatten_outputs(o))
        return res
    return []


def outputs_close(a, b, atol: float, rtol: float) -> tuple[bool, float]:
    """Compare two kernel outputs (tensor or nested tuple); returns (ok, max abs error)."""
    fa, fb = _flatten_outputs(a), _flatten_outputs(b)
    if len(fa) != len(fb):
        return False, float("inf")
    worst = 0.0
    ok = True
    for x, y in zip(fa, fb):
        if x.shape != y.shape:
            return False, float("inf")
        x32, y32 = x.float(), y.float()
        if not torch.isfinite(x32).all():
            return False, float("inf")
        err = (x32 - y32).abs()
        worst = max(worst, float(err.max()) if err.numel() else 0.0)
        if not torch.all(err <= atol + rtol * y32.abs()):
            ok = False
    return ok, worst


def checked_outputs(fn: Callable, args: tuple, finalize=None, prepare=None):
    """One checked run of a compiled candidate: ``prepare(args)``, run, ``finalize(out, args)``."""
    if prepare is not None:
        prepare(args)
    out = fn(*args)
    return out if finalize is None else finalize(out, args)


TIMERS = debug.TIMERS


def timer_name() -> str:
    """The tuner's timer (``NANO_TUNE_TIMER``, see ``kernels.debug``): "events" (default) or "cudagraph"."""
    return debug.tune_timer()


def time_fn(fn: Callable[[], Any], rep_ms: float = 100.0) -> float:
    """Median milliseconds per call, measured on the GPU in-process (``timer_name()`` says how)."""
    if timer_name() == "cudagraph":
        from triton.testing import do_bench_cudagraph

        fn()  # compiled and allocated outside the capture
        torch.cuda.synchronize()
        return float(do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=max(10, rep_ms // 4), rep=rep_ms, return_mode="median"))
    except ImportError:
        pass
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    est = max(s.elapsed_time(e), 1e-3)
    n = int(max(5, min(1000, rep_ms / est)))
    times = []
    for _ in range(n):
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return float(times[len(times) // 2])


def _cuda_alive() -> bool:
    try:
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False


class CandidateTimeout(Exception):
    """A candidate's compile + check took longer than ``search``'s ``candidate_timeout_s``."""


@contextlib.contextmanager
def _time_limit(seconds: float | None):
    """Raise CandidateTimeout in this (main) thread after ``seconds`` (SIGALRM); no-op elsewhere.

    Interrupts Python code and waits on subprocesses (ptxas) at once; a long call inside a C
    extension (LLVM passes) is interrupted when it returns to Python."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def _raise(signum, frame):
        raise CandidateTimeout(f"compile + check took longer than {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def search(
    kernel,
    args: Sequence[object],
    candidates: Sequence[helion.Config | Mapping[str, Any]],
    budget_s: float,
    rep: float = 50.0,
    *,
    atol: float = 1e-2,
    rtol: float = 1e-2,
    reference: helion.Config | Mapping[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
    finalize: Callable[[Any, tuple], Any] | None = None,
    prepare: Callable[[tuple], None] | None = None,
    candidate_timeout_s: float | None = 30.0,
) -> tuple[helion.Config, list[dict]]:
    """Compile, check and time each candidate; return ``(best_config, results)``.

    The reference output comes from ``reference`` (default: the bound kernel's default config) and
    every candidate's output must match it within ``atol + rtol*|ref|``. With ``finalize``, the
    compared values are ``finalize(raw_outputs, args)`` (config-independent results) for the
    reference and every candidate; ``prepare(args)`` runs before each checked run. ``results`` has one dict per
    candidate tried: config, status ("ok", "compile_error", "run_error", "mismatch", "skipped_budget"),
    time_ms, max_abs_err, error. The budget is checked before each candidate; the reference is always
    run. A candidate whose compile + check + timing exceeds ``candidate_timeout_s`` (or the budget left
    plus 10 s) is dropped with status "timeout" (some configs make Triton compile for minutes).
    A CUDA error that leaves the context unusable ends the search with the best so far.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("tuning.search needs a CUDA GPU (timings are measured on the device)")
    log = log or (lambda s: None)
    t0 = time.monotonic()
    args = tuple(args)
    ref_cfg = _as_config(reference) if reference is not None else kernel.bind(args).config_spec.default_config()
    ref_out = checked_outputs(compiled(kernel, args, ref_cfg), args, finalize, prepare)
    torch.cuda.synchronize()
    ref_out = [t.clone() for t in _flatten_outputs(ref_out)]
    results: list[dict] = []
    best: tuple[float, helion.Config] | None = None
    cands = [ref_cfg] + [c for c in map(_as_config, candidates) if c.to_json() != ref_cfg.to_json()]
    for i, cfg in enumerate(cands):
        r: dict[str, Any] = {"config": config_to_dict(cfg), "status": None, "time_ms": None, "max_abs_err": None}
        if i > 0 and time.monotonic() - t0 > budget_s:
            r["status"] = "skipped_budget"
            results.append(r)
            continue
        limit = None
        if i > 0 and candidate_timeout_s:
            limit = max(1.0, min(candidate_timeout_s, budget_s - (time.monotonic() - t0) + 10.0))
        try:
            with _time_limit(limit):
                r["status"] = "compile_error"
                fn = compiled(kernel, args, cfg)
                r["status"] = None
                out = checked_outputs(fn, args, finalize, prepare)
                torch.cuda.synchronize()
                ok, err = outputs_close(out, ref_out, atol, rtol)
                ms = time_fn(lambda: fn(*args), rep) if ok else None
        except CandidateTimeout as e:
            r.update(status="timeout", error=str(e))
            results.append(r)
            log(f"  [{i}] timeout ({e})")
            if not _cuda_alive():
                break
            continue
        except Exception as e:  # noqa: BLE001
            if r["status"] == "compile_error":
                r.update(error=f"{type(e).__name__}: {str(e)[:300]}")
                results.append(r)
                log(f"  [{i}] compile_error {r['error'][:120]}")
                continue
            r.update(status="run_error", error=f"{type(e).__name__}: {str(e)[:300]}")
            results.append(r)
            log(f"  [{i}] run_error {r['error'][:120]}")
            if not _cuda_alive():
                r["error"] += " (CUDA context lost: search stopped)"
                break
            continue
        r["max_abs_err"] = err
        if not ok:
            r["status"] = "mismatch"
            results.append(r)
            log(f"  [{i}] mismatch max_abs_err={err:.3g}")
            continue
        r.update(status="ok", time_ms=ms)
        results.append(r)
        log(f"  [{i}] ok {ms * 1000:.1f} us")
        if best is None or ms < best[0]:
            best = (ms, cfg)
    if best is None:
        raise RuntimeError(
            "tuning.search: no candidate ran correctly (not even the reference config); "
            f"first errors: {[r.get('error') for r in results[:3]]}"
        )
    return best[1], results


def discover_tunable_kernels() -> dict[str, tuple[str, Callable]]:
    """``{kernel_name: (module_name, case_builder)}`` from every ``kernels.*`` module's TUNABLE_KERNELS."""
    import kernels as _pkg

    found: dict[str, tuple[str, Callable]] = {}
    for mod in pkgutil.iter_modules(_pkg.__path__):
        if mod.name in ("tuning", "registry") or mod.name.startswith("_"):
            continue
        m = importlib.import_module(f"kernels.{mod.name}")
        for name, builder in getattr(m, "TUNABLE_KERNELS", {}).items():
            if name in found:
                raise ValueError(f"tunable kernel {name!r} defined in both {found[name][0]} and kernels.{mod.name}")
            found[name] = (f"kernels.{mod.name}", builder)
    return found


def format_exc() -> str:
    return traceback.format_exc()
