"""The whole SSD forward against the strongest open peer: mamba-ssm, helion and the fused "fused5" kernel.

The peer is the single-kernel SSD forward of the public fork RishiAstra/mamba
(``mamba_ssm/ops/triton/ssd_fused5.py``, selected there with ``mamba2_fusion_type``). Its source stays out of
this repository: pass the file with ``--peer-file`` (it imports ``mamba_ssm.ops.triton.softplus`` from the installed
mamba-ssm). The peer runs at both of its precisions: ``medium`` (16-bit states and C·Bᵀ, the fast setting) and
``high`` (fp32 intermediates).

For each shape, the arms [mamba_ssm, helion, peer_medium, peer_high, mamba_ssm#2] run in alternating order over
``--rounds`` rounds of ``--iters`` calls (CUDA events per call); mamba_ssm#2 is the A-vs-A control. Speedups are
median ratios against mamba_ssm with a bootstrap CI; device time per call comes from one profiled round per arm.
Correctness: every arm's output against the fp32 PyTorch reference (``kernels.ssd``), as max-abs / max-ref.

    python scripts/bench_ssd_peer.py --peer-file .peer/ssd_fused5.py [--shapes nano,tp2,l4096b4,l16384b1]

Writes ``ssd_peer_<shapes>.json`` and ``.md`` to --out (default runs/bench/<gpu>).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
import types
from pathlib import Path

import torch

from nano_hybrid.bench import environment, profiling, reporting, stats
from nano_hybrid.errors import ConfigError


# Nano Mamba-2 mixer shapes (chunk 128, headdim 64, d_state 128); tp2 = the per-rank shape at TP=2
SHAPES = {
    "nano": dict(b=2, l=8192, h=64, p=64, g=8, n=128),
    "tp2": dict(b=2, l=8192, h=32, p=64, g=4, n=128),
    "l4096b4": dict(b=4, l=4096, h=64, p=64, g=8, n=128),
    "l16384b1": dict(b=1, l=16384, h=64, p=64, g=8, n=128),
}
CHUNK = 128


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer-file", required=True, help="path to the fork's ssd_fused5.py")
    p.add_argument("--shapes", default="nano,tp2,l4096b4,l16384b1", help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"],
                   help="input dtype of every arm (the peer's medium precision compiles for fp16 only)")
    p.add_argument("--out", default=None, help="output dir (default $OUT or runs/bench/<gpu>)")
    args = p.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in args.shapes if s not in SHAPES]
    if bad:
        p.error(f"unknown shape(s) {bad}; known: {sorted(SHAPES)}")
    if not Path(args.peer_file).is_file():
        p.error(f"--peer-file {args.peer_file}: no such file")
    return args


def load_peer(path: str | Path):
    """The fork's module, loaded under its own name beside the installed mamba-ssm."""
    if "selective_scan_cuda" not in sys.modules:  # mamba-ssm built without its Mamba-1 CUDA extension
        sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")
    spec = importlib.util.spec_from_file_location("peer_ssd_fused5", str(path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def inputs(shape: dict, device="cuda", dtype=torch.bfloat16, seed=0) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)
    b, l, h, p, ng, n = (shape[k] for k in ("b", "l", "h", "p", "g", "n"))

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(device)

    return dict(
        x=r(b, l, h, p).to(dtype), dt=r(b, l, h, scale=0.5).to(dtype), A=-torch.rand(h, generator=g).add(0.5).to(device),
        B=r(b, l, ng, n, scale=0.3).to(dtype), C=r(b, l, ng, n, scale=0.3).to(dtype), D=r(h), dt_bias=r(h, scale=0.5),
    )


def arms(peer) -> dict:
    if "selective_scan_cuda" not in sys.modules:
        sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")
    from mamba_ssm.ops.triton.ssd_combined import _mamba_chunk_scan_combined_fwd

    from kernels.registry import get_backend

    helion = get_backend("helion").mamba_chunk_scan_combined

    def mamba(t):
        return _mamba_chunk_scan_combined_fwd(t["x"], t["dt"], t["A"], t["B"], t["C"], CHUNK, D=t["D"],
                                              dt_bias=t["dt_bias"], dt_softplus=True)[0]

    def hel(t):
        return helion(t["x"], t["dt"], t["A"], t["B"], t["C"], CHUNK, D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True)

    def fused5(precision):
        fp32 = precision == "high"

        def run(t):
            return peer._fused5_ssd(t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], chunk_size=CHUNK,
                                    dt_bias=t["dt_bias"], dt_softplus=True, states_in_fp32=fp32,
                                    cb_store_fp32=fp32, cb_scale_fp32=fp32, cs_acc_fp32=fp32, cb_comp_fp32=True)[0]
        return run

    return {"mamba_ssm": mamba, "helion": hel, "peer_medium": fused5("medium"), "peer_high": fused5("high"),
            "mamba_ssm#2": mamba}


def reference(t: dict) -> torch.Tensor:
    from kernels.ssd import mamba_chunk_scan_combined_ref

    f = {k: v.float() for k, v in t.items()}
    return mamba_chunk_scan_combined_ref(f["x"], f["dt"], f["A"], f["B"], f["C"], CHUNK, D=f["D"],
                                         dt_bias=f["dt_bias"], dt_softplus=True)


def run(args) -> dict:
    if not torch.cuda.is_available():
        raise ConfigError("bench_ssd_peer.py needs a CUDA GPU")
    peer = load_peer(args.peer_file)
    fns = arms(peer)
    res = {"env": environment.env_info(), "args": vars(args), "chunk_size": CHUNK, "arms": list(fns), "shapes": {}}
    for sname in args.shapes:
        t = inputs(SHAPES[sname], dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype])
        failed = {}
        with torch.no_grad():
            ref = reference(t)
            errs = {}
            for a in list(fns)[:-1]:
                try:
                    out = fns[a](t)
                except Exception as e:  # an arm that cannot run this dtype/shape is reported, not timed
                    failed[a] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
                    print(f"[{sname}] {a} failed: {failed[a]}", flush=True)
                    continue
                errs[a] = float((out.float() - ref).abs().max() / ref.abs().max())
                del out
            del ref
            torch.cuda.empty_cache()
            names = [a for a in fns if a not in failed]
            times = stats.time_arms({a: functools.partial(fns[a], t) for a in names}, warmup=args.warmup,
                                    rounds=args.rounds, iters=args.iters, device="cuda")
            device_us = {}
            for a in names[:-1]:
                table = profiling.profile_device_table(lambda: fns[a](t), args.iters)
                device_us[a] = table.get("total_us_per_iter")
        base = times["mamba_ssm"]
        res["shapes"][sname] = {
            "shape": SHAPES[sname],
            "times_ms": {a: stats.summarize(v) for a, v in times.items()},
            "speedup_vs_mamba_ssm": {a: stats.ratio_summary(base, times[a]) for a in names[1:]},
            "device_us_per_call": device_us,
            "max_err_vs_fp32_ref": errs,
            "arms": names,
            "failed": failed,
        }
        print(f"[{sname}] " + ", ".join(f"{a} {stats.median(times[a]):.3f} ms" for a in names), flush=True)
    return res


def markdown(res: dict) -> str:
    lines = [f"# SSD forward: mamba-ssm, helion and the fused peer (chunk {res['chunk_size']}, {res['args']['dtype']})", "",
             reporting.env_markdown(res["env"]), ""]
    for sname, r in res["shapes"].items():
        s = r["shape"]
        lines += [f"## {sname}: batch {s['b']}, seqlen {s['l']}, heads {s['h']} x {s['p']}, groups {s['g']}, "
                  f"d_state {s['n']}", ""]
        rows = []
        for a in r["arms"]:
            rows.append([a, *reporting.timing_cells(r, a),
                         f"{r['max_err_vs_fp32_ref'][a]:.2e}" if a in r["max_err_vs_fp32_ref"] else "-"])
        lines += [reporting.md_table(["arm", "median ms", "p10-p90", "device us", "vs mamba_ssm [95% CI]",
                               "max err / max ref (fp32 ref)"], rows), ""]
        lines += [f"- {a} does not run here: {why}" for a, why in r.get("failed", {}).items()] + [""]
    return "\n".join(lines)


def main(argv=None) -> int:
    return reporting.bench_main(argv, parse_args, run, lambda res, a: f"ssd_peer_{a.dtype}_" + "_".join(a.shapes), markdown)
