"""Kernel searches in isolated child processes (``scripts/tune_kernels.py --no-isolate``), several at a time: what
``scripts/tune_kernels.py`` runs for each (kernel, shape) pair, and what a training run with
``kernels.helion.autotune`` runs before its first step (``pretune``).

    todo = missing_pairs(registry, names, shapes, root)          # (kernel, shape) pairs without an exact config
    failed = run_children(child_commands(args, todo, shapes, budget), jobs=8, timeout_s=...)
    failed = pretune(dims, settings, say)                          # the training run's step before its first

Children running at once share a timing lock (their compiles overlap, their timings take turns on the GPU), and
their searches' estimated GPU memory (``kernels.tuner.search_bytes``) stays within the GPU's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from kernels import first_use, tuner, tuning
from kernels.registry import helion_training_kernels

TUNE_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tune_kernels.py"


def pairs_of(names: list[str], shape_dims: Mapping[str, dict], registry: dict | None = None) -> list[tuple[str, str]]:
    """Every ``(kernel, shape)`` pair of ``names`` x ``shape_dims``, shape by shape; with ``registry`` (the tunable
    kernels) a pair whose kernel dims an earlier pair has is left out: one search per config entry (e.g. a packed
    shape's SSD kernels, whose configs do not depend on seq_idx, beside the same shape without packing)."""
    pairs, seen = [], set()
    for shape in shape_dims:
        for name in names:
            if registry is not None:
                key = (name, tuning.shape_key(**registry[name][1].dims(dict(shape_dims[shape]))))
                if key in seen:
                    continue
                seen.add(key)
            pairs.append((name, shape))
    return pairs


def missing_pairs(registry: dict, names: list[str], shape_dims: dict[str, dict], root: Path | None,
                  arch: str | None = None) -> list[tuple[str, str]]:
    """The ``(kernel, shape)`` pairs of ``names`` x ``shape_dims`` (shape by shape) without an exact config for
    ``arch`` (default: this GPU's) in the committed configs, nor under ``root`` when given (a user cache); the kernel
    dims come from each kernel's ``TunableKernel.dims`` at that shape (no case is built: nothing is allocated or run)."""
    roots = [None] if root is None else [None, root]
    missing = []
    for name, shape in pairs_of(names, shape_dims, registry):
        dims = registry[name][1].dims(dict(shape_dims[shape]))
        if all(tuning.lookup(name, dims, arch=arch, root=r)[0] != "exact" for r in roots):
            missing.append((name, shape))
    return missing


def missing_kernels(registry: dict, names: list[str], shape_dims: dict[str, dict], root: Path | None,
                    arch: str | None = None) -> list[str]:
    """The kernels of ``names`` (in that order) with at least one of ``missing_pairs``."""
    missing = {name for name, _ in missing_pairs(registry, names, shape_dims, root, arch=arch)}
    return [name for name in names if name in missing]


# seconds a child spends outside its search (imports, CUDA start, building the case): taken off each pair's
# share so that an isolated run keeps to the total budget
ISOLATE_OVERHEAD_S = 15.0


def child_commands(args, pairs: list[tuple[str, str]], shape_dims: Mapping[str, dict], per_budget: float,
                   timing_lock: str | None = None) -> list[list[str]]:
    """One ``tune_kernels.py --no-isolate`` command per ``(kernel, shape)`` pair (``shape`` names its dims in
    ``shape_dims``), each with that pair's budget less the child's start-up time (and ``timing_lock``, the lock file
    that children running at once share)."""
    per_budget = max(10.0, per_budget - ISOLATE_OVERHEAD_S)
    cmds = []
    for name, shape in pairs:
        cmd = [sys.executable, str(TUNE_SCRIPT), "--kernels", name,
               "--model-dims", json.dumps({shape: shape_dims[shape]}),
               "--budget-s", f"{per_budget:.1f}", "--rep-ms", str(args.rep_ms), "--no-isolate"]
        cmd += ["--out-root", args.out_root] if getattr(args, "out_root", None) else []
        cmd += ["--no-write"] if args.no_write else []
        cmd += ["--from-scratch"] if args.from_scratch else []
        cmd += ["--timing-lock", timing_lock] if timing_lock else []
        cmds.append(cmd)
    return cmds


def _pair(cmd: list[str]) -> str:
    """"<kernel> @ <shape>" of a child command (the command itself for another one)."""
    if "--kernels" not in cmd:
        return " ".join(cmd)
    return f"{cmd[cmd.index('--kernels') + 1]} @ {next(iter(json.loads(cmd[cmd.index('--model-dims') + 1])))}"


# the share of the GPU's memory that searches running at once may hold (the rest: CUDA contexts, the allocators'
# slack, other processes)
GPU_MEMORY_SHARE = 0.85


def gpu_memory_budget() -> int | None:
    """Bytes of GPU memory that searches running at once may hold: ``GPU_MEMORY_SHARE`` of this GPU's memory, less
    what this process or others already hold beyond the rest (at least 1: then one search at a time); None without
    a CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return max(1, int(min(GPU_MEMORY_SHARE * total, free - (1.0 - GPU_MEMORY_SHARE) * total)))


def admission_rounds(sizes: list[int], jobs: int, budget: int | None) -> int:
    """How many rounds ``run_children`` takes for children of GPU memory ``sizes`` (``child_bytes``), at most
    ``jobs`` and ``budget`` bytes at once, when every child takes the same time: what a total time budget is divided
    by."""
    pending, rounds = list(sizes), 0
    while pending:
        used, n, rest = 0, 0, []
        for size in pending:
            if n < jobs and (n == 0 or not budget or used + size <= budget):
                used, n = used + size, n + 1
            else:
                rest.append(size)
        pending, rounds = rest, rounds + 1
    return rounds


def searches_at_once(size: int, jobs: int, budget: int | None) -> int:
    """How many searches of ``size`` bytes (``kernels.tuner.search_bytes``) run at once: ``jobs``, or fewer where
    ``budget`` bytes (``gpu_memory_budget``; None or 0: no limit) hold fewer; at least 1."""
    return jobs if not budget else max(1, min(jobs, budget // max(size, 1)))


def child_bytes(cmd: list[str]) -> int:
    """The GPU memory a ``tune_kernels.py`` child command's search may hold (``kernels.tuner.search_bytes`` at the
    dims of its ``--model-dims``); 0 for another command."""
    if "--model-dims" not in cmd:
        return 0
    return max(tuner.search_bytes(d) for d in json.loads(cmd[cmd.index("--model-dims") + 1]).values())


def run_children(cmds: list[list[str]], jobs: int, timeout_s: float, poll_s: float = 0.2,
                 log_dir: Path | None = None, say=lambda msg: print(msg, flush=True),
                 mem_budget: int | None = None) -> list[str]:
    """Run ``cmds`` (``tune_kernels.py`` children), at most ``jobs`` at once and at most ``mem_budget`` bytes of
    searches at once (``child_bytes``; default ``gpu_memory_budget()``; 0: no limit), each killed after
    ``timeout_s``; a child larger than the whole budget runs alone. The next child to start is the first waiting one
    that fits. Returns "<kernel> @ <shape> (exit <rc>|timeout)" for every child that did not exit 0. With ``log_dir``
    each child's output goes to ``<log_dir>/<n>.log`` (named in its failure) and its JSON log there too (``$OUT``)."""
    def pair(cmd):
        return _pair(cmd) + (f"; log {logs[id(cmd)]}" if id(cmd) in logs else "")

    def start(n, cmd):
        if log_dir is None:
            return subprocess.Popen(cmd)
        logs[id(cmd)] = log_dir / f"{n}.log"
        with open(logs[id(cmd)], "w") as f:
            return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, OUT=str(log_dir)))

    def next_fitting():
        used = sum(b for *_, b in running)
        for i, (_, cmd) in enumerate(pending):
            if not running or not budget or used + sizes[id(cmd)] <= budget:
                return pending.pop(i)
        return None

    budget = gpu_memory_budget() if mem_budget is None else mem_budget
    sizes = {id(cmd): child_bytes(cmd) for cmd in cmds}
    held = sorted({_pair(cmd).split(" @ ")[-1]: sizes[id(cmd)] for cmd in cmds
                   if budget and sizes[id(cmd)] * min(jobs, len(cmds)) > budget}.items())
    for shape, size in held:
        say(f"   searches at {shape} hold up to {size / 2**30:.1f} GiB each: "
            f"{searches_at_once(size, jobs, budget)} at a time within {budget / 2**30:.0f} GiB of GPU memory")
    logs: dict[int, Path] = {}
    pending, running, failed = list(enumerate(cmds)), [], []
    while pending or running:
        while pending and len(running) < jobs and (nxt := next_fitting()) is not None:
            n, cmd = nxt
            running.append((cmd, start(n, cmd), time.monotonic(), sizes[id(cmd)]))
        time.sleep(poll_s)
        for item in list(running):
            cmd, proc, t0, _ = item
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


def pretune(dims: Mapping[str, int], settings, say=lambda msg: print(msg, flush=True),
            fused_norm: bool = False) -> list[str]:
    """``kernels.helion.autotune`` before a run's first step: tune every kernel a training step calls
    with ``settings`` and ``fused_norm`` (``model.mamba_fused_norm``; ``kernels.registry.helion_training_kernels``) that has no exact config (committed, or in the user cache) at the
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
        names = missing_kernels(registry, sorted(helion_training_kernels(settings, fused_norm)), {key: dict(dims)},
                                root)
        if not names:
            return []
        jobs = min(settings.autotune_jobs, len(names))
        size, budget = tuner.search_bytes(dims), gpu_memory_budget()
        at_once = searches_at_once(size, jobs, budget)
        rounds = admission_rounds([size] * len(names), jobs, budget)
        say(f"nano_hybrid kernels: tuning {len(names)} kernels without a config at {key} on this GPU, {at_once} at a "
            f"time, {settings.autotune_budget_s:.0f} s each (about {rounds * (settings.autotune_budget_s + 40):.0f} s;"
            f" kernels.helion.autotune); winners go to {root / arch}")
        log_dir = root / arch / "pretune_logs" / f"{key}_{dt.datetime.now().strftime('%Y%m%d_%H%M%S')}"
        log_dir.mkdir(parents=True, exist_ok=True)
        ns = argparse.Namespace(rep_ms=40.0, no_write=False, from_scratch=False, out_root=str(root))
        t0 = time.monotonic()
        cmds = child_commands(ns, pairs_of(names, {key: dims}), {key: dict(dims)},
                              settings.autotune_budget_s + ISOLATE_OVERHEAD_S,
                              timing_lock=str(log_dir / "gpu_timing") if jobs > 1 else None)
        failed = run_children(cmds, jobs, settings.autotune_budget_s + ISOLATE_OVERHEAD_S + first_use.SEARCH_MARGIN_S,
                              log_dir=log_dir, say=say)
        say(f"nano_hybrid kernels: tuned {len(names) - len(failed)} of {len(names)} kernels at {key} in "
            f"{time.monotonic() - t0:.0f} s" + (f"; failed (searched again at their first call): {', '.join(failed)}"
                                                 if failed else ""))
    return failed
