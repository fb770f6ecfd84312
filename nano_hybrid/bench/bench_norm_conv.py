"""Side-by-side on one GPU: mamba-ssm gated RMSNorm vs Helion, causal-conv1d CUDA vs Helion (fwd and bwd).

    python scripts/bench_norm_conv.py --rounds 5
    # conv1d only, at the Nano shape:
    OUT=/tmp/bench python scripts/bench_norm_conv.py --ops conv1d --shapes nano
    # RMSNorm with a per-call profile of each side (device time, kernels, wall time per call):
    OUT=/tmp/bench python scripts/bench_norm_conv.py --ops rmsnorm --shapes nano --profile

Shapes: kernels.tuner.SHAPE_PRESETS (nano = tuned; nano_tp2, nano_b4_l4096 use whatever config
lookup gives, i.e. nearest tuned shape, without retuning). The RMSNorm call is Megatron's:
x (b*l, h*p) bf16, z=None, group_size=h*p/g, norm_before_gate=False. The conv call is the fused
path's: x = channel-last view of the xBC slice of a (b, l, 10304) zxBCdt, width 4, bias, SiLU.
Timing: forward = the autograd op under no_grad; backward = torch.autograd.grad of a retained graph
(the same extra torch ops on both sides, e.g. the dweight partial sum). Each round times A, B, A
again (control), in alternating order; per op the median over rounds, min/max and the ratio
A/B (>1 = Helion faster) and the A/A control ratio are reported.
Correctness: each side's outputs and grads vs an fp32 torch reference from the same bf16 inputs;
tolerance (bf16): max abs error <= 2e-2 + 2e-2*|ref| for y/dx, and <= 1e-3 * max|ref| + 1e-2 for
dweight/dbias.
--profile (RMSNorm): per side and direction, torch.profiler over N calls gives the device time per call
(sum of kernel durations / N) and the kernels; the wall time per call of N back-to-back calls (between two
torch.cuda.synchronize, no L2 flush) shows whether the host keeps up (wall > device: host gaps).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import traceback
import types
from pathlib import Path

import torch

from kernels import tuning
from kernels import tuner
from kernels.causal_conv1d import causal_conv1d_ref
from kernels.causal_conv1d_helion import causal_conv1d_helion
from kernels.rmsnorm_gated import rmsnorm_gated_ref
from kernels.rmsnorm_gated_helion import rmsnorm_fn_helion
from kernels.settings import HelionSettings
from nano_hybrid.bench import profiling
from nano_hybrid.errors import EXIT_BAD_INPUT


def _errs(outs, ref, names):
    res = {}
    for n, a, r in zip(names, outs, ref):
        e = (a.float() - r.float()).abs()
        if n in ("dweight", "dbias"):
            # returned in bf16 (like mamba-ssm and causal-conv1d): rounding alone is up to 2**-9 of a value
            tol_ok = bool(e.max() <= 2**-8 * r.abs().max() + 1e-2)
        else:
            tol_ok = bool(torch.all(e <= 2e-2 + 2e-2 * r.float().abs()))
        res[n] = {"max_abs_err": float(e.detach().max()), "within_tol": tol_ok}
    return res


def _bench_pair(fa, fb, rounds, rep_ms):
    a, b, a2 = [], [], []
    for i in range(rounds):
        order = [("A", fa), ("B", fb), ("A2", fa)] if i % 2 == 0 else [("B", fb), ("A2", fa), ("A", fa)]
        for tag, f in order:
            ms = tuner.time_fn(f, rep_ms)
            {"A": a, "B": b, "A2": a2}[tag].append(ms)

    def s(x):
        return {"median_ms": statistics.median(x), "min_ms": min(x), "max_ms": max(x), "samples_ms": x}

    return {"A": s(a), "B": s(b), "A_control": s(a2),
            "speedup_B_over_A": statistics.median(a) / statistics.median(b),
            "control_ratio_A_over_A": statistics.median(a) / statistics.median(a2)}


def _grad_fn(y, ins, dy):
    return lambda: torch.autograd.grad(y, ins, dy, retain_graph=True)


def _profile_summary(table, wall_s, n_calls):
    """Per-call device time (sum of kernel durations / N), kernels (short names, us per call) and
    wall time per call of N back-to-back calls; host_gap = wall - device (>0: the GPU waited on the host)."""
    dev = table["total_us_per_iter"]
    wall = wall_s * 1e6 / n_calls
    return {"n_calls": n_calls, "device_us_per_call": dev, "wall_us_per_call": wall, "host_gap_us_per_call": wall - dev,
            "kernels": [{"kernel": r["kernel"], "us_per_call": r["us_per_iter"], "calls_per_call": r["calls_per_iter"]}
                        for r in table["rows"]]}


def profile_calls(fn, n_calls):
    """torch.profiler over ``n_calls`` calls of ``fn`` (device events), then the wall time of ``n_calls``
    back-to-back calls between two torch.cuda.synchronize (no L2 flush, no profiler). CUDA only."""
    import time

    if not torch.cuda.is_available():
        return {"skipped": "needs a CUDA GPU"}

    fn()
    torch.cuda.synchronize()
    table = profiling.profile_device_table(fn, n_calls)
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n_calls):
        fn()
    torch.cuda.synchronize()
    return _profile_summary(table, time.perf_counter() - t0, n_calls)


def bench_rmsnorm(dims, rounds, rep_ms, profile_n=0):
    from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn

    m, n = dims["b"] * dims["l"], dims["h"] * dims["p"]
    gs = n // dims["g"]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).bfloat16()
    dy = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    kw = dict(eps=1e-5, group_size=gs, norm_before_gate=False)
    fa = lambda a, b: rmsnorm_fn(a, b, None, z=None, **kw)  # noqa: E731
    fb = lambda a, b: rmsnorm_fn_helion(a, b, None, z=None, **kw)  # noqa: E731
    res = {"shape": {"rows": m, "hidden": n, "group_size": gs, "z": None, "norm_before_gate": False, "dtype": "bf16"}}
    with torch.no_grad():
        res["fwd"] = _bench_pair(lambda: fa(x, w), lambda: fb(x, w), rounds, rep_ms)
    graphs = {}
    for tag, f in (("A", fa), ("B", fb)):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = f(xi, wi)
        graphs[tag] = (y, [xi, wi])
    res["bwd"] = _bench_pair(_grad_fn(*graphs["A"], dy), _grad_fn(*graphs["B"], dy), rounds, rep_ms)
    if profile_n > 0:  # --profile: device time vs wall time per call, per side and direction
        prof = {}
        for tag, f in (("A", fa), ("B", fb)):
            with torch.no_grad():
                fwd = profile_calls(lambda f=f: f(x, w), profile_n)
            prof[tag] = {"fwd": fwd, "bwd": profile_calls(_grad_fn(*graphs[tag], dy), profile_n)}
        res["profile"] = prof
    x32, w32 = x.float().requires_grad_(), w.float().requires_grad_()
    y32 = rmsnorm_gated_ref(x32, w32, **kw)
    ref = (y32, *torch.autograd.grad(y32, [x32, w32], dy.float()))
    names = ["y", "dx", "dweight"]
    for tag in graphs:
        y, ins = graphs[tag]
        outs = (y, *torch.autograd.grad(y, ins, dy, retain_graph=True))
        res[f"correctness_{tag}"] = _errs(outs, ref, names)
    return res


def bench_conv(dims, rounds, rep_ms):
    """causal-conv1d (A) vs Helion (B), forward (no_grad) and backward, each checked against the fp32 reference."""
    from causal_conv1d import causal_conv1d_fn

    b, l, hp, gn = dims["b"], dims["l"], dims["h"] * dims["p"], dims["g"] * dims["n"]
    d = hp + 2 * gn
    width_total = 2 * hp + 2 * gn + dims["h"]
    g = torch.Generator(device="cuda").manual_seed(0)
    zx = torch.randn(b, l, width_total, device="cuda", generator=g).bfloat16()
    w = (0.5 * torch.randn(d, dims["w"], device="cuda", generator=g)).bfloat16()
    bias = (0.1 * torch.randn(d, device="cuda", generator=g)).bfloat16()
    dy = torch.randn(b, l, d, device="cuda", generator=g).bfloat16().transpose(1, 2)
    xv = zx[:, :, hp:hp + d].transpose(1, 2)
    fa = lambda a, ww, bb: causal_conv1d_fn(a, ww, bb, activation="silu")  # noqa: E731
    fb = lambda a, ww, bb: causal_conv1d_helion(a, ww, bb, activation="silu")  # noqa: E731
    res = {"shape": {"batch": b, "seqlen": l, "channels": d, "width": dims["w"], "x_layout": f"channel-last view of (b, l, {width_total})", "activation": "silu", "dtype": "bf16"}}
    with torch.no_grad():
        res["fwd"] = _bench_pair(lambda: fa(xv, w, bias), lambda: fb(xv, w, bias), rounds, rep_ms)

    def graph(f):
        zl = zx.clone().requires_grad_()
        wi, bi = w.clone().requires_grad_(), bias.clone().requires_grad_()
        return f(zl[:, :, hp:hp + d].transpose(1, 2), wi, bi), [zl, wi, bi]

    graphs = {tag: graph(fa if tag == "A" else fb) for tag in ("A", "B")}
    for tag, (y, ins) in graphs.items():  # compile every backward kernel before any timing
        _grad_fn(y, ins, dy)()
    torch.cuda.synchronize()
    res["bwd"] = _bench_pair(_grad_fn(*graphs["A"], dy), _grad_fn(*graphs["B"], dy), rounds, rep_ms)
    zl32 = zx.float().requires_grad_()
    w32, b32 = w.float().requires_grad_(), bias.float().requires_grad_()
    y32 = causal_conv1d_ref(zl32[:, :, hp:hp + d].transpose(1, 2), w32, b32, None, "silu")
    ref = (y32, *torch.autograd.grad(y32, [zl32, w32, b32], dy.float()))
    for tag, (y, ins) in graphs.items():
        outs = (y, *torch.autograd.grad(y, ins, dy, retain_graph=True))
        res[f"correctness_{tag}"] = _errs(outs, ref, ["out", "dx", "dweight", "dbias"])
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="nano,nano_tp2,nano_b4_l4096")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep-ms", type=float, default=50.0)
    ap.add_argument("--ops", default="rmsnorm,conv1d", help="which benchmarks: rmsnorm, conv1d or both")
    ap.add_argument("--profile", action="store_true",
                    help="also profile the RMSNorm fwd/bwd of both sides (torch.profiler, CUDA only): device time and "
                         "kernels per call, and wall time per call of back-to-back calls; under results.<shape>.rmsnorm.profile")
    ap.add_argument("--profile-calls", type=int, default=50, help="calls per profiled side/direction (--profile)")
    args = ap.parse_args(argv)
    if args.profile_calls < 1:
        ap.error("--profile-calls must be >= 1")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if set(ops) - {"rmsnorm", "conv1d"}:
        ap.error(f"--ops: unknown {sorted(set(ops) - {'rmsnorm', 'conv1d'})}")
    if not torch.cuda.is_available():
        print("error: bench_norm_conv.py needs a CUDA GPU", file=sys.stderr)
        return EXIT_BAD_INPUT
    sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))  # wheelhouse README
    out_dir = Path(os.environ.get("OUT", "runs/bench/h200"))
    out_dir.mkdir(parents=True, exist_ok=True)
    versions = {}
    for mod in ("torch", "triton", "helion", "mamba_ssm", "causal_conv1d"):
        try:
            versions[mod] = getattr(__import__(mod), "__version__", None)
        except Exception as e:  # noqa: BLE001
            versions[mod] = f"import failed: {e}"
    report = {
        "what": __doc__.strip().splitlines()[0],
        "method": __doc__,
        "A": {"rmsnorm": "mamba_ssm.ops.triton.layernorm_gated.rmsnorm_fn", "conv1d": "causal_conv1d.causal_conv1d_fn (CUDA)"},
        "B": {"rmsnorm": "kernels.rmsnorm_gated_helion.rmsnorm_fn_helion", "conv1d": "kernels.causal_conv1d_helion.causal_conv1d_helion"},
        "targets_h200_nano": {"rmsnorm_bwd_speedup": 3.5, "rmsnorm_fwd_speedup": 1.2, "conv1d_fwd_speedup": 1.0, "conv1d_bwd_speedup": 1.0},
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(), "arch": tuning.current_arch(), "versions": versions,
        "backend_settings": HelionSettings().as_dict(),  # the B arm runs the helion ops with the default settings
        "results": {},
    }
    path = out_dir / "bench_norm_conv.json"
    rc = 0
    for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        dims = tuner.SHAPE_PRESETS[shape]
        entry = {"model_dims": dims}
        for op, fn in (("rmsnorm", bench_rmsnorm), ("conv1d", bench_conv)):
            if op not in ops:
                continue
            try:
                entry[op] = (fn(dims, args.rounds, args.rep_ms)
                             if op == "conv1d" else fn(dims, args.rounds, args.rep_ms,
                                                       profile_n=args.profile_calls if args.profile else 0))
                r = entry[op]
                tag = ""
                print(f"{shape:14s} {op:8s} fwd {r['fwd']['A']['median_ms']*1e3:8.1f} -> {r['fwd']['B']['median_ms']*1e3:8.1f} us "
                      f"(x{r['fwd']['speedup_B_over_A']:.2f}, ctl {r['fwd']['control_ratio_A_over_A']:.2f})  "
                      f"bwd{tag} {r['bwd']['A']['median_ms']*1e3:8.1f} -> {r['bwd']['B']['median_ms']*1e3:8.1f} us "
                      f"(x{r['bwd']['speedup_B_over_A']:.2f}, ctl {r['bwd']['control_ratio_A_over_A']:.2f})  "
                      f"helion within tol: {all(v['within_tol'] for v in r['correctness_B'].values())}", flush=True)
                for side, dirs in (r.get("profile") or {}).items():
                    for dname, pr in dirs.items():
                        if "device_us_per_call" in pr:
                            print(f"{shape:14s} {op:8s} profile {side} {dname}: device {pr['device_us_per_call']:7.1f} us, "
                                  f"wall {pr['wall_us_per_call']:7.1f} us/call, kernels "
                                  + ", ".join(f"{k['kernel']} {k['us_per_call']:.1f}" for k in pr["kernels"]), flush=True)
            except Exception:  # noqa: BLE001
                entry[op] = {"error": traceback.format_exc()}
                print(entry[op]["error"], file=sys.stderr, flush=True)
                rc = 1
        report["results"][shape] = entry
        path.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {path}")
    return rc
