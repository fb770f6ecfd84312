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
A shape that raises is recorded with its error and the next shape still runs. A shape whose fp32 reference runs
out of GPU memory is timed without errors (``rel_err_vs_fp32`` and ``err_ratio_max`` None, ``errors_skipped`` says
why). Writes ``shape_grid.json`` and ``.md`` to $OUT (default runs/bench/<gpu>).

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
import gc
import hashlib
import math
import os
import re
import signal
import subprocess
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
                   help="keep the shapes that an earlier call recorded in --out's shape_grid.partial.json with the "
                        "same settings, kernel sources and configs, GPU and library versions, and run the others (a "
                        "grid spread over several time-limited calls)")
    p.add_argument("--warm-jobs", type=int, default=0,
                   help="CUDA: before measuring, compile the shapes that will run in this many child processes at a "
                        "time (filling the on-disk Triton caches; no autotuning there); 0: none")
    p.add_argument("--warm-timeout", type=float, default=300.0,
                   help="seconds a --warm-jobs child may run before its process group is killed (default 300)")
    p.add_argument("--warm-only", action="store_true",
                   help="a --warm-jobs child: at each shape run each backend's first call and the fp32 reference's, "
                        "with autotune off, measure nothing and write nothing")
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


def _is_oom(e: BaseException) -> bool:
    """Whether ``e`` is an allocator's out-of-memory error (``torch.cuda.OutOfMemoryError`` where this torch has it)."""
    import torch

    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(e, oom)) or "out of memory" in str(e).lower()


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
        if not _is_oom(e):
            raise
        detail = _oom_detail(e)
        skipped = "fp32 reference out of GPU memory" + (f" ({detail})" if detail else "")
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


def run_shape(name: str, args, backends: dict, device, log=lambda msg: None, warm_only: bool = False) -> dict:
    """One shape's record; ``log`` gets a line as each phase starts (a time limit then shows where it stopped).
    ``warm_only``: the phases before the timing that compile (each backend's first call, then the fp32 reference's
    first call); nothing is compared or timed."""
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
    if warm_only:
        log(f"{A} fp32: first call (compile)")
        t0 = time.perf_counter()
        _op(backends[A], shape, _fp32_params(p), seq)[1]()
        stats.sync(device)
        rec["first_call_s_fp32"] = round(time.perf_counter() - t0, 2)
        return rec
    log("errors against the fp32 op")
    # errors against the fp32 baseline op on the same values, next to the baseline's own bf16 errors
    _errors_vs_fp32(rec, backends, ops, shape, p, seq, A, B, device, log)
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
    res["env"]["kernels_digest"] = kernels_digest()
    t_all = time.perf_counter()
    earlier = _earlier_shapes(args, res) if args.resume else {}
    if args.warm_jobs > 0:
        if device.type != "cuda":
            print(f"--warm-jobs: ignored on device {device.type} (it fills the GPU kernel caches)", flush=True)
        elif todo := [n for n in args.shape_names if n not in earlier]:
            out = Path(args.out) if args.out else reporting.default_out_dir()
            res["warm"] = warm_shapes(args, todo, out / "warm_logs")
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
            ratio = rec.get("err_ratio_max")
            print(f"   {rec['speedup_per_call']['speedup']:.2f}x per call, err ratio "
                  f"{'not measured' if ratio is None else f'{ratio:.2f}'}, {rec['elapsed_s']} s", flush=True)
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
# the keys of env (``environment.env_info``) that change what a shape's record measures: the GPU and the libraries
RESUME_ENV_KEYS = ("gpu", "torch", "cuda", "triton", "helion", "mamba_ssm", "causal_conv1d")


def _digest_files(kernels_dir: Path) -> list[tuple[str, Path]]:
    """The files whose contents ``kernels_digest`` covers, each with the name it is hashed under, sorted by name."""
    here = Path(__file__).resolve().parent
    files = {f"kernels/{p.relative_to(kernels_dir).as_posix()}": p for p in kernels_dir.rglob("*.py")}
    files.update({f"kernels/{p.relative_to(kernels_dir).as_posix()}": p
                  for p in (kernels_dir / "configs").rglob("*.json")})
    files.update({f"nano_hybrid/bench/{n}": here / n for n in ("bench_shape_grid.py", "mixer.py")})
    return sorted((k, p) for k, p in files.items() if p.is_file())


def kernels_digest(kernels_dir: Path | str | None = None) -> str:
    """sha256 over what a shape's record runs: every ``*.py`` under ``kernels_dir`` (default: the folder of the
    ``kernels`` package this process imports), every ``configs/**/*.json`` there (the committed kernel configs),
    this module and ``mixer.py``, each as its relative name and its bytes, tracked by git or not."""
    if kernels_dir is None:
        import kernels

        kernels_dir = Path(kernels.__file__).resolve().parent
    h = hashlib.sha256()
    for name, path in _digest_files(Path(kernels_dir)):
        data = path.read_bytes()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _resume_differences(old: dict, args, res: dict) -> list[str]:
    """What differs between the earlier call's result ``old`` and this call (``args``, ``res``): "settings (...)",
    "kernels digest", "GPU/versions (...)"; empty when its records measure the same."""
    out = []
    settings = [k for k in MEASURE_ARGS if old["args"].get(k) != getattr(args, k)]
    if old.get("backend_settings") != res["backend_settings"]:
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
    import json

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
_WARM_MODULE = "nano_hybrid.bench.bench_shape_grid"
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


def warm_command(args, name: str) -> list[str]:
    """The command of the child that warms shape ``name``: this module with ``--warm-only`` at that shape and the
    arguments that choose what it compiles (backends, helion settings, seed, zxbcdt layout, device)."""
    cmd = [sys.executable, "-P", "-m", _WARM_MODULE, "--shapes", name, "--warm-only", "--baseline", args.baseline,
           "--candidate", args.candidate, "--seed", str(args.seed), "--zxbcdt-layout", args.zxbcdt_layout]
    cmd += ["--kernels-helion", args.kernels_helion] if args.kernels_helion else []
    cmd += ["--device", args.device] if args.device else []
    return cmd


def _child_env() -> dict:
    """This process's environment with PYTHONPATH led by the folders this process imports ``kernels`` and
    ``nano_hybrid`` from (in its sys.path order), so that a child started with ``python -P -m`` imports the same
    trees, and this process's pid in ``WARM_PARENT_ENV``. Triton's autotune results are not cached by the children
    (``TRITON_CACHE_AUTOTUNING=0``): their timings ran beside each other, so the measuring process times the
    baseline's autotune candidates itself, on kernels the children compiled."""
    import kernels
    import nano_hybrid

    roots = [str(Path(m.__file__).resolve().parents[1]) for m in (kernels, nano_hybrid)]
    where = {str(Path(p).resolve()): i for i, p in reversed(list(enumerate(sys.path))) if p}
    roots = sorted(dict.fromkeys(roots), key=lambda r: where.get(r, len(sys.path)))
    rest = [q for q in os.environ.get("PYTHONPATH", "").split(os.pathsep) if q and q not in roots]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(roots + rest), TRITON_CACHE_AUTOTUNING="0",
                **{WARM_PARENT_ENV: str(os.getpid())})


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill warm child ``proc`` and its process group (it leads one: ``start_new_session``), and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


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
                    _kill_group(proc)
                    rc = "timeout"
                if rc is not None:
                    del running[name]
                    finish(name, rc, took)
    finally:  # an interrupted parent leaves no child behind
        for proc, _ in running.values():
            _kill_group(proc)
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

    def stop(signum, frame):
        # SIGTERM (a stage's time limit) ends this process through the children's clean-up: they run in process
        # groups of their own, which the signal to this process's group does not reach
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: the signal keeps its handler
        previous = None
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        env = _child_env()
        for group, jobs in ((parallel, args.warm_jobs), (alone, 1)):
            shapes.update(_warm_children(args, group, jobs, log_dir, env, say))
    except OSError as e:  # no log folder: the shapes compile in the measuring process
        say(f"warm: not run ({type(e).__name__}: {e})")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    s = round(time.perf_counter() - t0, 1)
    say(f"warm: {sum(r['ok'] for r in shapes.values())} of {len(names)} shapes in {s} s")
    return {"jobs": args.warm_jobs, "s": s, "shapes": {n: shapes[n] for n in parallel + alone if n in shapes}}


def _end_with_parent(poll_s: float = 1.0) -> None:
    """End this process (exit 1) as soon as the process that started it is gone, so that a warm child whose
    measuring process was killed outright stops compiling: a daemon thread compares the parent's pid with
    ``WARM_PARENT_ENV`` (where set; it also covers a parent gone before this process got here), else with the
    parent's pid now."""
    import threading

    parent = int(os.environ.get(WARM_PARENT_ENV) or os.getppid())

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        print("warm: the process that started this one is gone; stopping", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="warm-parent-watch", daemon=True).start()


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
        print(f"warm {name}: " + ", ".join(f"{k[len('first_call_s_'):]} {v} s" for k, v in rec.items()
                                             if k.startswith("first_call_s_")), flush=True)
    return 0


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
        e = r.get("rel_err_vs_fp32")
        rows.append([name, f"{r['ms_per_call'][A]['median']:.3f}", f"{r['ms_per_call'][B]['median']:.3f}",
                     f"{r['speedup_per_call']['speedup']:.2f}",
                     f"{r['speedup_device']:.2f}" if r.get("speedup_device") else "-",
                     f"{max(e[B].values()):.2e} / {max(e[A].values()):.2e}" if e else
                     "not measured (fp32 out of memory)", f"{r['first_call_s_' + B]}"])
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
    if args.warm_only:
        return warm_main(args, backends)
    res = run(args, backends)
    out = Path(args.out) if args.out else reporting.default_out_dir()
    js, md = reporting.write_results(out, "shape_grid", res, markdown(res))
    print(markdown(res))
    print(f"wrote {js} and {md}")
    return 0 if not res["summary"]["shapes_failed"] else 1


if __name__ == "__main__":  # a --warm-jobs child runs this module with -m
    sys.exit(main())
