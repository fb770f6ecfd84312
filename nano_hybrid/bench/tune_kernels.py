"""Search Helion configs for tunable kernels on this GPU and write winners to kernels/configs/<arch>/.

    python scripts/tune_kernels.py model=nano30b_slice train.micro_batch_size=2 parallel.tensor_model_parallel_size=2
    python scripts/tune_kernels.py --kernels rmsnorm_fwd,rmsnorm_bwd,conv1d_fwd,conv1d_bwd --shapes nano --budget-min 8

Positional arguments are a run's own overrides (the same as ``python -m nano_hybrid.train ...``): the config is
composed as training composes it and the mixer dims one rank of that run calls are tuned
(``nano_hybrid.model.config.mixer_dims``: micro-batch, sequence, heads and groups per rank (per tensor- and
context-parallel rank: megatron's context parallelism gives each rank's mixer the whole sequence and a share of the
heads), head dim, state dim, chunk, conv width). Without overrides, ``--shapes`` names presets, or
``bench_shape_grid.py``'s shapes (``grid``: all of them; to tune a grid before it runs). A shape that packs documents
(model dim "docs") tunes the kernels that take seq_idx with it (the conv1d kernels, keyed ``seq1``); the SSD kernels'
configs do not depend on seq_idx, so a packed shape shares them with the same shape unpacked (searched once).

Kernels come from every ``kernels.*`` module's ``TUNABLE_KERNELS`` (``kernels.tuner.discover_tunable_kernels``); with a
run's overrides the default is the kernels a training step calls (``kernels.registry.helion_training_kernels``);
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

``--merge DIR`` (no GPU) adds the configs of another search's ``--out-root`` or a user cache to kernels/configs (or
``--out-root``): the shapes the destination lacks; ``--replace`` also replaces those it has. Every file is checked
before any is written.

``--jobs N`` runs N of those children at once. Most of a search is compiling candidates (Helion code generation,
Triton, ptxas: CPU work), so N searches overlap on N cores; the timing of a candidate holds a lock shared by the
children (``tuner.search``'s ``timing_lock``), so one candidate at a time runs its timed calls on the GPU and the
others' compiles do not run on the device meanwhile. Children running at once also keep their estimated GPU memory
(``kernels.tuner.search_bytes``) within the GPU's (``nano_hybrid.kernel_search.run_children``). Each child gets the
total budget divided by the rounds the children run in (N pairs at a time, or fewer where their memory does not fit
N at once), so the wall time stays about the total budget.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from kernels import first_use, tuner, tuning
from kernels.registry import helion_training_kernels
from kernels.settings import HelionSettings, HelionSettingsError
from nano_hybrid.kernel_search import (admission_rounds, child_commands, gpu_memory_budget, missing_pairs, pairs_of,
                                       run_children)
from nano_hybrid.errors import EXIT_BAD_INPUT


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="a run's overrides (as for nano_hybrid.train): tune the mixer shapes it calls")
    ap.add_argument("--kernels", default=None,
                    help="comma list of tunable kernel names, 'training' (the kernels a training step calls with "
                    "the run's kernels.helion settings: kernels.registry.helion_training_kernels; the default with a "
                    "run's overrides) or 'all' (the default with presets)")
    ap.add_argument("--shapes", "--shape", dest="shapes", default=None,
                    help=f"comma list of presets (default nano without overrides): {', '.join(tuner.SHAPE_PRESETS)}; "
                    "or of bench_shape_grid.py's shapes ('grid': all of those)")
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
                    help="tune only the (kernel, shape) pairs that have no exact config yet (in kernels/configs, "
                    "nor under --out-root when given); a run's overrides with --missing tune what that run would "
                    "tune on first use")
    ap.add_argument("--no-isolate", action="store_true",
                    help="search every (kernel, shape) pair in this process (default: one child process per pair "
                    "when there is more than one)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="child processes searching at once (their compiles overlap; their timings take turns on "
                    "the GPU under a shared lock; fewer where their GPU memory does not fit); each gets the total "
                    "budget over the rounds they run in")
    ap.add_argument("--timing-lock", default=None, help=argparse.SUPPRESS)  # the isolated children's shared lock
    ap.add_argument("--merge", default=None, metavar="DIR",
                    help="merge the config files under DIR (<arch>/<kernel>.json: another search's --out-root, a "
                    "user cache) into --out-root (default kernels/configs) and exit; no GPU needed. Shapes the "
                    "destination lacks are added, shapes it has are kept (--replace: replaced)")
    ap.add_argument("--replace", action="store_true", help="with --merge: replace the entries of shapes already there")
    return ap


def merge(args) -> int:
    """--merge: the config files under args.merge into --out-root (default kernels/configs), one summary line."""
    import collections

    dst = Path(args.out_root) if args.out_root else tuning.CONFIG_ROOT
    try:
        rows = tuning.merge_config_files(Path(args.merge), dst, replace=args.replace,
                                         kernels=sorted(tuner.discover_tunable_kernels()))
    except tuning.ConfigFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:  # the destination cannot be written (files merged before it keep their new entries)
        print(f"error: merging into {dst}: {e}", file=sys.stderr)
        return 1
    n = collections.Counter(r["action"] for r in rows)
    for r in rows:
        if r["action"] in ("added", "replaced"):
            print(f"{r['action']:8s} {r['arch']}/{r['kernel']} {r['key']}")
    kept = f" ({n['kept']} kept: their shapes are there already; --replace replaces them)" if n["kept"] else ""
    print(f"merged {args.merge} into {dst}: {n['added']} added, {n['replaced']} replaced, {n['same']} the same{kept}")
    return 0


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.replace and not args.merge:
        print("error: --replace goes with --merge DIR", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.merge:
        return merge(args)
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.budget_s is not None:
        args.budget_min = args.budget_s / 60.0
    if not args.budget_min > 0:
        ap.error(f"the budget must be > 0 (--budget-min {args.budget_min}, --budget-s {args.budget_s})")
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
        try:
            names = sorted(helion_training_kernels(run_settings(args.overrides), run_fused_norm(args.overrides)))
        except ValueError as e:
            ap.error(str(e))
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
        print("error: tune_kernels.py needs a CUDA GPU", file=sys.stderr)
        return EXIT_BAD_INPUT
    if tuning.interpret_mode():
        print("error: tune_kernels.py needs HELION_INTERPRET unset (it tunes compiled kernels)", file=sys.stderr)
        return EXIT_BAD_INPUT

    pairs = pairs_of(names, shape_dims, registry)
    if args.missing:
        pairs = missing_pairs(registry, names, shape_dims, args.out_root and Path(args.out_root))
        if not pairs:
            print("every kernel has an exact config at these shapes: nothing to tune", flush=True)
            return 0
        print(f"{len(pairs)} of {len(names) * len(shape_dims)} (kernel, shape) pairs without an exact config: "
              + ", ".join(f"{n} @ {s}" for n, s in pairs), flush=True)
    if not args.no_isolate and len(pairs) > 1:
        jobs = min(args.jobs, len(pairs))
        # each child's share of the total budget: the children run in rounds of `jobs`, or fewer where their GPU
        # memory (kernels.tuner.search_bytes) does not fit `jobs` at once
        budget = gpu_memory_budget()
        rounds = admission_rounds([tuner.search_bytes(shape_dims[shape]) for _, shape in pairs], jobs, budget)
        total = args.budget_min * 60.0
        per_budget = total * jobs / len(pairs) if rounds <= -(-len(pairs) // jobs) else total / rounds
        return _run_isolated(args, pairs, shape_dims, per_budget, jobs, mem_budget=budget)
    per_budget = args.budget_min * 60.0 / len(pairs)
    return search_all(args, registry, pairs, shape_dims, per_budget)


def search_all(args, registry: dict, pairs: list[tuple[str, str]], shape_dims: dict[str, dict],
               per_budget: float) -> int:
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
    # the process id keeps apart the logs of searches that start in the same second (isolated searches in parallel)
    log_path = out_dir / f"tune_{arch}_{dt.datetime.now().strftime('%Y%m%d_%H%M%S')}_{os.getpid()}.json"
    device = torch.device("cuda")
    for name, shape in pairs:
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
            run["committed_config"] = tuning.config_to_dict(committed)
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

    def tried(r, cfg) -> bool:
        """Whether result ``r`` is candidate ``cfg`` (the search fits candidates to the kernel's specialisation:
        ``given`` lists the candidates a fitted config came from)."""
        return tuning.config_to_dict(cfg) in r.get("given", [r["config"]])

    generic = next((r for r in results if tried(r, case.default)), None)
    run.update(
        winner=tuning.config_to_dict(best), winner_ms=best_ms,
        generic_default_ms=(generic or {}).get("time_ms"),
        spec_default_ms=next((r for r in results if tried(r, cands[0])), {}).get("time_ms"),
        peak_gpu_bytes=torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        n_candidates=len(cands), n_tried=sum(r["status"] != "skipped_budget" for r in results),
        n_ok=len(ok), status_counts=_counts(results), candidates=results,
    )
    committed = run.get("committed_config")
    if committed is not None and not any(tried(r, committed) and r["status"] != "skipped_budget" for r in results):
        # the search ended before the shape's own config had its turn: the winner was never compared with it
        run["kept_committed"] = True
        print("   the search's budget ended before it timed this shape's committed config: the config file keeps it",
              flush=True)
    elif not args.no_write:
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
    peak = run["peak_gpu_bytes"]
    dflt = run["generic_default_ms"]
    print(f"   winner {best_ms * 1000:.1f} us (generic default "
          + (f"{dflt * 1000:.1f} us" if dflt is not None else "not timed") + ") "
          f"tried {run['n_tried']}/{len(cands)} ok {run['n_ok']}"
          + (f"; peak GPU memory {peak / 2**30:.2f} GiB" if peak is not None else ""), flush=True)


@functools.lru_cache(maxsize=4)
def _run_config(overrides: tuple[str, ...]):
    """The config a run with ``overrides`` composes (once per overrides); ValueError naming them on a bad one."""
    from nano_hybrid.config import ConfigError, compose

    try:
        return compose(list(overrides))
    except ConfigError as e:
        raise ValueError(f"overrides {' '.join(overrides)}: {e}") from None


def run_settings(overrides: list[str]) -> HelionSettings | None:
    """The ``kernels.helion`` settings of the run ``overrides`` describe (None without overrides: the defaults)."""
    if not overrides:
        return None
    try:
        return HelionSettings.from_mapping(_run_config(tuple(overrides)).kernels.get("helion") or {})
    except HelionSettingsError as e:
        raise ValueError(f"overrides {' '.join(overrides)}: {e}") from None


def run_fused_norm(overrides: list[str]) -> bool:
    """``model.mamba_fused_norm`` of the run ``overrides`` describe (False without overrides: the default)."""
    if not overrides:
        return False
    from nano_hybrid.model.config import model_dict

    value = model_dict(_run_config(tuple(overrides)).model)["mamba_fused_norm"]
    if not isinstance(value, bool):
        raise ValueError(f"overrides {' '.join(overrides)}: model.mamba_fused_norm={value!r} must be true or false")
    return value


def resolve_shapes(overrides: list[str], presets: str | None, model_dims: str | None) -> dict[str, dict]:
    """{shape name: model dims}: from a run's overrides (one shape, named by its shape key), else the presets
    (``--shapes``, default nano); ``model_dims`` (JSON) is what the isolated children get."""
    if model_dims:
        return json.loads(model_dims)
    if overrides:
        if presets:
            raise ValueError("give either a run's overrides or --shapes, not both")
        from nano_hybrid.config import ConfigError
        from nano_hybrid.model.config import mixer_dims

        from kernels.shapes import UnsupportedShapeError, check_supported

        try:
            dims = mixer_dims(_run_config(tuple(overrides)))
            check_supported(nheads=dims["h"], headdim=dims["p"], ngroups=dims["g"], dstate=dims["n"],
                            chunk_size=dims["c"], conv_width=dims["w"], batch=dims["b"], seqlen=dims["l"])
        except (ConfigError, UnsupportedShapeError) as e:
            raise ValueError(f"overrides {' '.join(overrides)}: {e}") from None
        return {"run_" + tuning.shape_key(**dims): dims}
    from nano_hybrid.bench.mixer import GRID, grid_model_dims

    names = [s.strip() for s in (presets or "nano").split(",") if s.strip()]
    bad = [s for s in names if s != "grid" and s not in tuner.SHAPE_PRESETS and s not in GRID]
    if bad:
        raise ValueError(f"unknown shapes {bad}; known: presets {sorted(tuner.SHAPE_PRESETS)}, "
                         f"bench_shape_grid.py shapes {sorted(GRID)}")
    # a name is a preset where it is one, else a grid shape; 'grid' is every shape of bench_shape_grid.py (the CPU
    # size excepted) with the grid's dims, also where a preset has the same name
    dims = {}
    for name in names:
        if name == "grid":
            dims.update({g: grid_model_dims(g) for g in GRID if g != "tiny"})
        elif name not in dims:
            dims[name] = dict(tuner.SHAPE_PRESETS[name]) if name in tuner.SHAPE_PRESETS else grid_model_dims(name)
    return dims


def kernels_and_shapes(ap, kernels: str | None, overrides: list[str], presets: str | None
                       ) -> tuple[list[str], dict[str, dict]]:
    """The tools' ``--kernels`` (a comma list; default every tunable kernel, sorted) and their shapes
    (``resolve_shapes`` of a run's overrides or ``--shapes``); ``ap.error`` names what is unknown."""
    registry = tuner.discover_tunable_kernels()
    names = sorted(registry) if not kernels else [k.strip() for k in kernels.split(",") if k.strip()]
    unknown = [k for k in names if k not in registry]
    if unknown:
        ap.error(f"unknown kernels {unknown}; known: {sorted(registry)}")
    try:
        return names, resolve_shapes(overrides, presets, None)
    except ValueError as e:
        ap.error(str(e))


def _run_isolated(args, pairs: list[tuple[str, str]], shapes: dict[str, dict], per_budget: float,
                  jobs: int = 1, mem_budget: int | None = None) -> int:
    """Each pair in its own process (fresh CUDA context), ``jobs`` at a time; each child writes its own JSON log and
    config file (``tuning.record`` updates a kernel's file under its lock). A child is stopped after its share of
    the budget plus ``kernels.first_use.SEARCH_MARGIN_S`` (75 s: start-up, the reference compile, one candidate's
    time limit), the margin of first-use tuning's child."""
    with tempfile.TemporaryDirectory(prefix="tune_kernels_") as tmp:
        lock = str(Path(tmp) / "gpu_timing") if jobs > 1 else None
        cmds = child_commands(args, pairs, shapes, per_budget, timing_lock=lock)
        failed = run_children(cmds, jobs, per_budget + first_use.SEARCH_MARGIN_S, mem_budget=mem_budget)
    print(f"isolated searches: {len(cmds) - len(failed)} ok" + (f", failed: {', '.join(failed)}" if failed else "")
          + (f" ({jobs} at a time)" if jobs > 1 else ""), flush=True)
    return 1 if failed else 0


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
