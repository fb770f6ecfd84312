"""A kernel call's config, searched at its first call when nothing stored fits: ``tuned_call`` and ``select_config``.

Layering: ``kernels.tuning`` (config store, stored-config chain, compile and launch caches) is below
``kernels.tuner`` (the search), and this module, which needs both, is above them; kernel wrappers call
``tuned_call`` here. Neither lower module imports this one.

``select_config`` runs the chain of ``kernels.tuning``'s module doc: the exact committed or user-cache entry
(``tuning.Choice.exact``), then with ``kernels.helion.autotune`` a search at this call (``tune_first_use``), then the
nearest tuned shape or a default (``tuning.Choice.fallback``).

First-use search (``tune_first_use``)
-------------------------------------
Under a file lock per (kernel, shape key) beside the user-cache file, so that one process of a run searches and the
others, waiting on the lock, read its entry afterwards:

* an entry written meanwhile by another process is used as it is;
* on a CUDA device the search runs in a child process (``python -c ...child_main``, a fresh interpreter: no fork of
  a process that holds a CUDA context). The child gets the kernel's registry name (``tuner.registry_kernel``
  rebuilds the kernel; its function's module and name are checked against the caller's), the call's arguments,
  start configs, seeds, tolerances, ``finalize`` / ``prepare`` (module-level functions, pickled by reference) and
  the backend's settings, in one ``torch.save`` file under ``<cache_dir>/<arch>/first_use/``. It runs
  ``tuner.tune_call`` and ``tuning.record``s the winner in the user-cache file (``record``'s own file lock; the
  parent holds the per-shape lock meanwhile). The parent waits at most ``autotune_budget_s + SEARCH_MARGIN_S``,
  then kills the child's process group (SIGKILL: a compile stuck in Triton's C++ passes ignores Python's
  time limits), and reads the entry from the cache file;
* without a CUDA device (CPU tensors: the tests, which bind compiled-mode kernels on CPU with a forced arch) the
  search runs in this process, as ``tuner.tune_call`` directly.

When the child fails, overruns or records nothing, one warning says which kernel and shape, what happened (with
the child's log file), the config used instead (``Choice.fallback``: the nearest tuned shape that fits, else a
default) and the offline command; the run goes on with that config. The failure is written to
``<cache_dir>/<arch>/<kernel>.failed.json`` with the run it happened in (``run_id``). Another process of the same
run (a rank that waited on the lock, a rank started later) reads it under the lock and uses the fallback with the
same warning, without searching again. A later run searches again: a failure can be transient (the child shares
the GPU, and its memory, with the training process that started it; another job on the host), and a retry costs
one budget plus margin per (kernel, shape) at the start of a run, while a failure kept for good would leave a run
without its tuned config after the cause is gone; a deterministic failure says so, with the offline command, in
every run. A later success clears the record.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

import helion

from kernels import compile_cache, debug, tuner, tuning

# seconds the parent waits beyond ``autotune_budget_s`` before it kills the child: the child's start (interpreter,
# torch, helion, the kernel modules, CUDA context), loading the arguments, the reference config's compile, and the
# last candidate's time limit past the budget (``tuner.search``: the budget left plus 10 s); the offline tool's
# isolated searches use the same margin
SEARCH_MARGIN_S = 75.0

TUNE_MISSING_COMMAND = "python scripts/tune_kernels.py <the run's overrides> --missing"


def select_config(
    kernel_name: str,
    kernel,
    args: Sequence[object],
    dims: Mapping[str, Any],
    default: helion.Config | Mapping[str, Any],
    *,
    arch: str | None = None,
    root: Path | None = None,
    rt: tuning.Runtime | None = None,
    adjust: Callable[[dict], dict] | None = None,
    seeds: Sequence[helion.Config | Mapping[str, Any]] = (),
    atol: float = 1e-2,
    rtol: float = 1e-2,
    finalize: Callable[[Any, tuple], Any] | None = None,
    prepare: Callable[[tuple], None] | None = None,
    bound=None,
) -> tuple[helion.Config, str]:
    """The config ``kernel`` runs with at this call, and where it came from ("exact", "cache", "tuned", "nearest",
    "default", "spec-default"; see ``kernels.tuning``'s module doc for the chain). ``bound``: the kernel bound at
    ``args`` if the caller has it; ``seeds`` / ``atol`` / ``rtol`` / ``finalize`` / ``prepare``: the first-use
    search's (``tuner.tune_call``)."""
    c = tuning.choice_for(kernel_name, kernel, args, dims, default, arch=arch, root=root, rt=rt, adjust=adjust,
                          bound=bound)
    if c is None:
        return tuning.as_config(default), "default"
    got = c.exact()
    if got is not None:
        return got
    if c.rt.settings.autotune:
        got = tune_first_use(c, kernel, args, seeds=seeds, atol=atol, rtol=rtol, finalize=finalize, prepare=prepare)
        if got is not None:
            return got
    return c.fallback()[:2]


def tuned_call(
    kernel_name: str,
    kernel,
    args: Sequence[object],
    dims: Mapping[str, Any],
    default: helion.Config | Mapping[str, Any],
    *,
    seeds: Sequence[helion.Config | Mapping[str, Any]] = (),
    atol: float = 1e-2,
    rtol: float = 1e-2,
    finalize: Callable[[Any, tuple], Any] | None = None,
    prepare: Callable[[tuple], None] | None = None,
    adjust: Callable[[dict], dict] | None = None,
):
    """What kernel wrappers call: the config ``select_config`` chooses, compiled once per argument signature.
    ``seeds`` / ``finalize`` / ``prepare``: for first-use tuning (see ``kernels.tuner.search``); ``adjust``: the
    wrapper's own clamps, applied before the fit check.

    After the first call with a given argument signature (dtypes, shapes, strides, devices, scalar
    values) the compiled kernel is looked up by that signature alone: the host cost per call is one
    signature tuple and one dict lookup on top of the launcher. The first call itself loads the config and the
    generated module from the compile cache (``kernels.compile_cache``; ``kernels.helion.compile_cache``) when an
    earlier process stored them, and stores them otherwise."""
    rt = tuning.runtime()
    fkey = (kernel_name, id(kernel), tuning._arg_signature(args))
    fn = rt.fast.get(fkey)
    if fn is not None:
        return fn(*args)
    if tuning.kernel_in_ref_mode(kernel):
        cfg = tuning.as_config(default if adjust is None else adjust(dict(tuning.as_config(default).config)))
        return tuning.run_interpret(kernel, args, cfg)
    kernel = tuning.with_index_dtype_for(kernel, args)  # 64-bit indices where an argument reaches past int32 offsets
    search = dict(seeds=seeds, atol=atol, rtol=rtol, finalize=finalize, prepare=prepare)
    p = prepare_call(kernel_name, kernel, args, dims, default, rt=rt, adjust=adjust, **search)
    if p.entry is not None:
        try:
            out = p.fn(*args)
        except Exception as e:  # noqa: BLE001 - a config this GPU refuses now is chosen again below
            why = tuning.launch_misfit(e)
            if why is None:
                raise
            compile_cache.forget(p.entry, why)
            p = prepare_call(kernel_name, kernel, args, dims, default, rt=rt, adjust=adjust, use_cache=False,
                             **search)
        else:
            p.done()
            rt.first_calls["loaded"] += 1
            rt.fast[fkey] = p.fn
            return out
    try:
        fn = p.compile(kernel, args)
        out = fn(*args)
    except Exception as e:  # noqa: BLE001 - launch_misfit decides; anything else propagates
        why = tuning.launch_misfit(e)
        if why is None:
            raise
        fn, out = _launch_next_candidate(kernel_name, kernel, args, dims, default, rt, adjust, p.bound, p.config,
                                         p.how, why)
    else:
        p.done()
    rt.first_calls["bound"] += 1
    rt.fast[fkey] = fn
    return out


@dataclasses.dataclass
class Prepared:
    """A kernel call made ready to launch (``prepare_call``): its config and where it came from, and its compiled
    callable; from the compile cache (``entry``, compiled, no ``bound``) or chosen now (``bound``, the notices the
    choice gave, and the compile-cache file to store it in, if any; compiled by ``compile``)."""

    fn: Callable | None
    config: helion.Config
    how: str
    bound: Any = None
    entry: compile_cache.Entry | None = None
    entry_path: Path | None = None
    notices: Sequence[tuple[str, str, str]] = ()
    rt: tuning.Runtime | None = None

    def compile(self, kernel, args: Sequence[object]) -> Callable:
        """The compiled callable (``tuning.compiled`` for a choice made now; a compile failure raises here)."""
        if self.fn is None:
            self.fn = tuning.compiled(kernel, args, self.config, rt=self.rt, bound=self.bound)
        return self.fn

    def done(self) -> None:
        """After the call's first launch ran: say a cached choice's notices again, or store a choice made now in the
        compile cache (where ``compile_cache.storable``)."""
        if self.entry is not None:
            compile_cache.replay(self.entry)
        elif self.entry_path is not None and compile_cache.storable(self.how, self.rt):
            compile_cache.store(self.entry_path, self.fn, self.config, self.how, self.notices)


def prepare_call(kernel_name: str, kernel, args: Sequence[object], dims: Mapping[str, Any], default, *,
                 rt: tuning.Runtime, adjust: Callable[[dict], dict] | None = None, use_cache: bool = True,
                 arch: str | None = None, **search: Any) -> Prepared:
    """What the first call of ``kernel`` with these arguments does before it launches: load the compile cache's entry
    (``use_cache`` and ``kernels.helion.compile_cache``), else bind the kernel and choose its config
    (``select_config`` with ``search``'s first-use search keywords; ``Prepared.compile`` compiles it). ``arch``: whose
    stored configs are chosen from (default: this GPU's)."""
    arch = arch or tuning.current_arch()
    entry_path = _compile_cache_path(kernel_name, kernel, args, dims, default, rt, arch) if use_cache else None
    if entry_path is not None and (entry := compile_cache.load(entry_path)) is not None:
        fn = compile_cache.compiled_from(entry, kernel, args, rt)
        if fn is not None:
            return Prepared(fn, tuning.as_config(entry.config), entry.how, entry=entry, rt=rt)
    bound = kernel.bind(tuple(args))
    with tuning.recording_notices() as notices:
        cfg, how = select_config(kernel_name, kernel, args, dims, default, arch=arch, rt=rt, adjust=adjust, bound=bound,
                                 **search)
    # stored under the key of the files as the choice read them (a first-use search may have read them again)
    return Prepared(None, cfg, how, bound=bound, notices=notices, rt=rt,
                    entry_path=_compile_cache_path(kernel_name, kernel, args, dims, default, rt, arch))


def _compile_cache_path(kernel_name: str, kernel, args: Sequence[object], dims: Mapping[str, Any], default,
                        rt: tuning.Runtime, arch: str) -> Path | None:
    """Where this call's compile-cache entry is (``kernels.compile_cache``); None with ``compile_cache`` off, under
    ``NANO_HELION_DUMP_DIR`` (every compilation is dumped), on arch ``cpu`` (no stored configs apply) and where the
    cache does not apply to the kernel (``compile_cache.applies``)."""
    if (not rt.settings.compile_cache or debug.dump_dir() is not None or arch == "cpu"
            or not compile_cache.applies(kernel)):
        return None
    key = compile_cache.entry_key(kernel_name, kernel, args, dims, default, rt, arch)
    return compile_cache.entry_path(rt, arch, kernel_name, key)


_HOW_WORDS = {"exact": "committed", "cache": "user-cache", "tuned": "first-use tuned", "nearest": "nearest-shape",
              "default": "generic default", "spec-default": "Helion spec default"}


def _launch_next_candidate(kernel_name: str, kernel, args: Sequence[object], dims: Mapping[str, Any], default,
                           rt: tuning.Runtime, adjust, bound, failed: helion.Config, how: str, why: str):
    """After the chosen config's first launch failed with a config misfit on this GPU (``tuning.launch_misfit``):
    launch the chain's next candidates (``tuning.Choice.fallbacks``) until one runs, and say once per kernel and
    shape which config failed, why, and which one runs. ``(compiled callable, outputs)``; ``UnsupportedShapeError``
    when no candidate runs. A failed launch has run nothing (Triton refuses the binary or the launch before the
    kernel starts), so the outputs are those of the candidate that runs."""
    from kernels.shapes import UnsupportedShapeError

    c = tuning.choice_for(kernel_name, kernel, args, dims, default, rt=rt, adjust=adjust, bound=bound)
    key = c.key if c is not None else tuning.shape_key(**dims)
    tried = {failed.to_json()}
    failures = [f"the {_HOW_WORDS.get(how, how)} config {tuning.config_to_dict(failed)} ({why})"]
    for cfg, _, what in (c.fallbacks() if c is not None else ()):
        if cfg.to_json() in tried:
            continue
        tried.add(cfg.to_json())
        try:
            fn = tuning.compiled(kernel, args, cfg, rt=rt, bound=bound)
            out = fn(*args)
        except Exception as e:  # noqa: BLE001
            nwhy = tuning.launch_misfit(e)
            if nwhy is None:
                raise
            failures.append(f"{what} ({nwhy})")
            continue
        tuning.warn_once(kernel_name, f"launch-misfit:{key}",
                         f"nano_hybrid kernels: {kernel_name} at {key}: {'; '.join(failures)} does not run on this "
                         f"GPU; using {what} (said once per kernel and shape)")
        return fn, out
    raise UnsupportedShapeError(
        f"helion backend: {kernel_name} at shape {key} does not run on this GPU with any config: "
        f"{'; '.join(failures)} (supported shapes: kernels/shapes.py)")


# ----------------------------------------------------------------------------------------------
# the first-use search


def isolates(args: Sequence[object]) -> bool:
    """Whether the first-use search of a call with these arguments runs in a child process: when they are on a CUDA
    device."""
    return tuning.launches_on_cuda(args)


def tune_first_use(c: tuning.Choice, kernel, args: Sequence[object], *,
                   seeds: Sequence[helion.Config | Mapping[str, Any]] = (), atol: float = 1e-2, rtol: float = 1e-2,
                   finalize: Callable[[Any, tuple], Any] | None = None,
                   prepare: Callable[[tuple], None] | None = None) -> tuple[helion.Config, str] | None:
    """``kernels.helion.autotune`` at a call without an exact config (see the module doc): ``(config, "tuned")``,
    or after a failed search ``(config, how)`` of ``c.fallback`` with its one warning; None when the entry another
    process stored does not fit this call (the caller falls back with the usual notices)."""
    name, key = c.kernel_name, c.key
    with tuning.file_lock(c.cache_path.with_name(f"{c.cache_path.stem}.{key}")):
        entry = c.cache_entry(reread=True)
        if entry is not None:
            tuning.warn_once(name, f"cache-read:{key}",
                             f"nano_hybrid kernels: {name} at {key}: using the config tuned by another process "
                             f"({c.cache_path})")
            try:
                return c.fit(entry["config"]), "tuned"
            except tuning.ConfigMisfit:
                return None
        start = []
        for _, _, e in c.nearest()[:1]:
            try:
                start.append(c.fit(e["config"]))
            except tuning.ConfigMisfit:
                pass
        t0 = time.monotonic()
        if not isolates(args):
            cfg, ms, meta = tuner.tune_call(name, kernel, args, start=start, seeds=seeds,
                                            budget_s=c.rt.settings.autotune_budget_s, atol=atol, rtol=rtol,
                                            finalize=finalize, prepare=prepare)
            tuning.record(name, c.dims, cfg, ms, meta, arch=c.arch, root=c.rt.cache_root)
            _say_tuned(c, time.monotonic() - t0, ms)
            try:
                return c.fit(cfg), "tuned"
            except tuning.ConfigMisfit:
                return None
        earlier = read_failure(c)
        if earlier is not None and earlier.get("run") == run_id():
            return _fall_back(c, f"failed earlier in this run ({earlier['what']}; recorded in {failure_path(c)}); "
                                 f"not searched again in this run")
        what = search_in_child(c, kernel, args, start=start, seeds=seeds, atol=atol, rtol=rtol, finalize=finalize,
                               prepare=prepare)
        if what is None:
            entry = c.cache_entry(reread=True)
            if entry is None:
                what = f"the child process ended without an entry for {key} in {c.cache_path}"
            else:
                try:
                    cfg = c.fit(entry["config"])
                except tuning.ConfigMisfit as e:
                    what = f"the child's winner does not fit this call ({e})"
                else:
                    clear_failure(c)
                    _say_tuned(c, time.monotonic() - t0, entry["time_ms"])
                    return cfg, "tuned"
        record_failure(c, what)
        return _fall_back(c, f"failed: {what}")


def _say_tuned(c: tuning.Choice, seconds: float, ms: float) -> None:
    tuning.warn_once(c.kernel_name, f"tuned:{c.key}",
                     f"nano_hybrid kernels: tuned {c.kernel_name} at {c.key} in {seconds:.0f} s ({ms * 1000:.1f} us); "
                     f"stored in {c.cache_path}")


def _fall_back(c: tuning.Choice, what: str) -> tuple[helion.Config, str]:
    """``c.fallback`` (its own notice left out) with the one warning of a first-use search that gave no config."""
    cfg, how, used = c.fallback(notice=False)
    tuning.warn_once(c.kernel_name, f"first-use-failed:{c.key}",
                     f"nano_hybrid kernels: first-use tuning of {c.kernel_name} at {c.key} {what}; using {used}; "
                     f"tune it offline with `{TUNE_MISSING_COMMAND}`")
    return cfg, how


def _one_line(text: str, limit: int = 400) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _fn_ref(kernel) -> str:
    """``module.qualname`` of a helion kernel's Python function (how the child checks it rebuilt the same kernel)."""
    return f"{kernel.fn.__module__}.{kernel.fn.__qualname__}"


def child_command(payload: Path) -> list[str]:
    """The command of the child process that runs the first-use search described by ``payload``."""
    return [sys.executable, "-c", "import sys; from kernels.first_use import child_main; sys.exit(child_main(sys.argv[1]))",
            str(payload)]


def search_in_child(c: tuning.Choice, kernel, args: Sequence[object], *, start: Sequence[helion.Config],
                    seeds: Sequence[helion.Config | Mapping[str, Any]], atol: float, rtol: float,
                    finalize: Callable | None, prepare: Callable | None) -> str | None:
    """Run the first-use search of this call in a child process (module doc) and wait for it, at most
    ``autotune_budget_s + SEARCH_MARGIN_S``; None when it ended well (its winner is then in the user cache), else
    what happened, in one line naming the child's log file."""
    budget = c.rt.settings.autotune_budget_s
    limit = budget + SEARCH_MARGIN_S
    work = c.rt.cache_root / c.arch / "first_use"
    work.mkdir(parents=True, exist_ok=True)
    stem = f"{c.kernel_name}.{c.key}.{os.getpid()}"
    payload, log, result = work / f"{stem}.pt", work / f"{stem}.log", work / f"{stem}.result.json"
    result.unlink(missing_ok=True)
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    try:
        torch.save({
            "kernel_name": c.kernel_name, "kernel_fn": _fn_ref(kernel),
            "args": tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args),
            "dims": dict(c.dims), "arch": c.arch, "cache_root": str(c.rt.cache_root), "settings": c.rt.settings,
            "start": [tuning.config_to_dict(s) for s in start],
            "seeds": [tuning.config_to_dict(s) if isinstance(s, helion.Config) else dict(s) for s in seeds],
            "budget_s": budget, "atol": atol, "rtol": rtol, "finalize": finalize, "prepare": prepare,
            "device": str(device), "parent_pid": os.getpid(), "result": str(result),
        }, payload)
    except Exception as e:  # noqa: BLE001 - e.g. a finalize that is no module-level function does not pickle
        payload.unlink(missing_ok=True)
        return _one_line(f"the call could not be handed to a child process ({type(e).__name__}: {e})")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    t0 = time.monotonic()
    rc: int | None = None
    try:
        with open(log, "w") as logf:
            proc = subprocess.Popen(child_command(payload), stdin=subprocess.DEVNULL, stdout=logf,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                if proc.poll() is None:  # overran, or this process is interrupted while it waits
                    kill_process_group(proc)
    finally:
        payload.unlink(missing_ok=True)
    seconds = time.monotonic() - t0
    if rc == 0:
        result.unlink(missing_ok=True)
        log.unlink(missing_ok=True)
        return None
    if rc is None:
        what = (f"overran its budget ({budget:.0f} s + {SEARCH_MARGIN_S:.0f} s for start-up and compiles) and was "
                f"killed after {seconds:.0f} s")
    else:
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
        what = f"the child process failed ({how}) after {seconds:.0f} s: {_child_error(result, log)}"
    result.unlink(missing_ok=True)
    return _one_line(f"{what} (log: {log})", 700)


def kill_process_group(proc: subprocess.Popen) -> None:
    """SIGKILL the running child's process group (its own session, ``start_new_session``: the child and the
    compilers it started), then reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _child_error(result: Path, log: Path) -> str:
    """The child's error: what it wrote to its result file, else the last line of its log."""
    try:
        return _one_line(json.loads(result.read_text())["error"])
    except (OSError, ValueError, KeyError):
        pass
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    return _one_line(lines[-1]) if lines else "no output"


def child_main(payload_path: str) -> int:
    """The child process of ``search_in_child``: rebuild the kernel, run ``tuner.tune_call`` on the call's arguments,
    ``record`` the winner in the user cache. Exits (1) with its error in the result file when it fails, and on its
    own when its parent is gone."""
    p = torch.load(payload_path, weights_only=False)
    exit_with_parent(p["parent_pid"])
    try:
        device = torch.device(p["device"])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        kernel = tuner.registry_kernel(p["kernel_name"], device)
        if _fn_ref(kernel) != p["kernel_fn"]:
            raise RuntimeError(f"the registry's kernel {p['kernel_name']!r} is {_fn_ref(kernel)}, the call's is "
                               f"{p['kernel_fn']}")
        print(f"first-use search: {p['kernel_name']} at {tuning.shape_key(**p['dims'])}, budget {p['budget_s']:.0f} s",
              flush=True)
        with tuning.use(p["settings"]):
            cfg, ms, meta = tuner.tune_call(p["kernel_name"], kernel, p["args"], start=p["start"], seeds=p["seeds"],
                                            budget_s=p["budget_s"], atol=p["atol"], rtol=p["rtol"],
                                            finalize=p["finalize"], prepare=p["prepare"],
                                            log=lambda s: print(s, flush=True))
        path = tuning.record(p["kernel_name"], p["dims"], cfg, ms, dict(meta, process="child"), arch=p["arch"],
                             root=Path(p["cache_root"]))
        print(f"winner {ms * 1000:.1f} us: {tuning.config_to_dict(cfg)} (stored in {path})", flush=True)
        return 0
    except Exception as e:  # noqa: BLE001 - every failure goes back to the parent as one line
        traceback.print_exc()
        Path(p["result"]).write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 1


def exit_with_parent(parent_pid: int, code: int = 3, say: str = "", poll_s: float = 1.0) -> None:
    """End this process (exit ``code``, after the line ``say`` on stderr if given) as soon as its parent is no longer
    ``parent_pid`` (a training process killed while its search runs; a benchmark's child whose parent is gone): a
    daemon thread watches."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        if say:
            print(say, file=sys.stderr, flush=True)
        os._exit(code)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


# ----------------------------------------------------------------------------------------------
# the failure record


def run_id() -> str:
    """The run this process belongs to, as the failure record names it: torchrun's ``TORCHELASTIC_RUN_ID`` (every
    rank of one launch, on every host; ``--rdzv-id``, a uuid with ``--standalone``), else this host and the process
    that started the ranks (torchrun's agent, when ``LOCAL_RANK`` is set without a run id) or this process, with its
    start time (a pid is reused)."""
    rid = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if rid and rid != "none":
        return f"torchelastic:{rid}"
    pid = os.getppid() if "LOCAL_RANK" in os.environ else os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_time(pid)}"


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), "" where unreadable."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def failure_path(c: tuning.Choice) -> Path:
    """``<cache_dir>/<arch>/<kernel>.failed.json``: the first-use searches of this kernel that gave no config."""
    return c.cache_path.with_name(f"{c.kernel_name}.failed.json")


def _read_failures(c: tuning.Choice) -> dict:
    """The failure file of this call's kernel as a dict with a ``failures`` dict. The file only spares a run a second
    search that failed in it: one that cannot be read counts as empty, said once, and the next record replaces it."""
    path = failure_path(c)
    fresh = {"kernel": c.kernel_name, "arch": c.arch, "failures": {}}
    if not path.exists():
        return fresh
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("failures"), dict):
            return data
        what = "no 'failures' object"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        what = f"{type(e).__name__}: {e}"
    tuning.warn_once(c.kernel_name, f"failure-file:{path}",
                     f"nano_hybrid kernels: the first-use failure record {path} cannot be read ({_one_line(what)}); "
                     "taken as empty (the next failure record replaces it)")
    return fresh


def read_failure(c: tuning.Choice) -> dict | None:
    """The failure record of this call's shape: ``{"run", "what", "date", "budget_s"}``, or None."""
    return _read_failures(c)["failures"].get(c.key)


def record_failure(c: tuning.Choice, what: str) -> Path:
    """Write the failure of this call's first-use search (read-modify-written under the file's lock, replaced
    atomically)."""
    entry = {"run": run_id(), "what": what, "budget_s": c.rt.settings.autotune_budget_s,
             "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    return _update_failures(c, lambda failures: failures.__setitem__(c.key, entry))


def clear_failure(c: tuning.Choice) -> None:
    """Remove the failure record of this call's shape (its search has since given a config)."""
    if read_failure(c) is not None:
        _update_failures(c, lambda failures: failures.pop(c.key, None))


def _update_failures(c: tuning.Choice, change: Callable[[dict], Any]) -> Path:
    path = failure_path(c)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tuning.file_lock(path):
        data = _read_failures(c)
        failures = data["failures"]
        change(failures)
        data["failures"] = dict(sorted(failures.items()))
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)
    return path
