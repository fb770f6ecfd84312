"""The config search: what ``scripts/tune_kernels.py`` and first-use tuning (``kernels.helion.autotune``) run.

It sits above ``kernels.tuning`` (whose ``compiled`` it times) and below ``kernels.first_use`` (which runs it at a
call), and imports neither of the two upwards.

Helion's own autotuner returned ``NoConfigFound`` on the H200 host (see kernels/README.md), so the search is driven
here: every candidate is compiled as a fixed config (``kernels.tuning.compiled``), run once, its outputs compared with
the reference config's outputs (the kernel's spec default), then timed in-process with CUDA events
(``triton.testing.do_bench`` median when available). Candidates that fail to compile, crash, or disagree are skipped
and logged; the wall-clock budget is respected between candidates.

Each kernel module may expose ``TUNABLE_KERNELS: dict[str, TunableKernel]``. Called with *model dims* (b, l, h, p,
g, n, c, w: a ``SHAPE_PRESETS`` entry, or the dims a run's config gives) and a device, a ``TunableKernel`` builds a
``TuneCase`` (kernel, args, kernel dims, seed configs, tolerances); its ``dims(model_dims)`` gives the kernel dims
alone (the shape key of a config entry) without allocating or running anything, so finding the pairs that lack a
config costs nothing. ``discover_tunable_kernels()`` imports every ``kernels.*`` module and collects them.

Nothing in a training step calls this module unless ``kernels.helion.autotune`` is on (``tune_call``, from
``kernels.first_use.tune_first_use``, in a child process on a GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import itertools
import pkgutil
import random
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

import helion

from kernels import debug
from kernels.tuning import (ConfigMisfit, as_config, compiled, config_to_dict, file_lock, fit_config, full_config,
                            launch_misfit, with_index_dtype_for)

# Model-level shape presets (Nemotron-3 Nano mixer dims per rank). Kernel TuneCase builders derive their own kernel
# dims from these. "nano" is the benchmark shape; nano_b1 (recipe nano30b_slice_h200), nano_b4_l4096
# (convergence_ab_h200) and nano_b4_l1024 (convergence_ab_h200_2000*) are what the GPU recipes run
# (tests/test_tuning.py::test_recipe_shapes_are_tuned); nano_tp2 is the mixer at tensor parallel 2.
SHAPE_PRESETS: dict[str, dict[str, int]] = {
    "nano": dict(b=2, l=8192, h=64, p=64, g=8, n=128, c=128, w=4),
    "nano_b1": dict(b=1, l=8192, h=64, p=64, g=8, n=128, c=128, w=4),
    "nano_tp2": dict(b=2, l=8192, h=32, p=64, g=4, n=128, c=128, w=4),
    "nano_b4_l4096": dict(b=4, l=4096, h=64, p=64, g=8, n=128, c=128, w=4),
    "nano_b4_l1024": dict(b=4, l=1024, h=64, p=64, g=8, n=128, c=128, w=4),
    # model=nano_proxy (16 heads of Nano's dims) as recipe convergence_seeds_h200 runs it: micro-batch 4 x 1024
    "nano_proxy": dict(b=4, l=1024, h=16, p=64, g=8, n=128, c=128, w=4),
}


def search_bytes(model_dims: dict[str, int]) -> int:
    """An upper estimate of the GPU memory one search at the mixer dims ``model_dims`` (b, l, h, p, g, n, c) holds:
    3.5 times the fwd+bwd op's working set in float32, zxbcdt's columns (x and z, B and C, dt) per token of the
    padded length and the per-chunk states (the case's arguments, the candidate's and the reference's outputs, and
    the search's copies of strided arguments). ``SEARCH_PEAKS_SM90`` holds the peaks measured on an H100; the
    largest is 0.90 of this estimate. Searches running at once keep their sum within the GPU's memory
    (``nano_hybrid.kernel_search.run_children``): on an 80 GiB GPU about 20 at the Nano shape, 1 at 1 x 262144."""
    d = model_dims
    c = d.get("c", 128)
    nc = -(-d["l"] // c)
    tokens = d["b"] * nc * c
    width = 2 * d["h"] * d["p"] + 2 * d["g"] * d["n"] + d["h"]
    states = d["b"] * nc * d["h"] * d["p"] * d["n"]
    return int(3.5 * 4 * (tokens * width + states))


# peak GPU bytes (torch.cuda.max_memory_allocated) of single searches on an H100 (tune_kernels.py, 2026-12-05):
# (kernel, model dims, bytes); a test keeps search_bytes above each of them
SEARCH_PEAKS_SM90 = (
    ("conv1d_fwd", dict(b=1, l=262144, h=64, p=64, g=8, n=128, c=128), 44057030656),
    ("ssd_bwd_dz_dstates", dict(b=1, l=262144, h=64, p=64, g=8, n=128, c=128), 41406169088),
    ("ssd_chunk_scan_cb16", dict(b=1, l=262144, h=64, p=64, g=8, n=128, c=128), 37715182080),
    ("conv1d_bwd", dict(b=2, l=8192, h=64, p=64, g=8, n=128, c=128), 2955259904),
    ("conv1d_fwd", dict(b=2, l=8192, h=64, p=64, g=8, n=128, c=128), 2753687552),
    ("conv1d_bwd", dict(b=1, l=8192, h=128, p=64, g=8, n=128, c=128), 2485669888),
)

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


@dataclasses.dataclass(frozen=True)
class TunableKernel:
    """A tunable kernel of ``TUNABLE_KERNELS``: ``build(model_dims, device)`` its search case (inputs allocated, and
    for some kernels computed by the kernels before it); ``dims(model_dims)`` the kernel dims that case has, computed
    from the model dims alone. Calling it builds the case."""

    build: Callable[[dict, Any], TuneCase]
    dims: Callable[[dict], dict]

    def __call__(self, model_dims: dict, device: Any) -> TuneCase:
        return self.build(model_dims, device)


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


def flatten_outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        res = []
        for o in out:
            res.extend(flatten_outputs(o))
        return res
    return []


def outputs_close(a, b, atol: float, rtol: float) -> tuple[bool, float]:
    """Compare two kernel outputs (tensor or nested tuple); returns (ok, max abs error)."""
    fa, fb = flatten_outputs(a), flatten_outputs(b)
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
    timing_lock: Path | None = None,
) -> tuple[helion.Config, list[dict]]:
    """Compile, check and time each candidate; return ``(best_config, results)``.

    The reference output comes from ``reference`` (default: the bound kernel's default config; when it does not
    fit this specialisation or launch on this GPU (``kernels.tuning.launch_misfit``), the first candidate that
    does) and every candidate's output must match it within ``atol + rtol*|ref|``. With ``finalize``, the
    compared values are ``finalize(raw_outputs, args)`` (config-independent results) for the
    reference and every candidate; ``prepare(args)`` runs before each checked run. ``results`` has one dict per
    candidate tried: config (as fitted to this specialisation and compiled), given (the candidates it was fitted
    from), status ("ok", "compile_error", "run_error", "mismatch", "skipped_budget"), time_ms, max_abs_err, error.
    The budget is checked before each candidate; the reference is always run. A candidate whose compile + check +
    timing exceeds ``candidate_timeout_s`` (or the budget left plus 10 s) is dropped with status "timeout" (some
    configs make Triton compile for minutes).
    A CUDA error that leaves the context unusable ends the search with the best so far. With ``timing_lock`` (a
    file path shared by searches running at once in other processes), each candidate's timed calls run under that
    file's exclusive lock: compiles overlap, timings take turns on the GPU.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("tuning.search needs a CUDA GPU (timings are measured on the device)")
    log = log or (lambda s: None)
    t0 = time.monotonic()
    args = tuple(args)
    kernel = with_index_dtype_for(kernel, args)
    bound = kernel.bind(args)
    results: list[dict] = []

    given: dict[str, list[dict]] = {}  # a fitted config's JSON -> the candidates it came from

    def fitted(cfgs):
        """Each config as it compiles for this specialisation (``kernels.tuning.fit_config``: per-access and per-loop
        lists, block sizes), once: what is timed is what is returned and stored. One that does not fit is a compile
        error."""
        out = []
        for c in cfgs:
            raw = config_to_dict(as_config(c))
            try:
                f = fit_config(bound, c)
            except ConfigMisfit as e:
                results.append({"config": raw, "given": [raw], "status": "compile_error", "time_ms": None,
                                "max_abs_err": None, "error": f"does not fit this specialisation: {e}"[:300]})
                log(f"  candidate does not fit this specialisation: {str(e)[:120]}")
                continue
            if f.to_json() not in given:
                out.append(f)
            came = given.setdefault(f.to_json(), [])
            if raw not in came:
                came.append(raw)
        return out

    first = as_config(reference) if reference is not None else bound.config_spec.default_config()
    firsts = fitted([first])  # before the candidates: a candidate equal to the reference is the reference's run
    candidates = fitted(candidates)
    ref_out = ref_cfg = None
    failed: set[str] = set()
    for cfg in [*firsts, *candidates]:
        if cfg.to_json() in failed:
            continue
        try:
            ref_out = checked_outputs(compiled(kernel, args, cfg, bound=bound), args, finalize, prepare)
        except Exception as e:  # noqa: BLE001 - a config that does not launch on this GPU gives way to the next
            why = launch_misfit(e)
            if why is None:
                raise
            results.append({"config": config_to_dict(cfg), "given": given.get(cfg.to_json(), []),
                            "status": "run_error", "time_ms": None, "max_abs_err": None, "error": why})
            log(f"  reference candidate does not launch: {why[:120]}")
            failed.add(cfg.to_json())
            continue
        ref_cfg = cfg
        break
    if ref_cfg is None:
        raise RuntimeError(f"tuning.search: no config launches on this GPU; first errors: "
                           f"{[r.get('error') for r in results[:3]]}")
    torch.cuda.synchronize()
    ref_out = [t.clone() for t in flatten_outputs(ref_out)]
    best: tuple[float, helion.Config] | None = None
    skip = failed | {ref_cfg.to_json()}
    cands = [ref_cfg] + [c for c in candidates if c.to_json() not in skip]
    for i, cfg in enumerate(cands):
        r: dict[str, Any] = {"config": config_to_dict(cfg), "given": given.get(cfg.to_json(), []), "status": None,
                             "time_ms": None, "max_abs_err": None}
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
                fn = compiled(kernel, args, cfg, bound=bound)
                r["status"] = None
                out = checked_outputs(fn, args, finalize, prepare)
                torch.cuda.synchronize()
                ok, err = outputs_close(out, ref_out, atol, rtol)
                if ok:
                    with (file_lock(timing_lock) if timing_lock else contextlib.nullcontext()):
                        ms = time_fn(lambda: fn(*args), rep)
                else:
                    ms = None
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


_NOT_KERNEL_MODULES = ("tuning", "tuner", "first_use", "registry", "settings", "debug", "shapes")


def discover_tunable_kernels() -> dict[str, tuple[str, TunableKernel]]:
    """``{kernel_name: (module_name, TunableKernel)}`` from every ``kernels.*`` module's TUNABLE_KERNELS."""
    import kernels as _pkg

    found: dict[str, tuple[str, TunableKernel]] = {}
    for mod in pkgutil.iter_modules(_pkg.__path__):
        if mod.name in _NOT_KERNEL_MODULES or mod.name.startswith("_"):
            continue
        m = importlib.import_module(f"kernels.{mod.name}")
        for name, builder in getattr(m, "TUNABLE_KERNELS", {}).items():
            if name in found:
                raise ValueError(f"tunable kernel {name!r} defined in both {found[name][0]} and kernels.{mod.name}")
            if not isinstance(builder, TunableKernel):
                raise TypeError(f"kernels.{mod.name}.TUNABLE_KERNELS[{name!r}] is a {type(builder).__name__}, "
                                "not a kernels.tuner.TunableKernel")
            found[name] = (f"kernels.{mod.name}", builder)
    return found


def registry_kernel(name: str, device: torch.device | str) -> Any:
    """The helion kernel of tunable kernel ``name`` (``discover_tunable_kernels``): the kernel of its case built at the
    smallest shape preset on ``device`` (the case's arguments are dropped). What a first-use search in a child
    process runs, the registry name being what reaches it (a helion kernel does not pickle)."""
    registry = discover_tunable_kernels()
    if name not in registry:
        raise KeyError(f"{name!r} is no tunable kernel (known: {', '.join(sorted(registry))})")
    smallest = min(SHAPE_PRESETS.values(), key=lambda d: d["b"] * d["l"] * d["h"] * d["p"])
    return registry[name][1](dict(smallest), torch.device(device)).kernel


def format_exc() -> str:
    return traceback.format_exc()


def _copy_arg(a):
    """A tensor argument copied with its own strides (the search writes into output buffers; the call's tensors are
    left as they are), anything else as it is. A tensor whose elements share memory (an expanded view, e.g. a
    broadcast D or dt_bias) is passed as it is: no kernel writes to one, and a copy with its strides cannot exist."""
    if not isinstance(a, torch.Tensor):
        return a
    if torch._debug_has_internal_overlap(a) == 1:  # MemOverlap::Yes
        return a
    t = torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device)
    t.copy_(a)
    return t


def tune_call(
    kernel_name: str,
    kernel,
    args: Sequence[object],
    *,
    start: Sequence[helion.Config | Mapping[str, Any]] = (),
    seeds: Sequence[helion.Config | Mapping[str, Any]] = (),
    budget_s: float = 60.0,
    atol: float = 1e-2,
    rtol: float = 1e-2,
    finalize: Callable[[Any, tuple], Any] | None = None,
    prepare: Callable[[tuple], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[helion.Config, float, dict]:
    """First-use tuning of one kernel call (``kernels.helion.autotune``): ``search`` over ``start`` (configs that fit
    this call, e.g. the nearest tuned shape's, tried first), the seeds and random configs of the bound kernel's space,
    on copies of the call's arguments. Returns ``(winner, time_ms, meta)``; the winner is a full config
    (``kernels.tuning.full_config``)."""
    t0 = time.monotonic()
    kernel = with_index_dtype_for(kernel, args)
    work = tuple(_copy_arg(a) for a in args)
    cands = [*map(as_config, start), *candidate_configs(kernel, work, seeds=seeds, n_random=16)]
    best, results = search(kernel, work, cands, budget_s=budget_s, atol=atol, rtol=rtol, finalize=finalize,
                           prepare=prepare, log=log)
    ok = [r for r in results if r["status"] == "ok"]
    best_ms = min(r["time_ms"] for r in ok)
    meta = {"how": "first-use tuning", "n_tried": sum(r["status"] != "skipped_budget" for r in results),
            "n_ok": len(ok), "search_s": round(time.monotonic() - t0, 1), "budget_s": budget_s,
            "timer": timer_name()}
    del work
    return full_config(kernel, args, best), best_ms, meta

