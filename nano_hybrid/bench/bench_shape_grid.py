"""The Mamba-2 split-conv1d-scan op (forward + backward) on a grid of model shapes, helion against mamba_ssm.

    python scripts/bench_shape_grid.py                         # every shape of GRID (one process, ~10 min on an H200)
    python scripts/bench_shape_grid.py --quick                 # 4 shapes, fewer rounds
    python scripts/bench_shape_grid.py --shapes nano_tp1,m2_2p7b_c256 --kernels-helion autotune=true
    python scripts/bench_shape_grid.py --out $OUT --resume --warm-jobs 4    # compile in 4 child processes first

Per shape, in one process: both backends on the same bf16 inputs (``mixer.make_params``; Megatron's init
ranges), and the fp32 mamba-ssm op on the same values as the reference. Each op gets zxbcdt as Megatron's mixer
hands it over (``mixer.op_zxbcdt``): a (b, l, d) view of (l, b, d) memory, as Megatron's in_proj produces it, or a
contiguous copy of it for a backend without ``strided_zxbcdt``; ``--zxbcdt-layout contiguous`` stores zxbcdt as a
contiguous (b, l, d) tensor instead. Reported per shape:
- speed per call: median wall time of one fwd+bwd call, CUDA events, in alternating rounds of three arms (the
  baseline, the candidate, the baseline again; ``stats.time_arms``), the speedup median(mamba_ssm)/median(helion)
  over the first baseline arm's times, and the A-vs-A control median(baseline)/median(baseline again)
  (``control_per_call``, with ``ms_per_call_control``: the spread that a speedup must pass; the summary's
  ``control_per_call_range``: its least and greatest point over the shapes);
- device time: the summed kernel time per call from torch.profiler (``profiling.profile_device_table``), and each
  backend's largest kernels (``device_kernels``);
- errors: relative L2 of the output and every gradient against fp32 mamba-ssm, for helion bf16 and, next to it,
  mamba-ssm's own bf16 (the error a correct bf16 kernel has);
- the chunk-state path the helion backend took (``kernels.helion.state_passing``: "fused" or "split");
- the kernels' config notices (nearest shape / default / tuned, from ``kernels.first_use.select_config``) and the
  first-call time (compile + selection + any first-use tuning). With ``--kernels-helion autotune=true`` a shape
  first has its missing kernels tuned several at a time (``nano_hybrid.kernel_search.pretune``, as a
  training run does; ``pretune_s`` and ``pretune_failed`` in its record).
A shape that raises is recorded with its error and the next shape still runs. A shape whose fp32 reference runs
out of GPU memory is timed without errors (``rel_err_vs_fp32`` and ``err_ratio_max`` None, ``errors_skipped`` says
why). Before any work at a shape both backends are asked whether they run it (``KernelBackend.shape_refusal``, e.g.
mamba_ssm's 32-bit offsets): a candidate that refuses fails the shape; where only the baseline refuses, the
candidate runs alone (``baseline_refused``; its first call, time per call and device time; no errors against fp32,
since the reference is the baseline's op; no speedups), and the summary lists the shape under ``candidate_only``,
counted as run and left out of the geomeans. Writes ``shape_grid.json`` and ``.md`` to $OUT (default
runs/bench/<gpu>).

A shape that raises on a GPU and leaves the process's CUDA context lost (an illegal memory access or a launch
failure: every later CUDA call fails) is recorded with ``cuda_context_lost``; the partial json is written and the
shapes still to run go to a new process of this module with the same measuring arguments (``continue_command``;
results in ``<out>/continued_<k>``), whose records join this one's in order, each with ``continued_in_child``: k
(that process, which loses its context in turn, continues the same way: k + 1). A shape that process does not
record is an error "not run: the continuing process failed (...)". This process's GPU memory stays allocated until
it exits, so the new process has what is left.

``--warm-jobs N`` (CUDA only): before measuring, the shapes that will run are warmed in child processes, N at a time
(``warm_plan``: largest first; a shape of more than ``WARM_ALONE_TOKENS`` tokens per call alone, after the others),
each one ``--warm-only`` call of this module at one shape: the first fwd+bwd call of each backend and the fp32
reference's first call, with the helion settings' ``autotune`` off, and nothing measured. Their compiled Triton
kernels land in the on-disk Triton / Inductor caches that the user's processes share, so the measuring process
mostly finds them there (mamba-ssm's autotuning still times its configs in the measuring process, and with
``autotune=true`` helion's pretuned configs compile there). A child that fails (out of GPU memory, an exception) or
runs past ``--warm-timeout`` seconds (its process group is killed) is one line; its shape compiles in the measuring
process. Children's output: ``<out>/warm_logs/<shape>.out`` / ``.err``; the record: ``res["warm"]``.

``--resume`` keeps the error-free shape records of ``<out>/shape_grid.partial.json`` made with the same measuring
arguments (``MEASURE_ARGS``), the same backend settings, the same kernel sources and configs (``kernels_digest``,
recorded as ``env["kernels_digest"]``; the git commit may differ) and the same GPU and library versions
(``RESUME_ENV_KEYS``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from kernels.first_use import exit_with_parent, kill_process_group
from kernels.tuning import is_out_of_memory
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
                   help="keep the shapes that an earlier call recorded in --out's shape_grid.partial.json with the "
                        "same settings, kernel sources and configs, GPU and library versions, and run the others (a "
                        "grid spread over several time-limited calls)")
    p.add_argument("--warm-jobs", type=int, default=0,
                   help="CUDA: before measuring, compile the shapes that will run in this many child processes at a "
                        "time (filling the on-disk Triton caches; no autotuning there); 0: none")
    p.add_argument("--warm-timeout", type=float, default=420.0,
                   help="seconds a --warm-jobs child may run before its process group is killed (default 420: a cold "
                        "shape's first calls and fp32 reference, several children at a time)")
    p.add_argument("--warm-only", action="store_true",
                   help="a --warm-jobs child: at each shape run each backend's first call and the fp32 reference's, "
                        "with autotune off, measure nothing and write nothing")
    # a process that continues a grid after its parent lost its CUDA context: its number in the chain (1: the first
    # one), which its own records' ``continued_in_child`` take in the parent
    p.add_argument("--continuation", type=int, default=0, help=argparse.SUPPRESS)
    add_zxbcdt_layout_arg(p)
    a = p.parse_args(argv)
    if a.warm_jobs < 0 or a.warm_timeout <= 0:
        p.error("--warm-jobs must be >= 0 and --warm-timeout > 0")
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
    if a.warm_only and a.candidate == "helion":
        # no first-use tuning in a warming child: searches in processes running side by side time their kernels
        # under contention
        a.helion_settings["autotune"] = False
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


def _oom_detail(e: BaseException) -> str:
    """What a CUDA out-of-memory message says about the allocation: "needs 2.00 GiB more, 1.50 GiB free" (the parts
    it names; "" when it names neither)."""
    text = str(e)
    need = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
    free = re.search(r"of which ([\d.]+ [KMGT]?i?B) is free", text)
    return ", ".join(([f"needs {need.group(1)} more"] if need else []) + ([f"{free.group(1)} free"] if free else []))


def _errors_vs_fp32(rec: dict, backends: dict, ops: dict, shape: MixerShape, p: dict, seq, A: str, B: str,
                    device, log) -> None:
    """``rel_err_vs_fp32`` (per backend, output and every gradient against the fp32 baseline op on the same values)
    and ``err_ratio_max`` into ``rec``. Where the fp32 reference does not fit in GPU memory both are None and
    ``errors_skipped`` says why; its tensors are freed before the timing."""
    import torch

    skipped = None
    try:
        q = _fp32_params(p)
        ref = _op(backends[A], shape, q, seq)[1]()
        del q
        errs = {lab: {k: rel_err(v, ref[k]) for k, v in ops[lab][1]().items()} for lab in (A, B)}
        rec["rel_err_vs_fp32"] = errs
        rec["err_ratio_max"] = max(errs[B][k] / max(errs[A][k], 1e-6) for k in ref)
        del ref
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one
        if not is_out_of_memory(e):
            raise
        detail = _oom_detail(e)
        # the fp32 reference's tensors, or the bf16 outputs compared with them
        skipped = "out of GPU memory in the error check" + (f" ({detail})" if detail else "")
    if skipped is not None:
        # the exception (and with it the frames that held the fp32 tensors) is gone here: free their memory
        q = ref = None  # noqa: F841 - drops any reference left in this frame
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rec["rel_err_vs_fp32"] = None
        rec["err_ratio_max"] = None
        rec["errors_skipped"] = skipped
        log(f"errors not measured: {skipped}")


def _control_label(A: str) -> str:
    """The label of the baseline's second timed arm (the A-vs-A control): "<A>#2" (``stats.arm_labels``)."""
    return stats.arm_labels([A, A])[1]


def _device_time(rec: dict, ops: dict, arms: list[str], iters: int) -> None:
    """``device_us_per_call`` (the summed kernel time per call, torch.profiler over ``iters`` calls) and
    ``device_kernels`` (the largest kernels, us and calls per call) of each backend of ``arms`` into ``rec``."""
    tables = {lab: profiling.profile_device_table(ops[lab][0], iters) for lab in arms}
    rec["device_us_per_call"] = {lab: t["total_us_per_iter"] for lab, t in tables.items()}
    # where each backend's device time goes: its largest kernels (us per call, calls per call)
    rec["device_kernels"] = {lab: [{k: r[k] for k in ("kernel", "us_per_iter", "calls_per_iter")}
                                   for r in t["rows"][:DEVICE_KERNELS_KEPT]] for lab, t in tables.items()}


def run_shape(name: str, args, backends: dict, device, log=lambda msg: None, warm_only: bool = False) -> dict:
    """One shape's record; ``log`` gets a line as each phase starts (a time limit then shows where it stopped).
    ``warm_only``: the phases before the timing that compile (each backend's first call, then the fp32 reference's
    first call); nothing is compared or timed.

    Before any work at the shape each backend is asked whether it runs it (``KernelBackend.shape_refusal``): a
    candidate that refuses makes the record an error ("candidate refuses: ..."); a baseline that refuses leaves the
    candidate to run alone (``baseline_refused``: first call, timing and device time of the candidate only, no
    errors against fp32, no speedups)."""
    import torch

    from kernels.causal_conv1d import docs_seq_idx

    shape, docs = GRID[name]
    rec: dict = {"shape": {**shape.__dict__, "docs_per_sequence": docs}}
    A, B = args.baseline, args.candidate
    dims = shape.model_dims()
    refused = backends[B].shape_refusal(**dims)
    if refused:
        log(f"{B} refuses the shape: {refused}")
        rec["error"] = f"candidate refuses: {refused}"
        return rec
    base_refused = backends[A].shape_refusal(**dims)
    arms = [B] if base_refused else [A, B]
    if base_refused:
        log(f"{A} refuses the shape ({base_refused}); {B} runs alone")
        rec["baseline_refused"] = base_refused
    p = make_params(shape, device, torch.bfloat16, args.seed, zxbcdt_layout=args.zxbcdt_layout)
    seq = docs_seq_idx(shape.batch, shape.seqlen, shape.seqlen, docs, device)
    ops = {lab: _op(backends[lab], shape, p, seq) for lab in arms}
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
    for lab in arms:
        log(f"{lab}: first call (compile, config selection, any autotuning)")
        first = _first_calls(backends[lab])
        stats.sync(device)
        t0 = time.perf_counter()
        ops[lab][0]()
        stats.sync(device)
        rec[f"first_call_s_{lab}"] = round(time.perf_counter() - t0, 2)
        if first is not None:  # the helion kernels made ready from the compile cache or bound now
            rec[f"first_calls_{lab}"] = dict(_first_calls(backends[lab]) - first)
    if warm_only:
        if not base_refused:
            log(f"{A} fp32: first call (compile)")
            t0 = time.perf_counter()
            _op(backends[A], shape, _fp32_params(p), seq)[1]()
            stats.sync(device)
            rec["first_call_s_fp32"] = round(time.perf_counter() - t0, 2)
        return rec
    if base_refused:
        # the fp32 reference is the baseline's op: no reference at this shape
        rec["rel_err_vs_fp32"] = None
        rec["err_ratio_max"] = None
        rec["errors_skipped"] = f"no reference: {base_refused}"
        log(f"errors not measured: no reference ({A} refuses the shape)")
        log(f"timing: {args.rounds} rounds of {args.iters} calls of {B} alone")
        times = stats.time_arms({B: ops[B][0]}, warmup=0, rounds=args.rounds, iters=args.iters, device=device)
        rec["ms_per_call"] = {B: stats.summarize(times[B])}
    else:
        log("errors against the fp32 op")
        # errors against the fp32 baseline op on the same values, next to the baseline's own bf16 errors
        _errors_vs_fp32(rec, backends, ops, shape, p, seq, A, B, device, log)
        # per-call speed: the baseline, the candidate and the baseline again (the A-vs-A control: the spread a
        # speedup must pass) in alternating rounds
        A2 = _control_label(A)
        log(f"timing: {args.rounds} alternating rounds of {args.iters} calls per arm ({A}, {B}, {A} again)")
        times = stats.time_arms({A: ops[A][0], B: ops[B][0], A2: ops[A][0]}, warmup=0, rounds=args.rounds,
                                iters=args.iters, device=device)
        rec["ms_per_call"] = {lab: stats.summarize(times[lab]) for lab in (A, B)}
        rec["ms_per_call_control"] = stats.summarize(times[A2])
        rec["speedup_per_call"] = stats.ratio_summary(times[A], times[B])
        rec["control_per_call"] = stats.ratio_summary(times[A], times[A2])
    if args.profile_iters and device.type == "cuda":
        log(f"device time: {args.profile_iters} profiled calls per backend")
        _device_time(rec, ops, arms, args.profile_iters)
        dev = rec["device_us_per_call"]
        if not base_refused:
            rec["speedup_device"] = dev[A] / dev[B] if dev[B] else None
    return rec


def make_backends(args) -> dict:
    """The baseline's and the candidate's backends; an unknown or unavailable backend or a bad setting raises the
    registry's one-line error."""
    from kernels.registry import get_backend

    return {args.baseline: get_backend(args.baseline),
            args.candidate: get_backend(args.candidate, args.helion_settings if args.candidate == "helion" else None)}


def _cuda_context_lost(device) -> bool:
    """Whether this process's CUDA context is lost (an illegal memory access, a launch failure: every later CUDA
    call fails the same way): a synchronize that raises says so."""
    import torch

    try:
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - torch.AcceleratorError or RuntimeError: either way no GPU work runs here now
        return True
    return False


def _write_partial(out: Path, res: dict) -> None:
    """``res`` as ``<out>/shape_grid.partial.json``: what has run so far survives a time limit."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "shape_grid.partial.json").write_text(json.dumps(res, indent=1, default=str) + "\n")


def _shape_line(rec: dict, A: str, B: str) -> str | None:
    """The line printed under a shape once it has run: its speedup and A-vs-A control, or the candidate's time
    alone where the baseline refused the shape, or its error; None for a record with none of them."""
    if "error" in rec:
        return f"   failed: {rec['error'].splitlines()[0][:300] if rec['error'] else ''}"
    ratio = rec.get("err_ratio_max")
    err = f"err ratio {'not measured' if ratio is None else f'{ratio:.2f}'}"
    if "speedup_per_call" in rec:
        c = rec.get("control_per_call")
        control = f" (A-vs-A {_ratio_text(c)})" if c else ""
        return f"   {rec['speedup_per_call']['speedup']:.2f}x per call{control}, {err}, {rec.get('elapsed_s')} s"
    if "baseline_refused" in rec and B in rec.get("ms_per_call", {}):
        return (f"   {B} alone ({A} refuses the shape): {rec['ms_per_call'][B]['median']:.3f} ms per call, "
                f"{rec.get('elapsed_s')} s")
    return None


def run(args, backends: dict | None = None) -> dict:
    """Every shape of ``args.shape_names`` in order (``run_shape``), and the summary. On a CUDA device, a shape that
    raises and leaves this process's CUDA context lost (``_cuda_context_lost``) is recorded with
    ``cuda_context_lost`` and the shapes still to run continue in a new process (``continue_shapes``), whose
    records join this result in order."""
    import warnings

    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backends = backends or make_backends(args)
    res = {"benchmark": "bench_shape_grid", "env": environment.env_info(), "args": {k: v for k, v in vars(args).items()},
           "backend_settings": {k: v.settings_dict() for k, v in backends.items()}, "shapes": {}}
    res["env"]["kernels_digest"] = kernels_digest(config_dirs=_user_config_dirs(backends))
    out = Path(args.out) if args.out else reporting.default_out_dir()
    t_all = time.perf_counter()
    earlier = _earlier_shapes(args, res) if args.resume else {}
    if args.warm_jobs > 0:
        if device.type != "cuda":
            print(f"--warm-jobs: ignored on device {device.type} (it fills the GPU kernel caches)", flush=True)
        elif todo := [n for n in args.shape_names if n not in earlier]:
            res["warm"] = warm_shapes(args, todo, out / "warm_logs")
    for i, name in enumerate(args.shape_names):
        t0 = time.perf_counter()
        if name in earlier:
            res["shapes"][name] = earlier[name]
            print(f"== {name}: kept from the earlier call ({earlier[name].get('elapsed_s')} s there)", flush=True)
            continue
        print(f"== {name}", flush=True)

        def log(msg: str, t0=t0) -> None:
            print(f"   [{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)

        raised = False
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                rec = run_shape(name, args, backends, device, log)
            except Exception as e:  # noqa: BLE001 - recorded; the next shape still runs
                raised = True
                rec = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                print(rec["traceback"], file=sys.stderr, flush=True)
        said = sorted({str(x.message) for x in w if "nano_hybrid kernels" in str(x.message)})
        rec["notices"] = [m for m in said if not m.startswith(STATE_PASSING_NOTICE)]
        rec["state_passing"] = state_passing_taken(backends.get(args.candidate), GRID[name][0])
        rec["elapsed_s"] = round(time.perf_counter() - t0, 1)
        lost = raised and device.type == "cuda" and _cuda_context_lost(device)
        if lost:
            rec["cuda_context_lost"] = True
        res["shapes"][name] = rec
        if args.out or lost:
            _write_partial(out, res)
        if (line := _shape_line(rec, args.baseline, args.candidate)) is not None:
            print(line, flush=True)
        if lost:
            # no CUDA call works in this process any more (torch.cuda.empty_cache would raise): the shapes still to
            # run continue in a new process
            rest = args.shape_names[i + 1:]
            todo = [n for n in dict.fromkeys(rest) if n not in earlier and n != name]
            print(f"CUDA context lost at {name}; {len(todo)} shapes continue in a new process", flush=True)
            got = {}
            if todo:
                got, res["continued"] = continue_shapes(args, todo, getattr(args, "continuation", 0) + 1, out)
            for n in rest:
                if n != name:
                    res["shapes"][n] = earlier[n] if n in earlier else got[n]
            _write_partial(out, res)
            break
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ok = [r for r in res["shapes"].values() if "speedup_per_call" in r and "error" not in r]
    alone = sorted(k for k, r in res["shapes"].items() if "baseline_refused" in r and "error" not in r)
    controls = [r["control_per_call"]["speedup"] for r in ok if r.get("control_per_call")]
    res["summary"] = {
        "shapes_run": len(ok) + len(alone),
        "shapes_failed": sorted(k for k, r in res["shapes"].items() if "error" in r),
        "candidate_only": alone,
        "geomean_speedup_per_call": _geomean([r["speedup_per_call"]["speedup"] for r in ok]),
        "min_speedup_per_call": min((r["speedup_per_call"]["speedup"] for r in ok), default=None),
        "geomean_speedup_device": _geomean([r["speedup_device"] for r in ok if r.get("speedup_device")]),
        "control_per_call_range": [min(controls), max(controls)] if controls else None,
        "elapsed_s": round(time.perf_counter() - t_all, 1),
    }
    return res


# the arguments that change what a shape's record measures: a resumed grid keeps records made with the same ones
MEASURE_ARGS = ("baseline", "candidate", "rounds", "iters", "profile_iters", "seed", "zxbcdt_layout")
# the keys of env (``environment.env_info``) that change what a shape's record measures: the GPU and the libraries
RESUME_ENV_KEYS = ("gpu", "torch", "cuda", "triton", "helion", "mamba_ssm", "causal_conv1d")


def _digest_files(kernels_dir: Path, config_dirs: tuple = ()) -> list[tuple[str, Path]]:
    """The files whose contents ``kernels_digest`` covers, each with the name it is hashed under, sorted by name."""
    here = Path(__file__).resolve().parent
    files = {f"kernels/{p.relative_to(kernels_dir).as_posix()}": p for p in kernels_dir.rglob("*.py")}
    files.update({f"kernels/{p.relative_to(kernels_dir).as_posix()}": p
                  for p in (kernels_dir / "configs").rglob("*.json")})
    files.update({f"nano_hybrid/bench/{n}": here / n
                  for n in ("bench_shape_grid.py", "mixer.py", "stats.py", "profiling.py")})
    for i, d in enumerate(Path(c) for c in config_dirs):  # <arch>/<kernel>.json (and first-use failure records)
        if d.is_dir():
            files.update({f"config_dir{i}/{p.relative_to(d).as_posix()}": p for p in d.glob("*/*.json")})
    return sorted((k, p) for k, p in files.items() if p.is_file())


def kernels_digest(kernels_dir: Path | str | None = None, config_dirs: tuple = ()) -> str:
    """sha256 over what a shape's record runs: every ``*.py`` under ``kernels_dir`` (default: the folder of the
    ``kernels`` package this process imports), every ``configs/**/*.json`` there (the committed kernel configs),
    every ``<arch>/*.json`` under ``config_dirs`` (the helion backend's user config cache, which a call without an
    exact committed config reads; not its compile cache, ``compiled/``, which holds what the rest gives), this
    module, ``mixer.py`` and the timing code (``stats.py``, ``profiling.py``), each as its relative name and its
    bytes, tracked by git or not."""
    if kernels_dir is None:
        import kernels

        kernels_dir = Path(kernels.__file__).resolve().parent
    h = hashlib.sha256()
    for name, path in _digest_files(Path(kernels_dir), tuple(config_dirs)):
        data = path.read_bytes()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _first_calls(backend):
    """A copy of the helion backend's count of kernel first calls by how they were made ready
    (``kernels.tuning.Runtime.first_calls``: "loaded" from the compile cache, "bound"); None for other backends."""
    if backend.settings is None:
        return None
    from kernels.tuning import runtime_for

    return collections.Counter(runtime_for(backend.settings).first_calls)


def _user_config_dirs(backends: dict) -> tuple:
    """The user config caches (``kernels.tuning.user_cache_root``) of the backends that have settings (helion)."""
    from kernels.tuning import user_cache_root

    return tuple(sorted({str(user_cache_root(b.settings.cache_dir)) for b in backends.values()
                         if b.settings is not None}))


def _resume_differences(old: dict, args, res: dict) -> list[str]:
    """What differs between the earlier call's result ``old`` and this call (``args``, ``res``): "settings (...)",
    "kernels digest", "GPU/versions (...)"; empty when its records measure the same."""
    out = []
    settings = [k for k in MEASURE_ARGS if old["args"].get(k) != getattr(args, k)]
    if old.get("backend_settings") != json.loads(json.dumps(res["backend_settings"], default=str)):
        settings.append("backend settings")
    if settings:
        out.append(f"settings ({', '.join(settings)})")
    if old["env"].get("kernels_digest") != res["env"]["kernels_digest"]:
        out.append("kernels digest")
    env = [f"{k} {old['env'].get(k)} -> {res['env'].get(k)}" for k in RESUME_ENV_KEYS
           if old["env"].get(k) != res["env"].get(k)]
    if env:
        out.append(f"GPU/versions ({', '.join(env)})")
    return out


def _earlier_shapes(args, res: dict) -> dict:
    """``--resume``: the error-free shape records of ``--out``'s shape_grid.partial.json when that call measured
    the same as this one (``_resume_differences``: ``MEASURE_ARGS``, backend settings, ``kernels_digest``, GPU and
    library versions; the git commit may differ), each marked ``earlier_call``; else none, with one line saying
    why."""
    path = Path(args.out or reporting.default_out_dir()) / "shape_grid.partial.json"
    if not path.is_file():
        print(f"--resume: no {path}; every shape runs", flush=True)
        return {}
    try:
        old = json.loads(path.read_text())
        differ = _resume_differences(old, args, res)
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        print(f"--resume: {path} is unreadable ({type(e).__name__}); every shape runs", flush=True)
        return {}
    if differ:
        print(f"--resume: {path} was made with other settings: {'; '.join(differ)} differ; every shape runs",
              flush=True)
        return {}
    return {k: dict(r, earlier_call=True) for k, r in old.get("shapes", {}).items()
            if "error" not in r and k in args.shape_names}


# a shape with more tokens per call (batch x seqlen) than this is warmed with no other child running: its tensors,
# and its fp32 reference's, take a large share of the GPU's memory
WARM_ALONE_TOKENS = 65536
WARM_POLL_S = 0.2  # seconds between looks at the running warm children
_THIS_MODULE = "nano_hybrid.bench.bench_shape_grid"
WARM_PARENT_ENV = "NANO_BENCH_WARM_PARENT"  # the pid of the process that started a warm child


def warm_plan(names: list[str]) -> tuple[list[str], list[str]]:
    """The order ``--warm-jobs`` warms grid shapes ``names`` in: (the shapes warmed several at a time, then the ones
    warmed alone, one after the other), each group largest first by zxbcdt's elements (tokens per call x
    ``zxbcdt_dim``; equal sizes keep their order in ``names``). A shape of more than ``WARM_ALONE_TOKENS`` tokens
    per call is warmed alone."""
    def size(n: str) -> int:
        s = GRID[n][0]
        return s.batch * s.seqlen * s.zxbcdt_dim

    order = sorted(dict.fromkeys(names), key=size, reverse=True)
    alone = [n for n in order if GRID[n][0].batch * GRID[n][0].seqlen > WARM_ALONE_TOKENS]
    return [n for n in order if n not in alone], alone


def _backend_args(args) -> list[str]:
    """The arguments that choose what a shape compiles, as a child of this module takes them: the backends, the
    helion settings, the seed, the zxbcdt layout and the device."""
    cmd = ["--baseline", args.baseline, "--candidate", args.candidate, "--seed", str(args.seed), "--zxbcdt-layout",
           args.zxbcdt_layout]
    cmd += ["--kernels-helion", args.kernels_helion] if args.kernels_helion else []
    cmd += ["--device", args.device] if args.device else []
    return cmd


def warm_command(args, name: str) -> list[str]:
    """The command of the child that warms shape ``name``: this module with ``--warm-only`` at that shape and the
    arguments that choose what it compiles (``_backend_args``)."""
    return [sys.executable, "-P", "-m", _THIS_MODULE, "--shapes", name, "--warm-only", *_backend_args(args)]


def continue_command(args, names: list[str], out: Path | str, k: int) -> list[str]:
    """The command of the process that measures the grid shapes ``names`` in place of this one (its CUDA context
    lost): this module at those shapes with this call's measuring arguments (``MEASURE_ARGS``: ``_backend_args``,
    rounds, calls per round, profiled calls), ``--out out`` and its number ``k`` in the chain of continuing
    processes; no ``--resume`` and no warming."""
    return [sys.executable, "-P", "-m", _THIS_MODULE, "--shapes", ",".join(names), *_backend_args(args),
            "--rounds", str(args.rounds), "--iters", str(args.iters), "--profile-iters", str(args.profile_iters),
            "--out", str(out), "--continuation", str(k)]


def _child_env(measuring: bool = False) -> dict:
    """This process's environment with PYTHONPATH led by the folders this process imports ``kernels`` and
    ``nano_hybrid`` from (in its sys.path order), so that a child started with ``python -P -m`` imports the same
    trees, and this process's pid in ``WARM_PARENT_ENV``. A warm child (``measuring`` False) caches no Triton
    autotune results (``TRITON_CACHE_AUTOTUNING=0``): its timings ran beside other children's, so the measuring
    process times the baseline's autotune candidates itself, on kernels the children compiled. A ``measuring``
    child (``continue_command``) keeps this process's setting."""
    import kernels
    import nano_hybrid

    roots = [str(Path(m.__file__).resolve().parents[1]) for m in (kernels, nano_hybrid)]
    where = {str(Path(p).resolve()): i for i, p in reversed(list(enumerate(sys.path))) if p}
    roots = sorted(dict.fromkeys(roots), key=lambda r: where.get(r, len(sys.path)))
    rest = [q for q in os.environ.get("PYTHONPATH", "").split(os.pathsep) if q and q not in roots]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(roots + rest), **{WARM_PARENT_ENV: str(os.getpid())})
    if not measuring:
        env["TRITON_CACHE_AUTOTUNING"] = "0"
    return env


@contextlib.contextmanager
def _sigterm_exits():
    """Within: SIGTERM (a stage's time limit) raises SystemExit(128 + SIGTERM) in this process, so that the clean-up
    of its children runs (``finally``); outside the main thread the signal keeps its handler."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _continue_in_child(args, names: list[str], k: int, out: Path) -> tuple[int | None, str]:
    """Run ``continue_command`` (shapes ``names``, results in ``out``) and wait for it: its stdout goes to this
    process's, its stderr passes through to this process's stderr. Returns (exit status, its last non-empty stderr
    line); (None, why) when it did not start. A SIGTERM here ends the child too."""
    try:
        proc = subprocess.Popen(continue_command(args, names, out, k), stdin=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, env=_child_env(measuring=True), text=True, errors="replace")
    except OSError as e:
        return None, f"not started: {e}"
    last = "no output on stderr"
    try:
        with _sigterm_exits():
            for line in proc.stderr:
                sys.stderr.write(line)
                if line.strip():
                    last = line.strip()[:300]
            return proc.wait(), last
    finally:
        if proc.poll() is None:  # this process is ending: so does the child (its own children through its SIGTERM)
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        sys.stderr.flush()


def _child_records(out: Path) -> dict:
    """The shape records a continuing process left in ``out``: its shape_grid.json, else its
    shape_grid.partial.json (the shapes it recorded before it stopped); {} when it left neither readable."""
    for name in ("shape_grid.json", "shape_grid.partial.json"):
        try:
            shapes = json.loads((out / name).read_text()).get("shapes")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(shapes, dict):
            return shapes
    return {}


def continue_shapes(args, names: list[str], k: int, out: Path) -> tuple[dict, dict]:
    """The grid shapes ``names`` measured by continuing process number ``k`` (``_continue_in_child``; results in
    ``<out>/continued_<k>``, whose earlier result files are removed first). Returns ({shape: record} for every
    name, each with ``continued_in_child``: k, or the number of the process further down the chain that measured
    it; a shape the process did not record is an error "not run: the continuing process failed (rc, last stderr
    line)"), and ``res["continued"]``: {"k", "out", "shapes", "rc", "stderr_last"}."""
    child_out = out / f"continued_{k}"
    for stale in ("shape_grid.json", "shape_grid.partial.json"):
        (child_out / stale).unlink(missing_ok=True)
    rc, last = _continue_in_child(args, names, k, child_out)
    got = _child_records(child_out)
    shapes = {}
    for n in names:
        if isinstance(got.get(n), dict):
            shapes[n] = {**got[n], "continued_in_child": got[n].get("continued_in_child", k)}
        else:
            shapes[n] = {"error": f"not run: the continuing process failed (rc {rc}, {last})",
                         "continued_in_child": k}
    return shapes, {"k": k, "out": str(child_out), "shapes": list(names), "rc": rc, "stderr_last": last}


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no stderr"
    return lines[-1][:300] if lines else "no output on stderr"


def _warm_children(args, names: list[str], jobs: int, log_dir: Path, env: dict, say) -> dict:
    """Run the warm children of ``names`` in order, at most ``jobs`` at once, each killed after
    ``args.warm_timeout`` seconds; one line per shape as it ends. Returns {shape: {"ok", "s"[, "rc", "error"]}}."""
    pending, running, done = list(names), {}, {}

    def finish(name: str, rc, took: float) -> None:
        if rc == 0:
            done[name] = {"ok": True, "s": round(took, 1)}
            say(f"warm {name}: ok in {took:.1f} s")
            return
        last = _last_line(log_dir / f"{name}.err")
        what = f"timeout after {args.warm_timeout:g} s" if rc == "timeout" else f"exit {rc}"
        done[name] = {"ok": False, "s": round(took, 1), "rc": rc, "error": last}
        say(f"warm {name}: failed ({what}, {last})")

    try:
        while pending or running:
            while pending and len(running) < jobs:
                name = pending.pop(0)
                try:
                    with open(log_dir / f"{name}.out", "w") as out, open(log_dir / f"{name}.err", "w") as err:
                        proc = subprocess.Popen(warm_command(args, name), stdout=out, stderr=err,
                                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
                    running[name] = (proc, time.perf_counter())
                except OSError as e:
                    done[name] = {"ok": False, "s": 0.0, "rc": None, "error": f"not started: {e}"}
                    say(f"warm {name}: failed (not started, {e})")
            if running:
                time.sleep(WARM_POLL_S)
            for name, (proc, t0) in list(running.items()):
                rc, took = proc.poll(), time.perf_counter() - t0
                if rc is None and took > args.warm_timeout:
                    kill_process_group(proc)
                    rc = "timeout"
                if rc is not None:
                    del running[name]
                    finish(name, rc, took)
    finally:  # an interrupted parent leaves no child behind
        for proc, _ in running.values():
            kill_process_group(proc)
    return done


def warm_shapes(args, names: list[str], log_dir: Path, say=lambda msg: print(msg, flush=True)) -> dict:
    """``--warm-jobs``: warm the shapes ``names`` in child processes (``warm_command``), ``args.warm_jobs`` at a time
    in ``warm_plan``'s order, then the large ones alone; their output in ``log_dir``. A child that fails or runs
    past ``args.warm_timeout`` is one line and its shape compiles in the measuring process; nothing here raises for
    it. Returns ``res["warm"]``: {"jobs", "s" (wall seconds), "shapes": {shape: {"ok", "s", ...}}}."""
    parallel, alone = warm_plan(names)
    t0 = time.perf_counter()
    say(f"warming {len(parallel) + len(alone)} shapes in child processes, {args.warm_jobs} at a time"
        + (f", then {', '.join(alone)} alone" if alone else "") + f" (logs in {log_dir})")
    shapes: dict = {}
    # SIGTERM (a stage's time limit) ends this process through the children's clean-up: they run in process groups
    # of their own, which the signal to this process's group does not reach
    with _sigterm_exits():
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            env = _child_env()
            for group, jobs in ((parallel, args.warm_jobs), (alone, 1)):
                shapes.update(_warm_children(args, group, jobs, log_dir, env, say))
        except OSError as e:  # no log folder: the shapes compile in the measuring process
            say(f"warm: not run ({type(e).__name__}: {e})")
    s = round(time.perf_counter() - t0, 1)
    say(f"warm: {sum(r['ok'] for r in shapes.values())} of {len(names)} shapes in {s} s")
    return {"jobs": args.warm_jobs, "s": s, "shapes": {n: shapes[n] for n in parallel + alone if n in shapes}}


def _end_with_parent(poll_s: float = 1.0) -> None:
    """End this process (exit 1) as soon as the process that started it is gone, so that a warm child whose
    measuring process was killed outright stops compiling: a daemon thread compares the parent's pid with
    ``WARM_PARENT_ENV`` (where set; it also covers a parent gone before this process got here), else with the
    parent's pid now."""
    exit_with_parent(int(os.environ.get(WARM_PARENT_ENV) or os.getppid()), code=1,
                     say="warm: the process that started this one is gone; stopping", poll_s=poll_s)


def warm_main(args, backends: dict) -> int:
    """``--warm-only``: the compiling phases of ``run_shape`` at each shape (each backend's first call and the fp32
    reference's); an exception ends the process (exit 1, its traceback on stderr), and so does the end of the
    process that started it (``_end_with_parent``)."""
    import torch

    _end_with_parent()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    for name in args.shape_names:
        t0 = time.perf_counter()

        def log(msg: str, t0=t0) -> None:
            print(f"   [{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)

        rec = run_shape(name, args, backends, device, log, warm_only=True)
        if "error" in rec:
            print(f"warm {name}: {rec['error']}", flush=True)
            continue
        print(f"warm {name}: " + ", ".join(f"{k[len('first_call_s_'):]} {v} s" for k, v in rec.items()
                                             if k.startswith("first_call_s_")), flush=True)
    return 0


def _geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def _ratio_text(r: dict) -> str:
    """A ``stats.ratio_summary`` as "1.01 [0.95, 1.06]" (point [interval])."""
    return f"{r['speedup']:.2f} [{r['ci_lo']:.2f}, {r['ci_hi']:.2f}]"


def _short_reason(reason: str, n: int = 60) -> str:
    """A backend's refusal (``KernelBackend.shape_refusal``) for a table cell: without the leading "kernel backend
    '<name>' ", up to its first ": ", at most ``n`` characters ("indexes with 32-bit offsets")."""
    text = re.sub(r"^kernel backend '[^']*' ", "", reason).split(": ")[0]
    return text if len(text) <= n else text[:n - 3] + "..."


def markdown(res: dict) -> str:
    A, B = res["args"]["baseline"], res["args"]["candidate"]
    rows = []
    for name, r in res["shapes"].items():
        if "error" in r:
            rows.append([name, "ERROR", r["error"][:80], "", "", "", "", ""])
            continue
        e = r.get("rel_err_vs_fp32")
        ms = r.get("ms_per_call", {})
        b_ms = f"{ms[B]['median']:.3f}" if B in ms else "-"
        if "baseline_refused" in r:
            why = _short_reason(r["baseline_refused"])
            rows.append([name, "refused", b_ms, "-", "-", "-", f"no reference: {A} {why}",
                         f"{r.get('first_call_s_' + B)}"])
            continue
        c = r.get("control_per_call")
        rows.append([name, f"{ms[A]['median']:.3f}" if A in ms else "-", b_ms,
                     f"{r['speedup_per_call']['speedup']:.2f}" if r.get("speedup_per_call") else "-",
                     _ratio_text(c) if c else "-",
                     f"{r['speedup_device']:.2f}" if r.get("speedup_device") else "-",
                     f"{max(e[B].values()):.2e} / {max(e[A].values()):.2e}" if e else
                     "not measured (out of memory)", f"{r.get('first_call_s_' + B)}"])
    s = res["summary"]
    control = s.get("control_per_call_range")
    alone = s.get("candidate_only")
    head = (f"# Shape grid: {B} vs {A} (split-conv1d-scan fwd+bwd, bf16, zxbcdt layout "
            f"{res['args']['zxbcdt_layout']})\n\n"
            f"{s['shapes_run']} shapes run, failed: {s['shapes_failed'] or 'none'}; geomean speedup per call "
            f"{s['geomean_speedup_per_call']}, device {s['geomean_speedup_device']}, min {s['min_speedup_per_call']}"
            + (f"; A-vs-A control per call {control[0]:.2f} .. {control[1]:.2f}" if control else "")
            + (f"; {B} alone ({A} refuses): {', '.join(alone)}" if alone else "")
            + "\n\n")
    return head + reporting.md_table([f"shape", f"{A} ms", f"{B} ms", "x/call", "A-vs-A", "x/device",
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
    if args.warm_only:
        return warm_main(args, backends)
    if args.continuation:  # a process that continues a grid ends with the one that started it
        _end_with_parent()
    # named before measuring: the GPU's name may not be asked after a shape has lost this process's CUDA context
    out = Path(args.out) if args.out else reporting.default_out_dir()
    res = run(args, backends)
    js, md = reporting.write_results(out, "shape_grid", res, markdown(res))
    print(markdown(res))
    print(f"wrote {js} and {md}")
    return 0 if not res["summary"]["shapes_failed"] else 1


if __name__ == "__main__":  # a --warm-jobs child runs this module with -m
    sys.exit(main())
