"""Search Helion configs for tunable kernels on this GPU and write winners to kernels/configs/<arch>/.

    python scripts/tune_kernels.py model=nano30b_slice train.micro_batch_size=2 parallel.tensor_model_parallel_size=2
    python scripts/tune_kernels.py --kernels rmsnorm_fwd,rmsnorm_bwd,conv1d_fwd,conv1d_bwd --shapes nano --budget-min 8

Positional arguments are a run's own overrides (the same as ``python -m nano_hybrid.train ...``): the config is
composed as training composes it and the mixer dims one rank of that run calls are tuned
(``nano_hybrid.model.config.mixer_dims``: micro-batch, sequence per context-parallel rank, heads and groups per
tensor-parallel rank, head dim, state dim, chunk, conv width). Without overrides, ``--shapes`` names presets, or
``bench_shape_grid.py``'s shapes without packed documents (to tune a grid before it runs).

Kernels come from every ``kernels.*`` module's ``TUNABLE_KERNELS`` (``kernels.tuner.discover_tunable_kernels``); with a
run's overrides the default is the kernels a training step calls (``kernels.registry.HELION_TRAINING_KERNELS``);
shapes are ``kernels.tuner.SHAPE_PRESETS`` names. The budget is split evenly over (kernel, shape)
pairs. Candidates: the kernel's default config, its hand-written seeds (shuffled with a fixed seed),
then random configs from the bound kernel's config space; each is compiled as a fixed config,
checked against the default config's output and timed in-process (``kernels.tuner.search``).
Kernels whose raw outputs depend on the config (per-program partial sums of rmsnorm_bwd / conv1d_bwd)
are compared on their final results (``TuneCase.finalize``: dx, dz, summed dweight/dbias).
A JSON log with every candidate's outcome goes to $OUT (default runs/bench/h200).
A failing (kernel, shape) is logged with its traceback and the next one still runs. With more than one
(kernel, shape) pair each pair is searched in a child process of its own (``--no-isolate`` turns that off): a
candidate that leaves a sticky CUDA error (e.g. "misaligned address") ends only its own search, where
in one process it ended every search after it.

``--jobs N`` runs N of those children at once. Most of a search is compiling candidates (Helion code generation,
Triton, ptxas: CPU work), so N searches overlap on N cores; the timing of a candidate holds a lock shared by the
children (``tuner.search``'s ``timing_lock``), so one candidate at a time runs its timed calls on the GPU and the
others' compiles do not run on the device meanwhile. Each child gets the budget of N pairs (the total budget
times N over the number of pairs), so the wall time stays about the total budget.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping
from pathlib import Path

import torch

from kernels import first_use, tuner, tuning
from kernels.registry import HELION_TRAINING_KERNELS
from nano_hybrid.bench.environment import REPO_ROOT
from nano_hybrid.errors import EXIT_BAD_INPUT


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="a run's overrides (as for nano_hybrid.train): tune the mixer shapes it calls")
    ap.add_argument("--kernels", default=None,
                    help="comma list of tunable kernel names, 'training' (the kernels a training step calls: "
                    "kernels.registry.HELION_TRAINING_KERNELS; the default with a run's overrides) or 'all' (the "
                    "default with presets)")
    ap.add_argument("--shapes", "--shape", dest="shapes", default=None,
                    help=f"comma list of presets (default nano without overrides): {', '.join(tuner.SHAPE_PRESETS)}; "
                    "or of bench_shape_grid.py's shapes without packed documents")
    ap.add_argument("--model-dims", default=None, help=argparse.SUPPRESS)  # JSON {name: dims}: the isolated children
    ap.add_argument("--out-root", default=None,
                    help="write configs under this root instead of kernels/configs (e.g. the user cache "
                    "~/.cache/nano_hybrid/helion); the default writes the files a team commits")
    ap.add_argument("--budget-min", type=float, default=8.0, help="total wall-clock budget in minutes")
    ap.add_argument("--budget-s", type=float, default=None, help="total budget in seconds (overrides --budget-min)")
    ap.add_argument("--rep-ms", type=float, default=40.0, help="timing window per candidate (ms)")
    ap.add_argument("--timer", choices=tuner.TIMERS, default=None,
                    help="how candidates are timed (NANO_TUNE_TIMER; default events): 'cudagraph' times device time "
                    "from CUDA-graph replays, for kernels of a few microseconds whose per-call time is the launch's")
    ap.add_argument("--no-write", action="store_true", help="do not update kernels/configs/")
    ap.add_argument("--list", action="store_true", help="list tunable kernels and exit")
    ap.add_argument("--from-scratch", action="store_true",
                    help="do not start from the committed config and its neighbours (tuner.neighbour_configs)")
    ap.add_argument("--missing", action="store_true",
                    help="tune only the kernels with a shape that has no exact config yet (in kernels/configs, nor "
                    "under --out-root when given); a run's overrides with --missing tune what that run would tune "
                    "on first use")
    ap.add_argument("--no-isolate", action="store_true",
                    help="search every (kernel, shape) pair in this process (default: one child process per pair "
                    "when there is more than one)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="child processes searching at once (their compiles overlap; their timings take turns on "
                    "the GPU under a shared lock); each gets the total budget x jobs / pairs")
    ap.add_argument("--timing-lock", default=None, help=argparse.SUPPRESS)  # the isolated children's shared lock
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.budget_s is not None:
        args.budget_min = args.budget_s / 60.0
    if args.timer is not None:
        os.environ["NANO_TUNE_TIMER"] = args.timer  # read by tuner.time_fn here and in the child processes

    registry = tuner.discover_tunable_kernels()
    if args.list:
        for name, (mod, _) in sorted(registry.items()):
            print(f"{name}\t{mod}")
        return 0
    which = args.kernels or ("training" if args.overrides else "all")
    if which == "all":
        names = sorted(registry)
    elif which == "training":
        names = sorted(HELION_TRAINING_KERNELS)
    else:
        names = [k.strip() for k in which.split(",") if k.strip()]
    unknown = [k for k in names if k not in registry]
    if unknown:
        ap.error(f"unknown kernels {unknown}; known: {sorted(registry)}")
    try:
        shape_dims = resolve_shapes(args.overrides, args.shapes, args.model_dims)
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        print("tune_kernels.py needs a CUDA GPU", file=sys.stderr)
        return EXIT_BAD_INPUT
    if tuning.interpret_mode():
        print("unset HELION_INTERPRET to tune", file=sys.stderr)
        return EXIT_BAD_INPUT

    if args.missing:
        names = missing_kernels(registry, names, shape_dims, args.out_root and Path(args.out_root))
        if not names:
            print("every kernel has an exact config at these shapes: nothing to tune", flush=True)
            return 0
        print(f"kernels without an exact config: {', '.join(names)}", flush=True)
    pairs = len(names) * len(shape_dims)
    if not args.no_isolate and pairs > 1:
        jobs = min(args.jobs, pairs)
        return _run_isolated(args, names, shape_dims, args.budget_min * 60.0 * jobs / pairs, jobs)
    per_budget = args.budget_min * 60.0 / pairs
    return search_all(args, registry, names, shape_dims, per_budget)


def missing_kernels(registry: dict, names: list[str], shape_dims: dict[str, dict], root: Path | None,
                    device: str = "cuda", arch: str | None = None) -> list[str]:
    """The kernels of ``names`` with at least one shape of ``shape_dims`` that has no exact config for ``arch``
    (default: this GPU's) in the committed configs, nor under ``root`` when given (a user cache); the kernel dims
    come from each kernel's own case at that shape."""
    device = torch.device(device)
    keep = []
    for name in names:
        for dims in shape_dims.values():
            case = registry[name][1](dict(dims), device)
            roots = [None] if root is None else [None, root]
            if all(tuning.lookup(name, case.dims, arch=arch, root=r)[0] != "exact" for r in roots):
                keep.append(name)
                break
    return keep


def search_all(args, registry: dict, names: list[str], shape_dims: dict[str, dict], per_budget: float) -> int:
    """Every (kernel, shape) pair searched in this process; the JSON log rewritten after each pair."""
    out_dir = Path(os.environ.get("OUT", "runs/bench/h200"))
    out_dir.mkdir(parents=True, exist_ok=True)
    arch = tuning.current_arch()
    log = {
        "what": "Helion config search (kernels/tuning.py search): per (kernel, shape) the default config is the "
        "reference; every candidate is compiled as a fixed config, its output compared to the reference, then timed "
        "in-process (median ms). 'winner' is written to kernels/configs/<arch>/<kernel>.json unless --no-write.",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "arch": arch,
        "torch": torch.__version__,
        "helion": _version("helion"),
        "triton": _version("triton"),
        "budget_min_total": args.budget_min,
        "timer": tuner.timer_name(),
        "budget_s_per_kernel_shape": per_budget,
        "runs": [],
    }
    log_path = out_dir / f"tune_{arch}_{dt.datetime.now().strftime('%Y%m%d_%H%M%S')}.json"
    device = torch.device("cuda")
    for shape in shape_dims:
        for name in names:
            t0 = time.monotonic()
            run = {"kernel": name, "shape": shape, "model_dims": shape_dims[shape]}
            print(f"== {name} @ {shape} (budget {per_budget:.0f}s)", flush=True)
            try:
                search_pair(args, registry[name][1](dict(shape_dims[shape]), device), name, shape, per_budget, run, t0)
            except Exception:  # noqa: BLE001 - logged, next kernel still runs
                run["error"] = traceback.format_exc()
                print(run["error"], file=sys.stderr, flush=True)
            run["elapsed_s"] = round(time.monotonic() - t0, 1)
            log["runs"].append(run)
            log_path.write_text(json.dumps(log, indent=1, default=str))
    print(f"log: {log_path}")
    return 0 if all("error" not in r for r in log["runs"]) else 1


def candidates(args, case, name: str, run: dict) -> list:
    """The reference (spec default) first, then the committed winner for this shape (or the nearest shape's)
    and its neighbours, the generic default, the shuffled seeds and random configs; each config once."""
    seeds = list(case.seeds)
    random.Random(0).shuffle(seeds)
    cands = tuner.candidate_configs(case.kernel, case.args, seeds=seeds, n_random=case.n_random)
    # the generic default (what runs without a config file) comes after the spec default (the reference)
    cands.insert(1, tuning.as_config(case.default))
    # and before both, right after the reference: the committed winner for this shape (or, for a shape
    # without one, the nearest shape's winner: the config the wrappers run there today) and its
    # neighbours (TMA / block-pointer indexing, eviction policies, num_warps and num_stages one step
    # away): a search with a short budget starts from what is known to be good and can only improve on it
    how, near_key, entry = tuning.lookup(name, case.dims)
    if how in ("exact", "nearest") and not args.from_scratch:
        committed = tuning.as_config(entry["config"])
        near = [committed] + [tuning.as_config(d) for d in tuner.neighbour_configs(committed)]
        run["start"] = {"how": how, "key": near_key}
        if how == "exact":
            run["committed_ms"] = entry.get("time_ms")
        cands[1:1] = near  # right after the reference: a short budget still times them
        seen: set[str] = set()  # a neighbour can equal a seed: time each config once
        cands = [c for c in cands if not (c.to_json() in seen or seen.add(c.to_json()))]
    return cands


def search_pair(args, case, name: str, shape: str, per_budget: float, run: dict, t0: float) -> None:
    """One (kernel, shape) search: its outcome in ``run``; the winner written unless ``--no-write``."""
    run["kernel_dims"] = case.dims
    cands = candidates(args, case, name, run)
    best, results = tuner.search(
        case.kernel, case.args, cands, budget_s=per_budget, rep=args.rep_ms, atol=case.atol, rtol=case.rtol,
        log=lambda s: print(s, flush=True), finalize=case.finalize, prepare=case.prepare,
        timing_lock=getattr(args, "timing_lock", None) and Path(args.timing_lock),
    )
    ok = [r for r in results if r["status"] == "ok"]
    best_ms = min(r["time_ms"] for r in ok)
    generic = next((r for r in results if r["config"] == tuning.config_to_dict(case.default)), None)
    run.update(
        winner=tuning.config_to_dict(best), winner_ms=best_ms,
        generic_default_ms=(generic or {}).get("time_ms"),
        spec_default_ms=results[0].get("time_ms"),
        n_candidates=len(cands), n_tried=sum(r["status"] != "skipped_budget" for r in results),
        n_ok=len(ok), status_counts=_counts(results), candidates=results,
    )
    if not args.no_write:
        # the normalized config (every key explicit), so the committed file does not leave
        # anything for Helion to fill in differently in another process
        try:
            best = tuning.full_config(case.kernel, case.args, best)
        except Exception as e:  # noqa: BLE001 - keep the partial winner, say so
            run["full_config_error"] = f"{type(e).__name__}: {e}"
        run["written_config"] = tuning.config_to_dict(best)
        path = tuning.record(name, case.dims, best, best_ms, root=args.out_root and Path(args.out_root), meta={
            "shape_preset": shape, "n_tried": run["n_tried"], "n_ok": run["n_ok"], "timer": tuner.timer_name(),
            "generic_default_ms": run["generic_default_ms"], "search_s": round(time.monotonic() - t0, 1),
            "torch": torch.__version__, "helion": _version("helion"), "triton": _version("triton"),
        })
        run["written"] = str(path)
    print(f"   winner {best_ms * 1000:.1f} us (generic default {run['generic_default_ms']}) "
          f"tried {run['n_tried']}/{len(cands)} ok {run['n_ok']}", flush=True)


# seconds a child spends outside its search (imports, CUDA start, building the case): taken off each pair's
# share so that an isolated run keeps to the total budget
ISOLATE_OVERHEAD_S = 15.0


def resolve_shapes(overrides: list[str], presets: str | None, model_dims: str | None) -> dict[str, dict]:
    """{shape name: model dims}: from a run's overrides (one shape, named by its shape key), else the presets
    (``--shapes``, default nano); ``model_dims`` (JSON) is what the isolated children get."""
    if model_dims:
        return json.loads(model_dims)
    if overrides:
        if presets:
            raise ValueError("give either a run's overrides or --shapes, not both")
        from nano_hybrid.config import ConfigError, compose
        from nano_hybrid.model.config import mixer_dims

        try:
            dims = mixer_dims(compose(list(overrides)))
        except ConfigError as e:
            raise ValueError(f"overrides {' '.join(overrides)}: {e}") from None
        return {"run_" + tuning.shape_key(**dims): dims}
    from nano_hybrid.bench.bench_shape_grid import GRID

    names = [s.strip() for s in (presets or "nano").split(",") if s.strip()]
    bad = [s for s in names if s not in tuner.SHAPE_PRESETS and s not in GRID]
    if bad:
        raise ValueError(f"unknown shapes {bad}; known: presets {sorted(tuner.SHAPE_PRESETS)}, "
                         f"bench_shape_grid.py shapes {sorted(GRID)}")
    packed = [s for s in names if s not in tuner.SHAPE_PRESETS and GRID[s][1] > 1]
    if packed:
        raise ValueError(f"shapes {packed} pack documents (seq_idx), which the offline cases do not build; their "
                         "kernels are tuned at the first call (kernels.helion.autotune=true)")
    return {s: dict(tuner.SHAPE_PRESETS[s]) if s in tuner.SHAPE_PRESETS else grid_dims(GRID[s][0]) for s in names}


def grid_dims(shape) -> dict[str, int]:
    """A ``bench_shape_grid.py`` shape (``MixerShape``) as model dims."""
    return dict(b=shape.batch, l=shape.seqlen, h=shape.nheads, p=shape.headdim, g=shape.ngroups, n=shape.d_state,
                c=shape.chunk_size, w=shape.d_conv)


def child_commands(args, names: list[str], shape_dims: dict[str, dict], per_budget: float,
                   timing_lock: str | None = None) -> list[list[str]]:
    """One ``tune_kernels.py --no-isolate`` command per (kernel, shape) pair, each with that pair's budget
    less the child's start-up time (and ``timing_lock``, the lock file that children running at once share)."""
    per_budget = max(10.0, per_budget - ISOLATE_OVERHEAD_S)
    cmds = []
    for shape, dims in shape_dims.items():
        for name in names:
            cmd = [sys.executable, str(REPO_ROOT / "scripts" / "tune_kernels.py"), "--kernels", name,
                   "--model-dims", json.dumps({shape: dims}),
                   "--budget-s", f"{per_budget:.1f}", "--rep-ms", str(args.rep_ms), "--no-isolate"]
            cmd += ["--out-root", args.out_root] if getattr(args, "out_root", None) else []
            cmd += ["--no-write"] if args.no_write else []
            cmd += ["--from-scratch"] if args.from_scratch else []
            cmd += ["--timing-lock", timing_lock] if timing_lock else []
            cmds.append(cmd)
    return cmds


def _run_isolated(args, names: list[str], shapes: dict[str, dict], per_budget: float, jobs: int = 1) -> int:
    """Each pair in its own process (fresh CUDA context), ``jobs`` at a time; each child writes its own JSON log and
    config file (``tuning.record`` updates a kernel's file under its lock). A child is stopped after its share of
    the budget plus ``kernels.first_use.SEARCH_MARGIN_S`` (75 s: start-up, the reference compile, one candidate's
    time limit), the margin of first-use tuning's child."""
    with tempfile.TemporaryDirectory(prefix="tune_kernels_") as tmp:
        lock = str(Path(tmp) / "gpu_timing") if jobs > 1 else None
        cmds = child_commands(args, names, shapes, per_budget, timing_lock=lock)
        failed = run_children(cmds, jobs, per_budget + first_use.SEARCH_MARGIN_S)
    print(f"isolated searches: {len(cmds) - len(failed)} ok" + (f", failed: {', '.join(failed)}" if failed else "")
          + (f" ({jobs} at a time)" if jobs > 1 else ""), flush=True)
    return 1 if failed else 0


def _pair(cmd: list[str]) -> str:
    """"<kernel> @ <shape>" of a child command (the command itself for another one)."""
    if "--kernels" not in cmd:
        return " ".join(cmd)
    return f"{cmd[cmd.index('--kernels') + 1]} @ {next(iter(json.loads(cmd[cmd.index('--model-dims') + 1])))}"


def run_children(cmds: list[list[str]], jobs: int, timeout_s: float, poll_s: float = 0.2,
                 log_dir: Path | None = None, say=lambda msg: print(msg, flush=True)) -> list[str]:
    """Run ``cmds`` (``tune_kernels.py`` children), at most ``jobs`` at once, each killed after ``timeout_s``;
    returns "<kernel> @ <shape> (exit <rc>|timeout)" for every child that did not exit 0. With ``log_dir`` each
    child's output goes to ``<log_dir>/<n>.log`` (named in its failure) and its JSON log there too (``$OUT``)."""
    def pair(cmd):
        return _pair(cmd) + (f"; log {logs[id(cmd)]}" if id(cmd) in logs else "")

    def start(n, cmd):
        if log_dir is None:
            return subprocess.Popen(cmd)
        logs[id(cmd)] = log_dir / f"{n}.log"
        with open(logs[id(cmd)], "w") as f:
            return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, OUT=str(log_dir)))

    logs: dict[int, Path] = {}
    pending, running, failed = list(enumerate(cmds)), [], []
    while pending or running:
        while pending and len(running) < jobs:
            n, cmd = pending.pop(0)
            running.append((cmd, start(n, cmd), time.monotonic()))
        time.sleep(poll_s)
        for item in list(running):
            cmd, proc, t0 = item
            rc = proc.poll()
            if rc is None and time.monotonic() - t0 > timeout_s:
                proc.kill()
                proc.wait()
                rc = "timeout"
            if rc is None:
                continue
            running.remove(item)
            if rc != 0:
                what = "timeout" if rc == "timeout" else f"exit {rc}"
                failed.append(f"{pair(cmd)} ({what})")
                say(f"   {pair(cmd)}: child process failed ({what}); the other pairs still run")
    return failed


def pretune(dims: Mapping[str, int], settings, say=lambda msg: print(msg, flush=True)) -> list[str]:
    """``kernels.helion.autotune`` before a run's first step: tune every kernel a training step calls
    (``kernels.registry.HELION_TRAINING_KERNELS``) that has no exact config (committed, or in the user cache) at the
    run's mixer dims ``dims`` on this GPU, ``settings.autotune_jobs`` isolated
    searches at a time, each with the first-use budget ``settings.autotune_budget_s``, winners into the user cache.
    The first call of each kernel then finds its config, instead of searching one kernel after the other in the
    first step. Under a lock per shape in the cache, so the other processes of the run (and other runs sharing the
    cache) wait and then find nothing left to tune. Children's output goes to ``<cache>/<arch>/pretune_logs/``.
    Returns the searches that failed (their kernels still search at their first call, as without this)."""
    arch = tuning.current_arch()
    root = tuning.user_cache_root(settings.cache_dir)
    key = tuning.shape_key(**dims)
    registry = tuner.discover_tunable_kernels()
    with tuning.file_lock(root / arch / f"pretune.{key}"):
        names = missing_kernels(registry, sorted(HELION_TRAINING_KERNELS), {key: dict(dims)}, root)
        if not names:
            return []
        jobs = min(settings.autotune_jobs, len(names))
        rounds = -(-len(names) // jobs)
        say(f"nano_hybrid kernels: tuning {len(names)} kernels without a config at {key} on this GPU, {jobs} at a "
            f"time, {settings.autotune_budget_s:.0f} s each (about {rounds * (settings.autotune_budget_s + 40):.0f} s;"
            f" kernels.helion.autotune); winners go to {root / arch}")
        log_dir = root / arch / "pretune_logs" / f"{key}_{dt.datetime.now().strftime('%Y%m%d_%H%M%S')}"
        log_dir.mkdir(parents=True, exist_ok=True)
        ns = argparse.Namespace(rep_ms=40.0, no_write=False, from_scratch=False, out_root=str(root))
        t0 = time.monotonic()
        cmds = child_commands(ns, names, {key: dict(dims)}, settings.autotune_budget_s + ISOLATE_OVERHEAD_S,
                              timing_lock=str(log_dir / "gpu_timing") if jobs > 1 else None)
        failed = run_children(cmds, jobs, settings.autotune_budget_s + ISOLATE_OVERHEAD_S + first_use.SEARCH_MARGIN_S,
                              log_dir=log_dir, say=say)
        say(f"nano_hybrid kernels: tuned {len(names) - len(failed)} of {len(names)} kernels at {key} in "
            f"{time.monotonic() - t0:.0f} s" + (f"; failed (searched again at their first call): {', '.join(failed)}"
                                                 if failed else ""))
    return failed


def _counts(results):
    c = {}
    for r in results:
        c[r["status"]] = c.get(r["status"], 0) + 1
    return c


def _version(mod):
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001
        from importlib.metadata import version

        try:
            return version(mod)
        except Exception:  # noqa: BLE001
            return None
