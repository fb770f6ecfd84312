"""The compile cache: a kernel call's chosen config and Helion's generated code, kept across processes.

A Helion kernel's first call with an argument signature binds the kernel (Helion traces it at those arguments),
chooses its config (``kernels.first_use.select_config``, which fits every candidate to the binding) and generates its
Triton module (``BoundKernel.compile_config``). Triton keeps its own compiles on disk (``TRITON_CACHE_DIR``); the
binding, the choice and Helion's code generation are redone by every process, per kernel and argument signature.
With ``kernels.helion.compile_cache`` (the default) ``kernels.first_use.tuned_call`` keeps their outcome in the
per-user cache, ``<kernels.helion.cache_dir>/compiled/<sources>/<arch>/<kernel>/<key>.json`` (``<sources>``: the
first 16 hex digits of ``package_digest``, so the entries of kernel sources no longer in use are one folder to
delete): the config, the generated module's source, the notices the choice gave, and a sha256 over all of them. A
later process whose call has the same key loads the module from that source (Helion's own loader,
``PyCodeCache.load``, as ``compile_config`` does) and says the same notices, without binding the kernel.

The key (``entry_key``) is a sha256 over everything the outcome depends on:

* the kernel: its registry name, function (module and name) and Helion settings (index dtype, static shapes, dot
  precision...; the autotuner's settings left out), and the source of every module of the ``kernels`` package as
  it was imported;
* the call: each argument's dtype, shape, strides, storage offset and device type, each scalar's type and value,
  the kernel dims and its generic default config;
* the choice's inputs: the arch, the GPU's name, capability and SM count, the kernel's committed and user-cache
  config files as this process reads them (``tuning``'s loaded copies) and where the committed ones are, whether the
  arch has committed configs, ``kernels.helion.autotune``;
* the installed Helion (its version and the hash of its file list, ``RECORD``), Triton and torch, and every
  ``HELION_*`` environment variable.

What is stored: choices from the files alone, with ``autotune`` off; with it on, only exact committed or user-cache
entries (a shape the search should tune is chosen again, so that the search runs). The key an entry is stored under
is computed after the choice, from the files as the choice read them. A call whose chosen config failed at its first
launch and ran another candidate is not stored; an entry whose config fails at its first launch is deleted, and the
call chooses again. Kernel sources edited after this process imported them are not stored. The cache is bypassed
for what has to see each compilation: ``NANO_HELION_DUMP_DIR`` (``kernels.debug``) and Helion's
``print_output_code``; and for backends other than Helion's Triton one.

An entry that cannot be read or loaded, or whose content does not match its sha256, is not used: one warning names
the file, and the call binds, chooses and generates as without the cache, then writes a good entry in its place.
Entries are written to a temporary file and renamed (``tuning.atomic_write_text``: a reader never sees half an
entry); the processes of a run that reach a call together each store the same entry. A cache that cannot be written
(read-only, full) is one warning per cache folder, and the run goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import triton

import helion
from helion.autotuner.local_cache import helion_triton_cache_dir
from torch._inductor.codecache import PyCodeCache

from kernels import tuning

FORMAT = 2
STORED_HOWS = ("exact", "cache", "nearest", "default", "spec-default")  # with autotune on: "exact", "cache" only
_PACKAGE_DIR = Path(__file__).resolve().parent


def _sources_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(_PACKAGE_DIR.rglob("*.py")):
        h.update(str(path.relative_to(_PACKAGE_DIR)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


_IMPORTED_DIGEST = _sources_digest()  # the kernels package is imported together with this module (first_use)


def package_digest() -> str:
    """sha256 over the sources of the ``kernels`` package (the kernels, their wrappers and helpers) as this process
    imported them."""
    return _IMPORTED_DIGEST


@functools.cache
def versions() -> tuple[str, str, str, str]:
    """The installed Helion (version, sha256 of its ``RECORD`` file list: another build of one version differs),
    Triton and torch."""
    dist = importlib.metadata.distribution("helion")
    record = dist.read_text("RECORD") or ""
    return dist.version, hashlib.sha256(record.encode()).hexdigest(), triton.__version__, torch.__version__


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
    """``tuning._arg_signature``'s content as JSON (the device as its type: ranks on other GPUs share entries)."""
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


def _loaded_digest(path: Path) -> str:
    """sha256 of a config file as ``tuning`` has loaded it in this process (what the choice reads; a file changed on
    disk since is not what this process chooses from). Raises ``tuning.ConfigFileError`` for a file that cannot be
    used, as the choice would."""
    return hashlib.sha256(json.dumps(tuning._load_file(path), sort_keys=True).encode()).hexdigest()


def _device() -> list:
    """The current GPU's name, capability and SM count (Helion's config spec bounds some keys by the SM count)."""
    if not torch.cuda.is_available():
        return ["cpu"]
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return [props.name, [props.major, props.minor], props.multi_processor_count]


def applies(kernel) -> bool:
    """Whether calls of ``kernel`` use the cache: Helion's Triton backend, and no ``print_output_code`` (which prints
    each compilation)."""
    settings = getattr(kernel, "settings", None)
    return getattr(settings, "backend", "triton") == "triton" and not getattr(settings, "print_output_code", False)


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
        "committed": [str(tuning.CONFIG_ROOT), _loaded_digest(tuning.config_path(kernel_name, arch))],
        "arch_has_configs": tuning.arch_has_configs(arch),
        "user_cache": _loaded_digest(tuning.config_path(kernel_name, arch, rt.cache_root)),
        "autotune": rt.settings.autotune,
        "versions": list(versions()),
        "env": sorted((k, v) for k, v in os.environ.items() if k.startswith("HELION_")),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def entry_path(rt: tuning.Runtime, arch: str, kernel_name: str, key: str) -> Path:
    return rt.cache_root / "compiled" / package_digest()[:16] / arch / kernel_name / f"{key}.json"


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


def _payload_digest(data: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps({k: v for k, v in data.items() if k != "sha256"},
                                     sort_keys=True).encode()).hexdigest()


def load(path: Path) -> Entry | None:
    """The entry at ``path``; None when there is none, or (with one warning) when it cannot be used."""
    try:
        raw = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError) as e:
        return unusable(path, f"unreadable ({type(e).__name__}: {e})")
    try:
        d = json.loads(raw)
        entry = Entry(path, d["fn_name"], d["source"], d["config"], d["how"],
                      tuple(tuple(n) for n in d["notices"]))
        good = (d.get("format") == FORMAT and isinstance(entry.source, str) and isinstance(entry.fn_name, str)
                and entry.fn_name.isidentifier() and isinstance(entry.config, dict)
                and all(len(n) == 3 and all(isinstance(s, str) for s in n) for n in entry.notices))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        return unusable(path, f"not an entry ({type(e).__name__}: {e})")
    if not good:
        return unusable(path, "not an entry of this format")
    if _payload_digest(d) != d.get("sha256"):
        return unusable(path, "its content does not match its sha256")
    return entry


def unusable(path: Path, what: str) -> None:
    """Say once that the entry at ``path`` is not used, and why."""
    tuning.warn_once("*", f"compile-cache:{path}",
                     f"nano_hybrid kernels: compile cache entry {path} is {what}; not used (the kernel is compiled "
                     "again and the entry rewritten)")
    return None


def forget(entry: Entry, why: str) -> None:
    """Delete an entry whose config failed at its first launch on this GPU (said once)."""
    tuning.warn_once("*", f"compile-cache-forget:{entry.path}",
                     f"nano_hybrid kernels: the {entry.how} config of compile cache entry {entry.path} does not run on "
                     f"this GPU ({why}); entry deleted, the config is chosen again")
    try:
        entry.path.unlink(missing_ok=True)
    except OSError:
        pass


def store(path: Path, fn: Callable, config: helion.Config, how: str,
          notices: Sequence[tuple[str, str, str]]) -> bool:
    """Write the entry of the compiled callable ``fn`` (what ``tuning.compiled`` returned) at ``path``. Only a
    module-level function of a generated Triton module (Helion's output: ``@triton.jit`` kernels beside it) is stored,
    and only while the kernel sources are those this process imported; False otherwise."""
    fn = fn.func if isinstance(fn, functools.partial) else fn
    file = getattr(fn, "__globals__", {}).get("__file__")
    source = None
    if file is not None and getattr(fn, "__qualname__", None) == getattr(fn, "__name__", ""):
        with contextlib.suppress(OSError):
            source = Path(file).read_text()
    if source is None or f"\ndef {fn.__name__}(" not in source or "@triton.jit" not in source:
        tuning.warn_once("*", f"compile-cache-not-generated:{getattr(fn, '__qualname__', fn)}",
                         f"nano_hybrid kernels: {getattr(fn, '__qualname__', fn)!s} is not a function of a generated "
                         "Triton module that can be read back; the compile cache does not store it")
        return False
    if _sources_digest() != package_digest():
        tuning.warn_once("*", "compile-cache-sources",
                         "nano_hybrid kernels: the kernels package's sources changed after this process imported "
                         "them; its compilations are not stored in the compile cache")
        return False
    data = {"format": FORMAT, "fn_name": fn.__name__, "config": tuning.config_to_dict(config), "how": how,
            "notices": [list(n) for n in notices], "helion": versions()[0], "source": source}
    data["sha256"] = _payload_digest(data)
    try:
        tuning.atomic_write_text(path, json.dumps(data))
    except OSError as e:  # a read-only or full cache: the run goes on, compiling in every process
        tuning.warn_once("*", f"compile-cache-write:{path.parents[3]}",
                         f"nano_hybrid kernels: cannot write the compile cache entry {path} ({type(e).__name__}: "
                         f"{e}); kernels are bound and compiled again in every process (set kernels.helion.cache_dir "
                         "to a writable folder, or kernels.helion.compile_cache=false)")
        return False
    return True


def compiled_from(entry: Entry, kernel, args: Sequence[object], rt: tuning.Runtime) -> Callable | None:
    """``tuning.compiled`` of ``kernel`` at these arguments and the entry's config, with the function of the entry's
    source (what ``BoundKernel.compile_config`` gives for it) and the runtime's launcher; None (said once) when the
    source does not load."""
    if "TRITON_CACHE_DIR" not in os.environ:  # compile_config's own setup of Triton's cache (TritonBackend)
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        os.environ["TRITON_CACHE_DIR"] = helion_triton_cache_dir(device.index if device is not None and
                                                                 device.index is not None else 0)
    try:
        generated = getattr(PyCodeCache.load(entry.source), entry.fn_name)
    except (SyntaxError, ImportError, AttributeError, OSError) as e:
        return unusable(entry.path, f"a source that does not load ({type(e).__name__}: {e})")
    return tuning.compiled(kernel, args, entry.config, rt=rt, generated=generated)


def replay(entry: Entry) -> None:
    """Say the entry's notices as the choice said them (once per process each, ``tuning.warn_once``)."""
    for kernel_name, what, msg in entry.notices:
        tuning.warn_once(kernel_name, what, msg)
