"""The mixer op's speed with the kernels of two ``kernels`` trees: a kernel edit against the kernels before it.

    rm -rf .baseline && mkdir -p .baseline && git archive HEAD kernels | tar -x -C .baseline
    python scripts/ab_kernel_trees.py --reference-tree .baseline --shape nano --processes 2

A tree is a folder holding a ``kernels/`` package (a snapshot as above, or another checkout: only its ``kernels/`` is
used). It must offer the kernels API this repository's ``nano_hybrid`` calls, so a tree a few commits away works and
one from before an API change does not.

One process per tree and round runs ``scripts/bench_kernels.py --backend mamba_ssm --compare helion`` with that tree's
``kernels`` first on the path (``python -P``; PYTHONPATH: a folder linking to the tree's ``kernels/``, then this
repository), every ``NANO_HELION_*`` / ``NANO_TUNE_*`` variable removed and an empty per-user config cache
(``$XDG_CACHE_HOME``), so each tree runs its own defaults and committed configs. The order alternates by pairs
(reference, current, then current, reference, ...). A process that imported ``kernels`` from elsewhere is refused.

Per tree: helion's device time per mixer fwd+bwd (torch.profiler) and its per-call median, each process's value and
their mean; the helion kernels side by side. mamba-ssm's kernels are the same in every process, so its device time
in the reference processes against the current ones is the A-vs-A control: a helion difference inside it is noise.

Writes ``ab_kernel_trees_<shape>.json`` and ``.md`` to --out (default $OUT, else runs/ab_kernel_trees in this
repository), and each process's bench_kernels JSON and log under ``--out/<tree>_<round>/``. Needs CUDA. Exit 0,
1 when a process fails or ran another tree's kernels, 2 on bad arguments or without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from nano_hybrid.bench import environment, reporting
from nano_hybrid.errors import EXIT_BAD_INPUT

TREES = ("reference", "current")
_BENCH = environment.REPO_ROOT / "scripts" / "bench_kernels.py"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage too)
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_INPUT)


def link_folder(tree: Path, where: Path) -> Path:
    """``where`` holding only a link to ``tree``'s ``kernels/``: on the path it brings that package and nothing else
    of the tree (a whole checkout's ``nano_hybrid`` stays behind)."""
    where.mkdir(parents=True, exist_ok=True)
    link = where / "kernels"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(tree / "kernels", target_is_directory=True)
    return where


def worker_env(path_dir: Path, cache_dir: Path) -> dict:
    """The environment of a process that runs the kernels linked in ``path_dir``: that folder first on PYTHONPATH,
    then this repository (for ``nano_hybrid``), then the caller's path; the per-user config cache in ``cache_dir``;
    no nano-hybrid kernel variables."""
    return dict(environment.tree_env(path_dir, environment.REPO_ROOT), XDG_CACHE_HOME=str(cache_dir))


def bench_command(shape: str, rounds: int, iters: int, out: Path) -> list[str]:
    # -P: neither the script's folder nor the working directory goes ahead of PYTHONPATH
    return [sys.executable, "-P", str(_BENCH), "--backend", "mamba_ssm", "--compare", "helion", "--shape", shape,
            "--rounds", str(rounds), "--iters", str(iters), "--out", str(out)]


def read_run(out: Path, shape: str, tree: Path) -> dict:
    """One process's bench_kernels JSON, checked to have run ``tree``'s kernels."""
    res = json.loads((out / f"kernels_mamba_ssm_vs_helion_{shape}.json").read_text())
    got = res.get("env", {}).get("kernels_dir")
    if got is None or Path(got).resolve() != (tree / "kernels").resolve():
        raise RuntimeError(f"the process for {tree} imported kernels from {got}, not from that tree")
    return res


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def summarize(runs: dict[str, list[dict]]) -> dict:
    """{tree: [bench_kernels results, one per process]} -> per tree the helion and mamba_ssm device time and per-call
    medians (each process, mean), the helion kernels side by side, and the ratios reference / current."""
    per = {}
    for tree in TREES:
        rs = runs[tree]
        dev = {arm: [r["kernels"][arm]["total_us_per_iter"] for r in rs] for arm in ("helion", "mamba_ssm")}
        call = {arm: [r["times_ms"][arm]["mixer_fwdbwd"]["median"] for r in rs] for arm in ("helion", "mamba_ssm")}
        kern: dict[str, list[float]] = {}
        for r in rs:
            for row in r["kernels"]["helion"]["rows"]:
                kern.setdefault(row["kernel"], []).append(row["us_per_iter"])
        per[tree] = {"device_us": dev, "mixer_ms": call,
                     "helion_kernels_us": {k: _mean(v) for k, v in kern.items() if len(v) == len(rs)}}

    def ratio(key: str, arm: str) -> float:
        return _mean(per["reference"][key][arm]) / _mean(per["current"][key][arm])

    ref_k, cur_k = per["reference"]["helion_kernels_us"], per["current"]["helion_kernels_us"]
    kernels = sorted(set(ref_k) | set(cur_k), key=lambda k: -max(ref_k.get(k, 0.0), cur_k.get(k, 0.0)))
    return {
        "trees": per,
        "helion_device_x": ratio("device_us", "helion"),  # > 1: the current tree is faster
        "control_mamba_ssm_device_x": ratio("device_us", "mamba_ssm"),
        "helion_per_call_x": ratio("mixer_ms", "helion"),
        "control_mamba_ssm_per_call_x": ratio("mixer_ms", "mamba_ssm"),
        "kernels": [{"kernel": k, "reference_us": ref_k.get(k), "current_us": cur_k.get(k)} for k in kernels],
    }


def markdown(res: dict) -> str:
    s, t = res["summary"], res["summary"]["trees"]
    f = lambda xs: ", ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    lines = [f"# Mixer op with two kernels trees: {res['shape']} ({res['env'].get('gpu')})", "",
             f"Reference tree `{res['reference_tree']}`, current tree `{res['current_tree']}`; {res['processes']} "
             f"processes per tree, order alternated. Command: `{res['command']}`.", "",
             "| | reference | current | reference / current |", "|---|---|---|---|"]
    for label, key, arm, r in (("helion device us per fwd+bwd", "device_us", "helion", s["helion_device_x"]),
                               ("mamba_ssm device us (control)", "device_us", "mamba_ssm", s["control_mamba_ssm_device_x"]),
                               ("helion ms per call (median)", "mixer_ms", "helion", s["helion_per_call_x"]),
                               ("mamba_ssm ms per call (control)", "mixer_ms", "mamba_ssm", s["control_mamba_ssm_per_call_x"])):
        lines.append(f"| {label} | {f(t['reference'][key][arm])} | {f(t['current'][key][arm])} | {r:.3f}x |")
    lines += ["", "| helion kernel | reference us | current us |", "|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    lines += [f"| `{k['kernel']}` | {fmt(k['reference_us'])} | {fmt(k['current_us'])} |" for k in s["kernels"]]
    return "\n".join(lines) + "\n"


def order(processes: int) -> list[tuple[int, str]]:
    """(process number, tree) in run order: the reference's first in odd pairs, the current's in even ones (ABBA)."""
    return [(i, t) for i in range(1, processes + 1) for t in (TREES if i % 2 else TREES[::-1])]


def main(argv=None) -> int:
    from nano_hybrid.bench.bench_kernels import SHAPES

    ap = _Parser(description=__doc__.split("\n")[0],
                 epilog="Exit status: 0 done, 1 a process failed or ran another tree's kernels, 2 bad arguments or no CUDA.")
    ap.add_argument("--reference-tree", default=None, help="a folder holding the reference kernels/ package (required)")
    ap.add_argument("--current-tree", default=str(environment.REPO_ROOT), help="the tree under test (default: this repository)")
    ap.add_argument("--shape", default="nano", help=f"a bench_kernels shape ({', '.join(sorted(SHAPES))})")
    ap.add_argument("--processes", type=int, default=2, help="processes per tree, order alternated (default 2)")
    ap.add_argument("--rounds", type=int, default=4, help="bench_kernels rounds per process (default 4)")
    ap.add_argument("--iters", type=int, default=8, help="bench_kernels calls per arm and round (default 8)")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else runs/ab_kernel_trees in this repository)")
    a = ap.parse_args(argv)
    try:
        reporting.check_args(a)
        if not a.reference_tree:
            raise ValueError("--reference-tree DIR is required (a folder holding a kernels/ package)")
        trees = {"reference": Path(a.reference_tree).resolve(), "current": Path(a.current_tree).resolve()}
        if a.shape not in SHAPES:
            raise ValueError(f"--shape: unknown {a.shape!r}; known: {', '.join(sorted(SHAPES))}")
        for name in ("processes", "rounds", "iters"):
            if getattr(a, name) < 1:
                raise ValueError(f"--{name} must be at least 1")
        for tree in trees.values():
            if not (tree / "kernels" / "__init__.py").is_file():
                raise ValueError(f"{tree} has no kernels/ package")
        if (trees["reference"] / "kernels").resolve() == (trees["current"] / "kernels").resolve():
            raise ValueError("the reference tree's kernels/ is the current tree's")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    import torch

    if not torch.cuda.is_available():
        print("error: ab_kernel_trees needs a CUDA GPU (bench_kernels times the op on the device)", file=sys.stderr)
        return EXIT_BAD_INPUT
    out = Path(a.out or os.environ.get("OUT") or environment.REPO_ROOT / "runs" / "ab_kernel_trees").resolve()
    runs: dict[str, list[dict]] = {t: [] for t in TREES}
    for i, name in order(a.processes):
        d, cache = out / f"{name}_{i}", out / "cache" / f"{name}_{i}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"kernels_mamba_ssm_vs_helion_{a.shape}.json").unlink(missing_ok=True)  # an earlier run's result
        shutil.rmtree(cache, ignore_errors=True)
        print(f"[{name} {i}/{a.processes}] {trees[name]}", flush=True)
        env = worker_env(link_folder(trees[name], out / "path" / name), cache)
        r = subprocess.run(bench_command(a.shape, a.rounds, a.iters, d), env=env, cwd=environment.REPO_ROOT,
                           capture_output=True, text=True)
        (d / "bench.log").write_text(r.stdout + r.stderr)
        try:
            if r.returncode != 0:
                raise RuntimeError(f"the {name} process {i} failed (rc {r.returncode}); log: {d / 'bench.log'}")
            runs[name].append(read_run(d, a.shape, trees[name]))
        except (RuntimeError, OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    res = {"tool": "scripts/ab_kernel_trees.py", "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
           "env": environment.env_info(), "shape": a.shape, "processes": a.processes, "rounds": a.rounds,
           "iters": a.iters, "reference_tree": str(trees["reference"]), "current_tree": str(trees["current"]),
           "summary": summarize(runs)}
    md = markdown(res)
    reporting.write_results(out, f"ab_kernel_trees_{a.shape}", res, md)
    print(md)
    return 0
