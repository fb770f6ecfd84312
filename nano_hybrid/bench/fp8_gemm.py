"""FP8 GEMM microbenchmark: bf16 vs torchao float8 tensorwise vs rowwise at the Nano linear shapes (fwd+bwd).

    python scripts/bench_fp8_gemm.py                       # M=16384, the three Nano shapes, H200: ~1-2 min
    python scripts/bench_fp8_gemm.py --m 64 --shapes 256x512 --warmup 1 --iters 3   # CPU smoke run: ~10 s on 2 cores
                                                          # (eager; torch's CPU _scaled_mm takes ~0.3 s per fp8 call
                                                          # even at this size, hours at the Nano shapes)

Per shape (K -> N) and arm: ``y = x @ w.T`` with x [M, K], w [N, K] in bf16 and ``y.backward(dy)`` (the three GEMMs
of a linear: output, grad_input, grad_weight), the fp8 arms through ``nano_hybrid.model.fp8.fp8_linear`` (the
matmul the swapped model layers call; torch.compile'd on CUDA as torchao recommends, and the bf16 arm compiled the
same way). Times: median / p90 of --iters calls (CUDA events) after --warmup calls (compilation). Error: relative
Frobenius error of y, dx and dw against the fp32 matmul of the same bf16 inputs, with bf16's own error for scale.
Writes fp8_gemm_m<M>.json (+ .md) to --out (default $OUT or runs/bench/<gpu>).
"""

from __future__ import annotations

import argparse

from nano_hybrid.bench import environment, reporting, stats

# (name, K, N): the Nano-30B GEMMs (hidden 2688): mamba in_proj, mamba out_proj, an expert's fc1 (1856 ffn)
NANO_SHAPES = (("mamba_in_proj", 2688, 10304), ("mamba_out_proj", 4096, 2688), ("expert_fc1", 2688, 1856))
ARMS = ("bf16", "tensorwise", "rowwise")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=16384, help="rows (tokens) per GEMM (default 16384)")
    p.add_argument("--shapes", default=None,
                   help="comma-separated KxN (default: " + ", ".join(f"{k}x{n}" for _, k, n in NANO_SHAPES) + ")")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per arm (compilation; default 5)")
    p.add_argument("--iters", type=int, default=30, help="timed calls per arm (default 30)")
    p.add_argument("--out", default=None, help="output dir (default $OUT or runs/bench/<gpu>)")
    a = p.parse_args(argv)
    if a.m < 16 or a.iters < 1 or a.warmup < 0:
        p.error("--m must be >= 16, --iters >= 1, --warmup >= 0")
    a.shape_list = list(NANO_SHAPES) if a.shapes is None else [_shape(p, s) for s in a.shapes.split(",")]
    return a


def _shape(p, s: str):
    try:
        k, n = (int(v) for v in s.lower().split("x"))
    except ValueError:
        p.error(f"--shapes: {s!r} is not KxN")
    return (f"{k}x{n}", k, n)


def _matmul(arm: str, device):
    import torch

    from nano_hybrid.model.fp8 import fp8_linear

    if arm == "bf16":
        def mm(x, w):
            return x @ w.t()
        return torch.compile(mm) if device.type == "cuda" else mm
    return lambda x, w: fp8_linear(x, w, arm)


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def bench_shape(m: int, k: int, n: int, a, device) -> dict:
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device, torch.bfloat16)
    dy = torch.randn(m, n, generator=g).to(device, torch.bfloat16)
    xf, wf = x.float().requires_grad_(True), w.float().requires_grad_(True)
    yf = xf @ wf.t()
    yf.backward(dy.float())
    ref = (yf.detach(), xf.grad, wf.grad)
    del xf, wf, yf
    out = {}
    for arm in ARMS:
        mm = _matmul(arm, device)
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

        def step():
            xi.grad = wi.grad = None
            y = mm(xi, wi)
            y.backward(dy)
            return y

        for _ in range(a.warmup):
            step()
        y = step()
        errs = {nm: rel_err(o, r) for nm, o, r in zip(("y", "dx", "dw"), (y.detach(), xi.grad, wi.grad), ref)}
        ms = stats.time_calls(step, a.iters, device)
        s = stats.summarize(ms)
        out[arm] = {"ms_fwd_bwd": s, "tflops": 3 * 2 * m * k * n / (s["median"] * 1e-3) / 1e12, "rel_err": errs}
        del xi, wi, y
    base = out["bf16"]["ms_fwd_bwd"]["median"]
    for arm in ARMS[1:]:
        out[arm]["speedup_vs_bf16"] = base / out[arm]["ms_fwd_bwd"]["median"]
    return out


def run(a) -> dict:
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = {name: {"k": k, "n": n, "arms": bench_shape(a.m, k, n, a, device)} for name, k, n in a.shape_list}
    import torchao

    return {"benchmark": "fp8_gemm", "env": {**environment.env_info(), "torchao": torchao.__version__},
            "m": a.m, "warmup": a.warmup, "iters": a.iters, "device": device.type,
            "compiled": device.type == "cuda", "shapes": shapes}


def markdown(res: dict) -> str:
    lines = [f"# FP8 GEMM fwd+bwd, M={res['m']} ({res['env'].get('gpu') or 'cpu'}, torchao {res['env']['torchao']})",
             "", reporting.env_markdown(res["env"]), "",
             f"y = x @ w.T and its backward (3 GEMMs), bf16 inputs; {res['iters']} timed calls after {res['warmup']} "
             f"warm-up; {'torch.compile' if res['compiled'] else 'eager'}. Relative error vs fp32.", ""]
    rows = []
    for name, sh in res["shapes"].items():
        for arm, r in sh["arms"].items():
            e = r["rel_err"]
            rows.append([f"{name} {sh['k']}->{sh['n']}", arm, f"{r['ms_fwd_bwd']['median']:.3f}",
                         f"{r['ms_fwd_bwd']['p90']:.3f}", f"{r['tflops']:.0f}",
                         "1" if arm == "bf16" else f"{r['speedup_vs_bf16']:.2f}x",
                         f"{e['y']:.4f}", f"{e['dx']:.4f}", f"{e['dw']:.4f}"])
    lines.append(reporting.md_table(["GEMM", "arm", "median ms", "p90 ms", "TFLOP/s", "vs bf16", "err y", "err dx",
                                     "err dw"], rows))
    return "\n".join(lines)


def main(argv=None) -> int:
    return reporting.bench_main(argv, parse_args, run, lambda res, a: f"fp8_gemm_m{res['m']}", markdown)
