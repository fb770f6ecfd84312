"""Bitwise equivalence of the default helion mixer op between two ``kernels`` trees.

    python scripts/kernel_equivalence.py --reference-tree .baseline            # Nano shape, CUDA
    python scripts/kernel_equivalence.py --reference-tree DIR --shape tiny --device cpu   # HELION_INTERPRET=1

``DIR`` holds a ``kernels/`` package (e.g. a snapshot of an earlier commit's). Each tree runs in a process of its
own (``PYTHONPATH=<tree>``, every ``NANO_HELION_*`` / ``NANO_TUNE_*`` variable removed, so each tree runs its
defaults): with the same seed it builds the same inputs at the shape (``nano``: batch 2 x 8192 tokens, 64 heads
of 64, 8 groups of state 128, chunk 128, conv width 4, bf16), runs the fused op
``mamba_split_conv1d_scan_combined_helion`` and the gated RMSNorm (``RMSNormGatedHelion``, group 512,
norm_before_gate=False) forward and backward with a fixed output gradient, without and with ``seq_idx`` (documents
that end inside chunks, one shorter than the conv width), and saves every output and gradient. The current tree
(this repository's) then runs a second time as the control. Reported per case and tensor: bitwise equality and the
max abs difference, for reference vs current and for current vs current. Exit 0 when both are bitwise equal
everywhere, 1 otherwise, 2 on bad arguments.

Writes ``kernel_equivalence.json`` and ``.md`` to --out (default runs/kernel_equivalence).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from nano_hybrid.bench import environment, kernel_equivalence_worker, reporting
from nano_hybrid.bench.kernel_equivalence_worker import SHAPES
from nano_hybrid.errors import EXIT_BAD_INPUT


# ------------------------------------------------------------------------------------------------ comparison
def compare(a: dict, b: dict) -> dict:
    """{case: {tensor: {"bitwise_equal", "max_abs_diff", "shape", "dtype"}}} for two workers' ``cases``."""
    import torch

    out = {}
    for case in a:
        rows = {}
        for name, x in a[case].items():
            y = b[case].get(name)
            if y is None or y.shape != x.shape or y.dtype != x.dtype:
                rows[name] = {"bitwise_equal": False, "max_abs_diff": None, "shape": list(x.shape), "dtype": str(x.dtype),
                              "note": "missing or of another shape/dtype in the second tree"}
                continue
            diff = (x.double() - y.double()).abs()
            rows[name] = {"bitwise_equal": bool(torch.equal(x, y)), "shape": list(x.shape), "dtype": str(x.dtype),
                          "max_abs_diff": float(diff.nan_to_num(nan=float("inf")).max()) if diff.numel() else 0.0}
        out[case] = rows
    return out


def all_equal(cmp: dict) -> bool:
    return all(r["bitwise_equal"] for rows in cmp.values() for r in rows.values())


def markdown(res: dict) -> str:
    lines = [f"# Kernel equivalence: {res['shape']} shape {res['shape_dims']}, {res['device']}", "",
             f"Reference tree: `{res['reference_tree']}`; current tree: `{res['current_tree']}`. Command: "
             f"`{res['command']}`.", "",
             "| case | tensor | shape | reference = current | max abs diff | current = current (control) | max abs diff |",
             "|---|---|---|---|---|---|---|"]
    for case, rows in res["reference_vs_current"].items():
        for name, r in rows.items():
            ctl = res["control"][case][name]
            fmt = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
            lines.append(f"| {case} | {name} | {tuple(r['shape'])} | {'yes' if r['bitwise_equal'] else 'NO'} | "
                         f"{fmt(r['max_abs_diff'])} | {'yes' if ctl['bitwise_equal'] else 'NO'} | {fmt(ctl['max_abs_diff'])} |")
    lines += ["", f"Reference and current bitwise equal: {res['equal']}; control bitwise equal: {res['control_equal']}."]
    return "\n".join(lines) + "\n"


def _worker_env(tree: Path, device: str) -> dict:
    env = environment.tree_env(tree)
    if device == "cpu":
        env["HELION_INTERPRET"] = "1"
    return env


def _run_worker(tree: Path, shape: str, seed: int, device: str, out: Path) -> dict:
    import torch

    # -P: the worker's own folder stays off sys.path; the tree comes first on PYTHONPATH
    cmd = [sys.executable, "-P", str(Path(kernel_equivalence_worker.__file__).resolve()), "--shape", shape, "--seed", str(seed),
           "--device", device, "--worker-out", str(out)]
    r = subprocess.run(cmd, cwd=tree, env=_worker_env(tree, device), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"worker for {tree} failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    res = torch.load(out)
    got = Path(res["kernels_file"]).resolve()
    if tree.resolve() not in got.parents:
        raise RuntimeError(f"worker for {tree} imported kernels from {got}, not from that tree")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Exit status: 0 bitwise equal, 1 unequal, 2 bad arguments.")
    ap.add_argument("--reference-tree", help="a directory holding the reference kernels/ package")
    ap.add_argument("--current-tree", default=str(environment.REPO_ROOT), help="the tree under test (default: this repository)")
    ap.add_argument("--shape", default="nano", choices=sorted(SHAPES))
    ap.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda if available, else cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="output directory (default runs/kernel_equivalence)")
    a = ap.parse_args(argv)
    try:
        reporting.check_args(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not a.reference_tree:
        print("error: --reference-tree DIR is required (a directory holding a kernels/ package)", file=sys.stderr)
        return EXIT_BAD_INPUT
    ref, cur = Path(a.reference_tree).resolve(), Path(a.current_tree).resolve()
    for tree in (ref, cur):
        if not (tree / "kernels" / "__init__.py").is_file():
            print(f"error: {tree} has no kernels/ package", file=sys.stderr)
            return EXIT_BAD_INPUT
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA GPU is visible", file=sys.stderr)
        return EXIT_BAD_INPUT

    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for label, tree in (("reference", ref), ("current", cur), ("control", cur)):
            print(f"running the {label} tree ({tree}) ...", flush=True)
            runs[label] = _run_worker(tree, a.shape, a.seed, device, Path(tmp) / f"{label}.pt")
    res = {
        "tool": "scripts/kernel_equivalence.py", "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
        "env": environment.env_info(), "shape": a.shape, "shape_dims": dict(zip("b l h p g n c w".split(), SHAPES[a.shape])),
        "dtype": "bfloat16", "device": device, "seed": a.seed, "reference_tree": str(ref), "current_tree": str(cur),
        "reference_vs_current": compare(runs["reference"]["cases"], runs["current"]["cases"]),
        "control": compare(runs["current"]["cases"], runs["control"]["cases"]),
    }
    res["equal"], res["control_equal"] = all_equal(res["reference_vs_current"]), all_equal(res["control"])
    md = markdown(res)
    out = Path(a.out) if a.out else environment.REPO_ROOT / "runs" / "kernel_equivalence"
    jp, mp = reporting.write_results(out, "kernel_equivalence", res, md)
    print(md)
    print(f"wrote {jp} and {mp}")
    return 0 if res["equal"] and res["control_equal"] else 1
