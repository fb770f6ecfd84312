"""Helion SSD forward vs mamba-ssm, side by side in one process.

For each shape (nano, nano_tp2, nano_b4_l4096; configs tuned at nano only) and each comparison
(mamba-ssm kernel(s) vs Helion counterpart; fused Helion kernels vs the sum of what they replace;
the whole SSD forward), arms [mamba_ssm, helion, mamba_ssm#2] run in alternating order over
``--rounds`` rounds of ``--iters`` timed calls each (CUDA events); mamba_ssm#2 is the A-vs-A
control. Reports medians, p10/p90, speedup = median(mamba)/median(helion) with a bootstrap CI, and
the control's ratio. Correctness: the whole forward of both backends vs an fp32 torch reference.

    python3 scripts/bench_ssd_fwd.py [--shapes nano,...] [--rounds 5 --iters 10]

Writes ssd_fwd_bench.json and .md (GPU name, versions, shapes, date) to --out (default $OUT, else runs/bench/<gpu>).
"""

from __future__ import annotations

import argparse
import sys
import traceback
import types
from pathlib import Path

import torch

from kernels import ssd
from kernels import ssd_helion as sh
from kernels import tuner
from nano_hybrid.bench import environment, reporting, stats
from nano_hybrid.errors import EXIT_BAD_INPUT


def _mamba():
    if "selective_scan_cuda" not in sys.modules:  # mamba-ssm built without its Mamba-1 CUDA extension
        sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")
    from mamba_ssm.ops.triton import ssd_bmm, ssd_chunk_scan, ssd_chunk_state, ssd_combined, ssd_state_passing

    return types.SimpleNamespace(
        cumsum=ssd_chunk_state._chunk_cumsum_fwd, chunk_state=ssd_chunk_state._chunk_state_fwd,
        state_passing=ssd_state_passing._state_passing_fwd, bmm=ssd_bmm._bmm_chunk_fwd,
        chunk_scan=ssd_chunk_scan._chunk_scan_fwd, combined_fwd=ssd_combined._mamba_chunk_scan_combined_fwd,
    )


def _rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / (b.abs().max() + 1e-6))


def comparisons(md: dict, m) -> dict:
    """name -> (mamba_fn, helion_fn, what the helion side replaces)."""
    c = md["c"]
    t = sh.example_inputs(md, "cuda")
    x, dt, A, B, C, D, z, dtb = (t[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias"))
    b, h, p, n = md["b"], md["h"], md["p"], md["n"]
    dA, dto = m.cumsum(dt, A, c, dt_bias=dtb, dt_softplus=True)
    states = m.chunk_state(B, x, dto, dA, states_in_fp32=True)
    sin, _ = m.state_passing(states.flatten(-2), dA[..., -1], chunk_size=c, out_dtype=C.dtype)
    sin = sin.unflatten(-1, (p, n))
    CB = m.bmm(C, B, c, output_dtype=torch.float32)
    # the Helion forward's CB dtype (the inputs': bf16 here, which ssd_chunk_scan_cb16 reads)
    cbh = sh.forward_cb_dtype(x.dtype)
    CBh = CB.to(cbh)

    def m_state_and_passing():
        s = m.chunk_state(B, x, dto, dA, states_in_fp32=True)
        return m.state_passing(s.flatten(-2), dA[..., -1], chunk_size=c, out_dtype=C.dtype)

    return {
        "chunk_cumsum": (lambda: m.cumsum(dt, A, c, dt_bias=dtb, dt_softplus=True),
                         lambda: sh.ssd_chunk_cumsum_helion(dt, A, c, dt_bias=dtb, dt_softplus=True), "_chunk_cumsum_fwd"),
        "chunk_state": (lambda: m.chunk_state(B, x, dto, dA, states_in_fp32=True),
                        lambda: sh.ssd_chunk_state_helion(B, x, dto, dA), "_chunk_state_fwd"),
        "state_passing": (lambda: m.state_passing(states.flatten(-2), dA[..., -1], chunk_size=c, out_dtype=C.dtype),
                          lambda: sh.ssd_state_passing_helion(states, dA[..., -1], chunk_size=c, state_dtype=C.dtype),
                          "_state_passing_fwd"),
        "chunk_state+state_passing (fused)": (m_state_and_passing,
                                              lambda: sh.ssd_chunk_state_passing_helion(B, x, dto, dA),
                                              "_chunk_state_fwd + _state_passing_fwd"),
        "bmm_chunk": (lambda: m.bmm(C, B, c, output_dtype=torch.float32),
                      lambda: sh.ssd_bmm_chunk_helion(C, B, c, cb_dtype=cbh), "_bmm_chunk_fwd"),
        "chunk_scan": (lambda: m.chunk_scan(CB, x, dto, dA, C, sin, D=D, z=z),
                       lambda: sh.ssd_chunk_scan_helion(CBh, x, dto, dA, C, sin, D=D, z=z), "_chunk_scan_fwd"),
        "ssd_forward (whole)": (lambda: m.combined_fwd(x, dt, A, B, C, c, D=D, z=z, dt_bias=dtb, dt_softplus=True),
                                lambda: sh.ssd_forward_helion(x, dt, A, B, C, c, D=D, z=z, dt_bias=dtb, dt_softplus=True),
                                "_mamba_chunk_scan_combined_fwd (5 kernels)"),
    }


def correctness(md: dict, m) -> dict:
    c = md["c"]
    t = sh.example_inputs(md, "cuda", seed=1)
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"], c)
    kw = dict(D=t["D"], z=t["z"], dt_bias=t["dt_bias"], dt_softplus=True)
    ref = ssd.ssd_forward_ref(*(a.float() if torch.is_tensor(a) else a for a in args), **{
        k: (v.float() if torch.is_tensor(v) else v) for k, v in kw.items()})
    hel = sh.ssd_forward_helion(*args, **kw)
    mam = m.combined_fwd(*args, **kw)
    names = ["out", "out_x", "dt_out", "dA_cumsum", "states_in", "final_states"]
    res = {}
    for i, nm in enumerate(names):
        res[nm] = {"helion_vs_fp32": _rel_err(hel[i], ref[i]), "mamba_vs_fp32": _rel_err(mam[i], ref[i]),
                   "helion_vs_mamba": _rel_err(hel[i], mam[i])}
    del ref
    return res


def bench_shape(name: str, md: dict, m, rounds: int, iters: int) -> dict:
    out = {"dims": md, "comparisons": {}, "errors": {}}
    try:
        out["correctness_rel_max_err"] = correctness(md, m)
    except Exception:  # noqa: BLE001 - recorded, the timings still run
        out["errors"]["correctness"] = traceback.format_exc()
    torch.cuda.empty_cache()
    comps = comparisons(md, m)
    for cname, (fm, fh, replaces) in comps.items():
        try:
            arms = {"mamba_ssm": fm, "helion": fh, "mamba_ssm#2": fm}
            for f in arms.values():  # warm-up: compile / autotune outside the timings
                f()
                f()
            torch.cuda.synchronize()
            labels = list(arms)
            samples = {k: [] for k in labels}
            for order in stats.alternating_order(len(labels), rounds):
                for i in order:
                    samples[labels[i]] += stats.time_calls(arms[labels[i]], iters, "cuda")
            r = {"replaces": replaces, "ms": {k: stats.summarize(v) for k, v in samples.items()}}
            r["speedup_helion_vs_mamba"] = stats.ratio_summary(samples["mamba_ssm"], samples["helion"])
            r["control_mamba_vs_mamba"] = stats.ratio_summary(samples["mamba_ssm"], samples["mamba_ssm#2"])
            out["comparisons"][cname] = r
            print(f"[{name}] {cname:36s} mamba {r['ms']['mamba_ssm']['median']*1e3:8.1f} us  helion "
                  f"{r['ms']['helion']['median']*1e3:8.1f} us  speedup {r['speedup_helion_vs_mamba']['speedup']:.2f}x "
                  f"(control {r['control_mamba_vs_mamba']['speedup']:.3f})", flush=True)
        except Exception:  # noqa: BLE001
            out["errors"][cname] = traceback.format_exc()
            print(f"[{name}] {cname} FAILED\n{out['errors'][cname]}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="nano,nano_tp2,nano_b4_l4096")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None, help="output dir (default $OUT or runs/bench/<gpu>)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_ssd_fwd.py needs a CUDA GPU", file=sys.stderr)
        return EXIT_BAD_INPUT
    m = _mamba()
    env = environment.env_info()
    from kernels.settings import HelionSettings

    # the forward pieces run as ssd_helion's functions; none of the backend's settings changes a forward kernel
    results = {"env": env, "backend_settings": {"backend": "helion", **HelionSettings().as_dict()},
               "method": "alternating rounds, CUDA events per call, A-vs-A control, bootstrap CI",
               "rounds": args.rounds, "iters": args.iters, "shapes": {}}
    for s in args.shapes.split(","):
        md = tuner.SHAPE_PRESETS[s]
        print(f"=== shape {s}: {md}", flush=True)
        results["shapes"][s] = bench_shape(s, md, m, args.rounds, args.iters)
        torch.cuda.empty_cache()
    rows = []
    for s, r in results["shapes"].items():
        for cname, cr in r["comparisons"].items():
            sp = cr["speedup_helion_vs_mamba"]
            rows.append([s, cname, cr["ms"]["mamba_ssm"]["median"] * 1e3, cr["ms"]["helion"]["median"] * 1e3,
                         f"{sp['speedup']:.2f} [{sp['ci_lo']:.2f}, {sp['ci_hi']:.2f}]",
                         f"{cr['control_mamba_vs_mamba']['speedup']:.3f}"])
    md_txt = "# SSD forward: Helion vs mamba-ssm\n\n" + reporting.env_markdown(env) + "\n\n" + reporting.md_table(
        ["shape", "kernel", "mamba-ssm us", "helion us", "speedup [95% CI]", "A-vs-A"], rows)
    for s, r in results["shapes"].items():
        if "correctness_rel_max_err" in r:
            md_txt += f"\n\nCorrectness {s} (max abs err / max |ref|):\n\n" + reporting.md_table(
                ["tensor", "helion vs fp32", "mamba vs fp32", "helion vs mamba"],
                [[k, v["helion_vs_fp32"], v["mamba_vs_fp32"], v["helion_vs_mamba"]] for k, v in r["correctness_rel_max_err"].items()])
        for k, e in r["errors"].items():
            md_txt += f"\n\nERROR {s} {k}:\n```\n{e[-1500:]}\n```"
    out_dir = Path(args.out) if args.out else reporting.default_out_dir()
    jp, mp = reporting.write_results(out_dir, "ssd_fwd_bench", results, md_txt)
    print(md_txt)
    print(f"wrote {jp} and {mp}")
    return 1 if any(r["errors"] for r in results["shapes"].values()) else 0
