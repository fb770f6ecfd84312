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
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from nano_hybrid.bench import environment, reporting

REPO = Path(__file__).resolve().parent.parent
# (b, l, h, p, g, n, c, conv width); "nano" is Nemotron-3 Nano's mixer at micro-batch 2, sequence 8192
SHAPES = {
    "nano": (2, 8192, 64, 64, 8, 128, 128, 4),
    "tiny": (2, 80, 4, 16, 2, 16, 32, 4),
}
CASES = ("no_seq_idx", "seq_idx")


# ----------------------------------------------------------------------------------------------------- worker
def _inputs(shape: tuple, seed: int, device: str):
    """Fixed inputs (CPU generator, then moved): the fused op's arguments, the norm weight and the output grads."""
    import math

    import torch

    b, l, h, p, g, n, c, w = shape
    dim = h * p
    conv_dim = dim + 2 * g * n
    gen = torch.Generator().manual_seed(seed)

    def rn(*s, scale=1.0):
        return torch.randn(*s, generator=gen) * scale

    bf = torch.bfloat16
    t = dict(
        zxbcdt=rn(b, l, 2 * dim + 2 * g * n + h).to(bf),
        conv1d_weight=rn(conv_dim, w, scale=0.5).to(bf),
        conv1d_bias=rn(conv_dim, scale=0.1).to(bf),
        dt_bias=torch.rand(h, generator=gen) * 2 - 4,
        A=-torch.exp(torch.rand(h, generator=gen) * math.log(16.0)),
        D=torch.ones(h) + rn(h, scale=0.1),
        norm_weight=(1 + rn(dim, scale=0.1)).to(bf),
    )
    dy = rn(b, l, dim).to(bf)
    # documents of several lengths, ending inside chunks, one of 2 tokens (below the conv width)
    cuts = sorted({min(l - 1, max(1, round(l * f))) for f in (0.13, 0.4, 0.4 + 2 / l, 0.77)})
    seq = torch.zeros(b, l, dtype=torch.int32)
    for i, cut in enumerate(cuts):
        seq[:, cut:] = i + 1
    seq[1] = seq[1].flip(0).max() - seq[1].flip(0)  # the second row: the same documents in reverse order
    return {k: v.to(device) for k, v in t.items()}, dy.to(device), seq.to(device)


def run_tree(shape_name: str, seed: int, device: str, out_path: str) -> None:
    """Worker: the fused op + gated norm forward and backward of the ``kernels`` package on sys.path."""
    import torch

    import kernels
    from kernels.mamba_split_helion import mamba_split_conv1d_scan_combined_helion
    from kernels.rmsnorm_gated import RMSNormGatedHelion

    shape = SHAPES[shape_name]
    b, l, h, p, g, n, c, w = shape
    res = {"kernels_file": kernels.__file__, "cases": {}}
    for case in CASES:
        t, dy, seq = _inputs(shape, seed, device)
        leaves = {k: v.detach().requires_grad_(True) for k, v in t.items()}
        norm = RMSNormGatedHelion(h * p, eps=1e-5, group_size=h * p // g, norm_before_gate=False,
                                  device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(leaves["norm_weight"])
        y = mamba_split_conv1d_scan_combined_helion(
            leaves["zxbcdt"], leaves["conv1d_weight"], leaves["conv1d_bias"], leaves["dt_bias"], leaves["A"],
            leaves["D"], c, seq_idx=seq if case == "seq_idx" else None, activation="silu", headdim=p, ngroups=g,
            norm_before_gate=False)
        out = norm(y)
        names = ["zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D"]
        grads = torch.autograd.grad(out, [leaves[k] for k in names] + [norm.weight], dy)
        tensors = {"mixer_out": y, "norm_out": out}
        tensors.update({f"grad_{k}": gk for k, gk in zip(names + ["norm_weight"], grads)})
        res["cases"][case] = {k: v.detach().cpu() for k, v in tensors.items()}
        del t, leaves, y, out, grads, tensors
    torch.save(res, out_path)


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
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NANO_HELION_", "NANO_TUNE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(tree)] + [q for q in os.environ.get("PYTHONPATH", "").split(os.pathsep) if q])
    if device == "cpu":
        env["HELION_INTERPRET"] = "1"
    return env


def _run_worker(tree: Path, shape: str, seed: int, device: str, out: Path) -> dict:
    import torch

    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--shape", shape, "--seed", str(seed),
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
    ap.add_argument("--current-tree", default=str(REPO), help="the tree under test (default: this repository)")
    ap.add_argument("--shape", default="nano", choices=sorted(SHAPES))
    ap.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda if available, else cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="output directory (default runs/kernel_equivalence)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        run_tree(a.shape, a.seed, a.device, a.worker_out)
        return 0
    if not a.reference_tree:
        print("error: --reference-tree DIR is required (a directory holding a kernels/ package)", file=sys.stderr)
        return 2
    ref, cur = Path(a.reference_tree).resolve(), Path(a.current_tree).resolve()
    for tree in (ref, cur):
        if not (tree / "kernels" / "__init__.py").is_file():
            print(f"error: {tree} has no kernels/ package", file=sys.stderr)
            return 2
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA GPU is visible", file=sys.stderr)
        return 2

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
