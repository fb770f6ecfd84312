"""The Mamba-2 split-conv1d-scan op (forward + backward) on a grid of model shapes, helion against mamba_ssm.

    python scripts/bench_shape_grid.py                         # every shape of GRID (one process, ~10 min on an H200)
    python scripts/bench_shape_grid.py --quick                 # 4 shapes, fewer rounds
    python scripts/bench_shape_grid.py --shapes nano_tp1,m2_2p7b_c256 --kernels-helion autotune=true

Per shape, in one process: both backends on the same bf16 inputs (``mixer.make_params``; Megatron's init
ranges), and the fp32 mamba-ssm op on the same values as the reference. Each op gets zxbcdt as Megatron's mixer
hands it over (``mixer.op_zxbcdt``): a (b, l, d) view of (l, b, d) memory, as Megatron's in_proj produces it, or a
contiguous copy of it for a backend without ``strided_zxbcdt``; ``--zxbcdt-layout contiguous`` stores zxbcdt as a
contiguous (b, l, d) tensor instead. Reported per shape:
- speed per call: median wall time of one fwd+bwd call, CUDA events, ABBA rounds (``stats.time_calls``), and
  the speedup median(mamba_ssm)/median(helion);
- device time: the summed kernel time per call from torch.profiler (``profiling.profile_device_table``), and each
  backend's largest kernels (``device_kernels``);
- errors: relative L2 of the output and every gradient against fp32 mamba-ssm, for helion bf16 and, next to it,
  mamba-ssm's own bf16 (the error a correct bf16 kernel has);
- the chunk-state path the helion backend took (``kernels.helion.state_passing``: "fused" or "split");
- the kernels' config notices (nearest shape / default / tuned, from ``kernels.first_use.select_config``) and the
  first-call time (compile + selection + any first-use tuning). With ``--kernels-helion autotune=true`` a shape
  first has its missing kernels tuned several at a time (``nano_hybrid.kernel_search.pretune``, as a
  training run does; ``pretune_s`` and ``pretune_failed`` in its record).
A shape that raises is recorded with its error and the next shape still runs. Writes ``shape_grid.json`` and
``.md`` to $OUT (default runs/bench/<gpu>).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path

from kernels.settings import STATE_PASSING_NOTICE
from nano_hybrid.bench import environment, profiling, reporting, stats
from nano_hybrid.bench.mixer import (GRID, MixerShape, add_zxbcdt_layout_arg, grad_of, grid_model_dims, make_params,
                                     op_zxbcdt, rel_err, state_passing_taken, zxbcdt_leaf, zxbcdt_leaf_name)
from nano_hybrid.errors import EXIT_BAD_INPUT


QUICK = ("nano_tp1", "nano_b8_l2048", "m2_2p7b_c256", "nemh_8b")
GRADS = ("zxbcdt", "conv_w", "conv_b", "dt_bias", "A_log", "D")
DEVICE_KERNELS_KEPT = 10  # kernels per backend kept in a shape's record, largest first


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None, help=f"comma list of {', '.join(GRID)} (default: all but tiny)")
    p.add_argument("--quick", action="store_true", help=f"shapes {', '.join(QUICK)}, 3 rounds of 5 calls")
    p.add_argument("--baseline", default="mamba_ssm", help="backend A (default mamba_ssm; torch for a CPU smoke test)")
    p.add_argument("--candidate", default="helion", help="backend B (default helion)")
    p.add_argument("--kernels-helion", default="", help="comma list of kernels.helion settings for B, e.g. autotune=true")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--profile-iters", type=int, default=3, help="iterations under torch.profiler (0: skip)")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="output dir (default $OUT or runs/bench/<gpu>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true",
                   help="keep the shapes that an earlier call with the same settings and commit recorded in --out's "
                        "shape_grid.partial.json, and run the others (a grid spread over several time-limited calls)")
    add_zxbcdt_layout_arg(p)
    a = p.parse_args(argv)
    names = list(QUICK) if a.quick and not a.shapes else (
        [s.strip() for s in a.shapes.split(",") if s.strip()] if a.shapes else [s for s in GRID if s != "tiny"])
    bad = [s for s in names if s not in GRID]
    if bad:
        p.error(f"unknown shapes {bad}; known: {', '.join(GRID)}")
    a.shape_names = names
    if a.quick:
        a.rounds = min(a.rounds, 3)
    if a.baseline == a.candidate:
        p.error("--candidate must differ from --baseline")
    a.helion_settings = _settings(a.kernels_helion, p)
    return a


def _settings(text: str, p) -> dict:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        k, _, v = item.partition("=")
        out[k] = {"true": True, "false": False}.get(v.lower(), float(v) if v.replace(".", "").isdigit() else v)
    return out


def _op(backend, shape: MixerShape, p: dict, seq_idx):
    import torch

    def fwd():
        return backend.mamba_split_conv1d_scan_combined(
            op_zxbcdt(backend, p), p["conv_w"], p["conv_b"], p["dt_bias"].float(), -torch.exp(p["A_log"].float()),
            D=p["D"], chunk_size=shape.chunk_size, seq_idx=seq_idx, activation="silu", headdim=shape.headdim,
            ngroups=shape.ngroups, norm_before_gate=False)

    leaves = [zxbcdt_leaf(p)] + [p[k] for k in GRADS if k != "zxbcdt"]

    def fwdbwd():
        for t in leaves:
            t.grad = None
        fwd().backward(p["dy"])

    def outputs():
        for t in leaves:
            t.grad = None
        y = fwd()
        y.backward(p["dy"])
        out = {"y": y.detach().float()}
        out.update({f"d_{k}": grad_of(p, k) for k in GRADS})
        return out

    return fwdbwd, outputs


def _fp32_params(p: dict) -> dict:
    """p's inputs in fp32, in p's layouts."""
    leaves = [zxbcdt_leaf_name(p)] + [k for k in GRADS if k != "zxbcdt"]
    q = {k: p[k].detach().float().clone().requires_grad_(True) for k in leaves}
    q["dy_lbd"] = p["dy_lbd"].detach().float().clone()
    q["dy"] = q["dy_lbd"].transpose(0, 1)
    if "zxbcdt_lbd" in q:
        q["zxbcdt"] = q["zxbcdt_lbd"].transpose(0, 1)
    return q


def run_shape(name: str, args, backends: dict, device, log=lambda msg: None) -> dict:
    """One shape's record; ``log`` gets a line as each phase starts (a time limit then shows where it stopped)."""
    import torch

    from kernels.causal_conv1d import docs_seq_idx

    shape, docs = GRID[name]
    rec: dict = {"shape": {**shape.__dict__, "docs_per_sequence": docs}}
    p = make_params(shape, device, torch.bfloat16, args.seed, zxbcdt_layout=args.zxbcdt_layout)
    seq = docs_seq_idx(shape.batch, shape.seqlen, shape.seqlen, docs, device)
    A, B = args.baseline, args.candidate
    ops = {lab: _op(backends[lab], shape, p, seq) for lab in (A, B)}
    settings = backends[B].settings
    if settings is not None and settings.autotune and device.type == "cuda":
        # as a training run with autotune does before its first step: the shape's kernels without a config are
        # tuned autotune_jobs at a time (with packed documents, the conv1d kernels with seq_idx)
        from nano_hybrid.kernel_search import pretune

        log(f"{B}: tuning the kernels without a config, {settings.autotune_jobs} at a time")
        t0 = time.perf_counter()
        rec["pretune_failed"] = pretune(grid_model_dims(name), settings, say=log)
        rec["pretune_s"] = round(time.perf_counter() - t0, 1)
    # first call of each arm: compile + config selection (+ first-use tuning for helion with autotune on)
    for lab in (A, B):
        log(f"{lab}: first call (compile, config selection, any autotuning)")
        stats.sync(device)
        t0 = time.perf_counter()
        ops[lab][0]()
        stats.sync(device)
        rec[f"first_call_s_{lab}"] = round(time.perf_counter() - t0, 2)
    log("errors against the fp32 op")
    # errors against the fp32 baseline op on the same values, next to the baseline's own bf16 errors
    q = _fp32_params(p)
    ref = _op(backends[A], shape, q, seq)[1]()
    del q
    rec["rel_err_vs_fp32"] = {lab: {k: rel_err(v, ref[k]) for k, v in ops[lab][1]().items()} for lab in (A, B)}
    errs = rec["rel_err_vs_fp32"]
    rec["err_ratio_max"] = max(errs[B][k] / max(errs[A][k], 1e-6) for k in ref)
    del ref
    # per-call speed, ABBA rounds
    log(f"timing: {args.rounds} ABBA rounds of {args.iters} calls")
    times = {A: [], B: []}
    labels = [A, B]
    for order in stats.alternating_order(2, args.rounds):
        for i in order:
            times[labels[i]] += stats.time_calls(ops[labels[i]][0], args.iters, device)
    rec["ms_per_call"] = {lab: stats.summarize(times[lab]) for lab in labels}
    rec["speedup_per_call"] = stats.ratio_summary(times[A], times[B])
    if args.profile_iters and device.type == "cuda":
        log(f"device time: {args.profile_iters} profiled calls per backend")
        tables = {lab: profiling.profile_device_table(ops[lab][0], args.profile_iters) for lab in labels}
        dev = {lab: t["total_us_per_iter"] for lab, t in tables.items()}
        rec["device_us_per_call"] = dev
        # where each backend's device time goes: its largest kernels (us per call, calls per call)
        rec["device_kernels"] = {lab: [{k: r[k] for k in ("kernel", "us_per_iter", "calls_per_iter")}
                                       for r in t["rows"][:DEVICE_KERNELS_KEPT]] for lab, t in tables.items()}
        rec["speedup_device"] = dev[A] / dev[B] if dev[B] else None
    return rec


def make_backends(args) -> dict:
    """The baseline's and the candidate's backends; an unknown or unavailable backend or a bad setting raises the
    registry's one-line error."""
    from kernels.registry import get_backend

    return {args.baseline: get_backend(args.baseline),
            args.candidate: get_backend(args.candidate, args.helion_settings if args.candidate == "helion" else None)}


def run(args, backends: dict | None = None) -> dict:
    import warnings

    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backends = backends or make_backends(args)
    res = {"benchmark": "bench_shape_grid", "env": environment.env_info(), "args": {k: v for k, v in vars(args).items()},
           "backend_settings": {k: v.settings_dict() for k, v in backends.items()}, "shapes": {}}
    t_all = time.perf_counter()
    earlier = _earlier_shapes(args, res["env"]) if args.resume else {}
    for name in args.shape_names:
        t0 = time.perf_counter()
        if name in earlier:
            res["shapes"][name] = earlier[name]
            print(f"== {name}: kept from the earlier call ({earlier[name].get('elapsed_s')} s there)", flush=True)
            continue
        print(f"== {name}", flush=True)

        def log(msg: str, t0=t0) -> None:
            print(f"   [{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)

        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                rec = run_shape(name, args, backends, device, log)
            except Exception as e:  # noqa: BLE001 - recorded; the next shape still runs
                rec = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                print(rec["traceback"], file=sys.stderr, flush=True)
        said = sorted({str(x.message) for x in w if "nano_hybrid kernels" in str(x.message)})
        rec["notices"] = [m for m in said if not m.startswith(STATE_PASSING_NOTICE)]
        rec["state_passing"] = state_passing_taken(backends.get(args.candidate), GRID[name][0])
        rec["elapsed_s"] = round(time.perf_counter() - t0, 1)
        res["shapes"][name] = rec
        if args.out:  # what has run so far survives a time limit
            import json

            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "shape_grid.partial.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        if "speedup_per_call" in rec:
            print(f"   {rec['speedup_per_call']['speedup']:.2f}x per call, err ratio {rec['err_ratio_max']:.2f}, "
                  f"{rec['elapsed_s']} s", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ok = [r for r in res["shapes"].values() if "speedup_per_call" in r]
    res["summary"] = {
        "shapes_run": len(ok), "shapes_failed": sorted(k for k, r in res["shapes"].items() if "error" in r),
        "geomean_speedup_per_call": _geomean([r["speedup_per_call"]["speedup"] for r in ok]),
        "min_speedup_per_call": min((r["speedup_per_call"]["speedup"] for r in ok), default=None),
        "geomean_speedup_device": _geomean([r["speedup_device"] for r in ok if r.get("speedup_device")]),
        "elapsed_s": round(time.perf_counter() - t_all, 1),
    }
    return res


# the arguments that change what a shape's record measures: a resumed grid keeps records made with the same ones
MEASURE_ARGS = ("baseline", "candidate", "kernels_helion", "rounds", "iters", "profile_iters", "seed", "zxbcdt_layout")


def _earlier_shapes(args, env: dict) -> dict:
    """``--resume``: the error-free shape records of ``--out``'s shape_grid.partial.json when that call had the same
    ``MEASURE_ARGS`` and git commit (else none, with one line saying why), each marked ``earlier_call``."""
    import json

    path = Path(args.out or reporting.default_out_dir()) / "shape_grid.partial.json"
    if not path.is_file():
        print(f"--resume: no {path}; every shape runs", flush=True)
        return {}
    try:
        old = json.loads(path.read_text())
        same = all(old["args"].get(k) == getattr(args, k) for k in MEASURE_ARGS)
        commit = old["env"].get("git_commit")
    except (ValueError, KeyError, AttributeError) as e:
        print(f"--resume: {path} is unreadable ({type(e).__name__}); every shape runs", flush=True)
        return {}
    if not same or commit != env.get("git_commit"):
        print(f"--resume: {path} was made with other settings or at commit {commit}; every shape runs", flush=True)
        return {}
    return {k: dict(r, earlier_call=True) for k, r in old.get("shapes", {}).items()
            if "error" not in r and k in args.shape_names}


def _geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def markdown(res: dict) -> str:
    A, B = res["args"]["baseline"], res["args"]["candidate"]
    rows = []
    for name, r in res["shapes"].items():
        if "error" in r:
            rows.append([name, "ERROR", r["error"][:80], "", "", "", ""])
            continue
        e = r["rel_err_vs_fp32"]
        rows.append([name, f"{r['ms_per_call'][A]['median']:.3f}", f"{r['ms_per_call'][B]['median']:.3f}",
                     f"{r['speedup_per_call']['speedup']:.2f}",
                     f"{r['speedup_device']:.2f}" if r.get("speedup_device") else "-",
                     f"{max(e[B].values()):.2e} / {max(e[A].values()):.2e}", f"{r['first_call_s_' + B]}"])
    s = res["summary"]
    head = (f"# Shape grid: {B} vs {A} (split-conv1d-scan fwd+bwd, bf16, zxbcdt layout "
            f"{res['args']['zxbcdt_layout']})\n\n"
            f"{s['shapes_run']} shapes run, failed: {s['shapes_failed'] or 'none'}; geomean speedup per call "
            f"{s['geomean_speedup_per_call']}, device {s['geomean_speedup_device']}, min {s['min_speedup_per_call']}"
            f"\n\n")
    return head + reporting.md_table([f"shape", f"{A} ms", f"{B} ms", "x/call", "x/device",
                               f"max rel err vs fp32 {B} / {A}", f"{B} first call s"], rows) + "\n"


def main(argv=None) -> int:
    from kernels.registry import BackendUnavailableError, KernelSwitchError, UnknownBackendError

    args = parse_args(argv)
    try:
        reporting.check_args(args)
        backends = make_backends(args)
    except (ValueError, UnknownBackendError, BackendUnavailableError, KernelSwitchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    res = run(args, backends)
    out = Path(args.out) if args.out else reporting.default_out_dir()
    js, md = reporting.write_results(out, "shape_grid", res, markdown(res))
    print(markdown(res))
    print(f"wrote {js} and {md}")
    return 0 if not res["summary"]["shapes_failed"] else 1
