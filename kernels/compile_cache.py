"""The compile cache: a kernel call's chosen config and Helion's generated code, kept across processes.

A Helion kernel's first call with an argument signature binds the kernel (Helion traces it at those arguments),
chooses its config (``kernels.first_use.select_config``, which fits every candidate to the binding) and generates its
Triton module (``BoundKernel.compile_config``). Triton keeps its own compiles on disk (``TRITON_CACHE_DIR``); the
binding, the choice and Helion's code generation are redone by every process, per kernel and argument signature.
With ``kernels.helion.compile_cache`` (the default) ``kernels.first_use.tuned_call`` keeps their outcome in the
per-user cache, ``<kernels.helion.cache_dir>/compiled/<arch>/<kernel>/<key>.json``:
the config, the generated module's source with its sha256, and the notices the choice gave. A later process whose
call has the same key loads the module from that source (Helion's own loader, ``PyCodeCache.load``, as
``compile_config`` does) and says the same notices, without binding the kernel.

The key (``entry_key``) is a sha256 over everything the outcome depends on:

* the kernel: its registry name, function (module and name) and Helion settings (index dtype, static shapes, dot
  precision...; the autotuner's settings left out), and the source of every module of the ``kernels`` package;
* the call: each argument's dtype, shape, strides, storage offset and device type, each scalar's type and value,
  the kernel dims and its generic default config;
* the choice's inputs: the arch, the GPU's name, capability and SM count, the bytes of the kernel's committed and user-cache
  config files (and whether the arch has committed configs), ``kernels.helion.autotune``;
* the versions of Helion, Triton and torch, and every ``HELION_*`` environment variable.

What is stored: choices from the files alone, with ``autotune`` off; with it on, only exact committed or user-cache
entries (a shape the search should tune is chosen again, so that the search runs). A call whose chosen config failed
at its first launch and ran another candidate is not stored. ``NANO_HELION_DUMP_DIR`` (``kernels.debug``) bypasses
the cache, so every compilation is dumped.

An entry that cannot be read, or whose source does not match its sha256, is not loaded: one warning names the file,
and the call binds, chooses and generates as without the cache, then writes a good entry in its place. Entries are
written to a temporary file and renamed (a reader never sees half an entry); ranks writing the same key write the
same content. A cache that cannot be written (read-only, full) is one warning per cache folder, and the run goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import triton

import helion
from helion.autotuner.local_cache import helion_triton_cache_dir
from torch._inductor.codecache import PyCodeCache

from kernels import tuning

FORMAT = 1
STORED_HOWS = ("exact", "cache", "nearest", "default", "spec-default")  # with autotune on: "exact", "cache" only
_PACKAGE_DIR = Path(__file__).resolve().parent


@functools.cache
def versions() -> tuple[str, str, str]:
    """The installed Helion, Triton and torch."""
    return importlib.metadata.version("helion"), triton.__version__, torch.__version__


@functools.cache
def package_digest() -> str:
    """sha256 over the sources of the ``kernels`` package (the kernels, their wrappers and helpers)."""
    h = hashlib.sha256()
    for path in sorted(_PACKAGE_DIR.rglob("*.py")):
        h.update(str(path.relative_to(_PACKAGE_DIR)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _kernel_settings(kernel) -> dict[str, str]:
    """The Helion settings of ``kernel`` that its code generation reads: all but the autotuner's, and none whose value
    is an object without a stable text (a function, a class)."""
    settings = getattr(kernel, "settings", None)
    items = settings.to_dict() if hasattr(settings, "to_dict") else {}
    out = {}
    for k, v in sorted(items.items()):
        text = repr(v)
        if k.startswith("autotune") or " at 0x" in text or text.startswith("<class") or k == "ignore_warnings":
            continue
        out[k] = text
    return out


def _arg_key(args: Sequence[object]) -> list:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(["T", str(a.dtype), list(a.shape), list(a.stride()), a.storage_offset(), a.device.type])
        elif a is None or isinstance(a, (bool, int, float, str)):
            out.append([type(a).__name__, repr(a)])
        elif isinstance(a, (tuple, list)):
            out.append(["L", _arg_key(a)])
        else:
            out.append(["O", type(a).__name__, repr(a)])
    return out


def _file_digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return "absent"


def _device() -> list:
    """The current GPU's name, capability and SM count (Helion's config spec bounds some keys by the SM count)."""
    if not torch.cuda.is_available():
        return ["cpu"]
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return [props.name, [props.major, props.minor], props.multi_processor_count]


def entry_key(kernel_name: str, kernel, args: Sequence[object], dims: Mapping[str, Any],
              default: helion.Config | Mapping[str, Any], rt: tuning.Runtime, arch: str) -> str:
    """The cache key of this call (see the module doc for what goes in)."""
    fn = getattr(kernel, "fn", None)
    parts = {
        "format": FORMAT,
        "kernel": [kernel_name, getattr(fn, "__module__", ""), getattr(fn, "__qualname__", repr(fn)),
                   _kernel_settings(kernel)],
        "package": package_digest(),
        "args": _arg_key(args),
        "dims": {k: repr(v) for k, v in sorted(dims.items())},
        "default": tuning.as_config(default).to_json(),
        "arch": arch,
        "device": _device(),
        "committed": _file_digest(tuning.config_path(kernel_name, arch)),
        "arch_has_configs": tuning.arch_has_configs(arch),
        "user_cache": _file_digest(tuning.config_path(kernel_name, arch, rt.cache_root)),
        "autotune": rt.settings.autotune,
        "versions": list(versions()),
        "env": sorted((k, v) for k, v in os.environ.items() if k.startswith("HELION_")),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def entry_path(rt: tuning.Runtime, arch: str, kernel_name: str, key: str) -> Path:
    return rt.cache_root / "compiled" / arch / kernel_name / f"{key}.json"


def storable(how: str, rt: tuning.Runtime) -> bool:
    """Whether a choice made ``how`` is stored (see the module doc)."""
    return how in (("exact", "cache") if rt.settings.autotune else STORED_HOWS)


@dataclasses.dataclass(frozen=True)
class Entry:
    path: Path
    fn_name: str
    source: str
    config: dict
    how: str
    notices: tuple[tuple[str, str, str], ...]  # (kernel name, what, message) as tuning.warn_once takes them


def load(path: Path) -> Entry | None:
    """The entry at ``path``; None when there is none, or (with one warning) when it cannot be used."""
    try:
        raw = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError) as e:
        return _unusable(path, f"unreadable ({type(e).__name__}: {e})")
    try:
        d = json.loads(raw)
        entry = Entry(path, d["fn_name"], d["source"], d["config"], d["how"],
                      tuple(tuple(n) for n in d["notices"]))
        good = (d.get("format") == FORMAT and isinstance(entry.source, str) and isinstance(entry.fn_name, str)
                and entry.fn_name.isidentifier() and isinstance(entry.config, dict)
                and all(len(n) == 3 and all(isinstance(s, str) for s in n) for n in entry.notices))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        return _unusable(path, f"not an entry ({type(e).__name__}: {e})")
    if not good:
        return _unusable(path, "not an entry of this format")
    if hashlib.sha256(entry.source.encode()).hexdigest() != d.get("source_sha256"):
        return _unusable(path, "its source does not match its sha256")
    return entry


def _unusable(path: Path, what: str) -> None:
    tuning.warn_once("*", f"compile-cache:{path}",
                     f"nano_hybrid kernels: compile cache entry {path} is {what}; not loaded (the kernel is compiled "
                     "again and the entry rewritten)")
    return None


def store(path: Path, fn: Callable, config: helion.Config, how: str,
          notices: Sequence[tuple[str, str, str]]) -> bool:
    """Write the entry of the compiled callable ``fn`` (what ``tuning.compiled`` returned) at ``path``. Only a
    module-level function of a generated Triton module (Helion's output: ``@triton.jit`` kernels beside it) is stored;
    False for any other callable."""
    fn = fn.func if isinstance(fn, functools.partial) else fn
    file = getattr(fn, "__globals__", {}).get("__file__")
    if file is None or getattr(fn, "__qualname__", None) != getattr(fn, "__name__", ""):
        return False
    try:
        source = Path(file).read_text()
    except OSError:
        return False
    if f"\ndef {fn.__name__}(" not in source or "@triton.jit" not in source:
        return False
    data = {"format": FORMAT, "fn_name": fn.__name__, "config": tuning.config_to_dict(config), "how": how,
            "notices": [list(n) for n in notices], "helion": versions()[0],
            "source_sha256": hashlib.sha256(source.encode()).hexdigest(), "source": source}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError as e:  # a read-only or full cache: the run goes on, compiling in every process
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        tuning.warn_once("*", f"compile-cache-write:{path.parent.parent.parent}",
                         f"nano_hybrid kernels: cannot write the compile cache entry {path} ({type(e).__name__}: "
                         f"{e}); kernels are bound and compiled again in every process (set kernels.helion.cache_dir "
                         "to a writable folder, or kernels.helion.compile_cache=false)")
        return False
    return True


def compiled_from(entry: Entry, kernel, args: Sequence[object], rt: tuning.Runtime) -> Callable:
    """``tuning.compiled`` of ``kernel`` at these arguments and the entry's config, with the function of the entry's
    source (what ``BoundKernel.compile_config`` gives for it) and the runtime's launcher."""
    if "TRITON_CACHE_DIR" not in os.environ:  # compile_config's own setup of Triton's cache (TritonBackend)
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        os.environ["TRITON_CACHE_DIR"] = helion_triton_cache_dir(device.index if device is not None and
                                                                 device.index is not None else 0)
    module = PyCodeCache.load(entry.source)
    return tuning.compiled(kernel, args, entry.config, rt=rt, generated=getattr(module, entry.fn_name))


def replay(entry: Entry) -> None:
    """Say the entry's notices as the choice said them (once per process each, ``tuning.warn_once``)."""
    for kernel_name, what, msg in entry.notices:
        tuning.warn_once(kernel_name, what, msg)
