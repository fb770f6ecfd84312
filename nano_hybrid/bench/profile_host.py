"""Host (CPU) cost of one Mamba-2 mixer op forward+backward per kernel backend, on a GPU.

A kernel backend can lose wall time without losing device time: every kernel launch costs Python and
driver time on the host, and any device-to-host synchronisation stalls the queue. This script shows
where that time goes, per backend, for the op ``scripts/bench_kernels.py`` times:

    python scripts/profile_host.py --backends mamba_ssm,helion --shape nano

Per backend: ``enqueue_ms`` (host time to issue one op with the queue never drained: the launch cost),
``wall_ms`` (synchronised time per op over the same calls: max(host, device) when nothing stalls),
``device_ms`` (sum of kernel times from torch.profiler), the number of synchronising CUDA runtime
calls per op (cudaStreamSynchronize, cudaDeviceSynchronize, cudaMemcpy*), and the top host functions
by own time (cProfile). Writes ``host_profile_<shape>.json`` to $OUT (default runs/bench/<gpu>).

At a shape with packed documents, ``--seq-idx`` says what each call gets: ``shared`` (default) the same seq_idx
tensor every call, as every Mamba layer of a step gets it (the kernels' seq_idx work, ``kernels.derived``, is built
at the first call only); ``per-call`` a new tensor each call, as layers that each build their own seq_idx (that
work then runs every call; the copies are made before each timed loop, not in it); ``both`` profiles each backend
both ways. A per-call arm is named ``<backend> [seq_idx per call]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

from nano_hybrid.bench import environment, mixer, reporting
from nano_hybrid.errors import EXIT_BAD_INPUT


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync", "cudaEventSynchronize")


def profile_backend(name: str, shape, params, iters: int, top: int, seq_idx=None,
                    seq_idx_per_call: bool = False) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nano_hybrid.bench.arms import op_backend, op_fused_norm, parse_op_arm

    arm = parse_op_arm(name)
    op = mixer.MixerOp(op_backend(arm), shape, params, torch.device("cuda"), torch.bfloat16, seq_idx,
                       fused_norm=op_fused_norm(arm))

    fresh = seq_idx_per_call and seq_idx is not None
    copies: list = []

    def prepare(n: int) -> None:
        """A new seq_idx tensor for each of the next n calls (per call), made before they are timed."""
        if fresh:
            copies[:] = [seq_idx.clone() for _ in range(n)]
            torch.cuda.synchronize()

    def call():
        if fresh:
            op.seq_idx = copies.pop()
        op.mixer_fwdbwd()

    prepare(3)
    for _ in range(3):
        call()
    prepare(iters)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    enqueue_ms = (t1 - t0) * 1e3 / iters
    wall_ms = (t2 - t0) * 1e3 / iters
    prepare(iters)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    device_us = 0.0
    syncs: dict[str, float] = {}
    launches = 0.0
    for e in prof.key_averages():
        dt = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0
        if e.device_type is not None and str(e.device_type).endswith("CUDA"):
            device_us += dt
        if any(e.key.startswith(s) for s in SYNC_CALLS):
            syncs[e.key] = e.count / iters
        if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"):
            launches += e.count / iters
    prepare(iters)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(iters):
        call()
    torch.cuda.synchronize()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    rows = []
    st = pstats.Stats(pr)
    for (fname, line, func), (cc, nc, tt, ct, _) in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]:
        rows.append({"function": f"{Path(fname).name}:{line}:{func}", "calls_per_op": nc / iters,
                     "own_us_per_op": tt * 1e6 / iters, "cum_us_per_op": ct * 1e6 / iters})
    del op
    return {"enqueue_ms": enqueue_ms, "wall_ms": wall_ms, "device_ms": device_us / 1e3 / iters,
            "kernel_launches_per_op": launches, "sync_calls_per_op": syncs, "top_own_time": rows,
            "cprofile_text": buf.getvalue()[-6000:]}


def profile_arms(backends: str, seq_idx: str, docs: int) -> list[tuple[str, str, bool]]:
    """(arm name, backend spec, seq_idx per call) for each profile ``main`` runs: each backend once, or, with packed
    documents (``docs`` > 1), once per ``--seq-idx`` way; a per-call arm is named ``<backend> [seq_idx per call]``."""
    ways = {"shared": (False,), "per-call": (True,), "both": (False, True)}[seq_idx] if docs > 1 else (False,)
    return [(f"{b} [seq_idx per call]" if per_call else b, b, per_call)
            for b in backends.split(",") for per_call in ways]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="mamba_ssm,helion",
                    help="comma list of backend[:kernels.helion.<setting>=value...][:model.mamba_fused_norm=true]")
    ap.add_argument("--shape", default="nano", choices=sorted(set(mixer.SHAPES) | set(mixer.GRID)),
                    help="a benchmark shape or a shape of the grid (bench_shape_grid.py; packed documents pass seq_idx)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--seq-idx", default="shared", choices=("shared", "per-call", "both"),
                    help="packed documents: the same seq_idx tensor every call (shared, as a step's layers get it), "
                         "a new copy each call (per-call), or each backend both ways")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from nano_hybrid.bench.arms import parse_op_arm

    for spec in args.backends.split(","):
        try:
            parse_op_arm(spec)
        except ValueError as e:
            ap.error(str(e))
    import torch

    if not torch.cuda.is_available():
        print("error: scripts/profile_host.py needs a CUDA GPU", file=sys.stderr)
        return EXIT_BAD_INPUT
    from kernels.causal_conv1d import docs_seq_idx

    shape, docs = (mixer.SHAPES[args.shape], 1) if args.shape in mixer.SHAPES else mixer.GRID[args.shape]
    params = mixer.make_params(shape, torch.device("cuda"), torch.bfloat16, 0)
    seq_idx = docs_seq_idx(shape.batch, shape.seqlen, shape.seqlen, docs, "cuda")
    res = {"benchmark": "profile_host", "env": environment.env_info(), "args": vars(args), "shape": args.shape,
           "docs_per_sequence": docs, "backends": {}}
    for name, spec, per_call in profile_arms(args.backends, args.seq_idx, docs):
        r = profile_backend(spec, shape, params, args.iters, args.top, seq_idx, seq_idx_per_call=per_call)
        r["seq_idx"] = None if docs == 1 else ("per-call" if per_call else "shared")
        res["backends"][name] = r
        print(f"== {name}: enqueue {r['enqueue_ms']:.3f} ms/op, wall {r['wall_ms']:.3f} ms/op, device "
              f"{r['device_ms']:.3f} ms/op, launches {r['kernel_launches_per_op']:.0f}/op, syncs {r['sync_calls_per_op']}")
        print(r["cprofile_text"][-3500:])
    out = Path(args.out) if args.out else reporting.default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"host_profile_{args.shape}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {path}")
    return 0
