"""Memory planner vs measured peak memory on one GPU, and the recompute table (memory saved, time paid).

    python scripts/plan_vs_measured.py                          # one H200: ~3-4 min, mamba_ssm kernels
    python scripts/plan_vs_measured.py --backend helion --steps 5 --cases slice13-mbs2-none,slice13-mbs2-full

Each case runs in a process of its own and is a Nano-width model (``nano30b_slice`` layers: hidden 2688, 64 Mamba heads, 32 experts top-6,
vocabulary 131072; bf16, seq 8192, one process) trained for ``--steps`` steps by ``nano_hybrid.train``'s
own model, DDP, optimizer and schedule (``forward_backward``; the optimizer step as ``train_step`` runs
it) on random tokens. Per step it records ``torch.cuda.max_memory_allocated`` over the forward+backward
and over the optimizer step separately, and the step time; the first step (Adam states allocated,
kernels warmed up) is left out of the figures. After the steps it records the device memory in use outside
PyTorch's allocator (``nano_hybrid.plan.outside_allocator_gib``: what the verdict's ``CONTEXT_GIB`` stands for). The
planner (``nano_hybrid.plan``) predicts both peaks from the config alone. Writes ``plan_vs_measured_<gpu>.json``
/ ``.md`` under ``--out`` (default ``$OUT`` or ``runs/bench/<gpu>``) with two tables: planned vs measured peak per
case, and per recompute choice of the same model and micro-batch the peak, the memory saved and the step time paid.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from nano_hybrid.bench import environment, reporting, stats, training

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")


GIB = 1024**3

SLICE13 = ["model=nano30b_slice"]
SLICE5 = ["model=nano30b_slice", "model.hybrid_override_pattern=MEM*E"]
SLICE26 = ["model=nano30b_slice", "model.hybrid_override_pattern=MEMEM*EMEMEM*EMEMEM*EMEMEM"]  # nano30b's first 26


def _mb(n: int) -> list[str]:
    return [f"train.micro_batch_size={n}", f"train.global_batch_size={n}"]


SELECTIVE = ["model.recompute=selective", "model.recompute_modules=[moe,layernorm]"]
# name -> overrides (on top of COMMON); the slice13-mbs2-* cases form the recompute table
CASES = {
    "slice5-mbs4-none": [*SLICE5, *_mb(4)],
    "slice13-mbs1-none": [*SLICE13, *_mb(1)],
    "slice13-mbs2-none": [*SLICE13, *_mb(2)],
    "slice13-mbs2-selective": [*SLICE13, *_mb(2), *SELECTIVE],
    "slice13-mbs2-selective+ssd": [*SLICE13, *_mb(2), "model.recompute=selective",
                                   "model.recompute_modules=[moe,layernorm,ssd]"],
    "slice13-mbs2-full": [*SLICE13, *_mb(2), "model.recompute=full"],
    "slice26-mbs1-selective": [*SLICE26, *_mb(1), *SELECTIVE],
}
COMMON = ["data=mock", "parallel=single", "train.device=cuda", "train.precision=bf16", "train.seq_length=8192",
          "train.train_iters=100", "optim.warmup_iters=1"]


def case_config(name: str, backend: str, overrides: list[str]):
    from nano_hybrid.config import compose

    cfg = compose([*COMMON, f"kernels.backend={backend}", *CASES[name], *overrides])
    training.detach_from_run_state(cfg)
    return cfg


def _batches(n: int, mbs: int, seq: int, vocab: int, device):
    import torch

    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        tok = torch.randint(0, vocab, (mbs, seq + 1), generator=g)
        yield {"tokens": tok[:, :-1], "labels": tok[:, 1:], "position_ids": torch.arange(seq)[None].expand(mbs, seq),
               "loss_mask": torch.ones(mbs, seq)}


def measure_case(name: str, a) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from nano_hybrid.plan import make_plan, outside_allocator_gib

    cfg = case_config(name, a.backend, a.overrides)
    plan = make_plan(cfg, 1)
    rp = training.validate(cfg)
    training.init_distributed(rp, cfg)
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    t_build = time.perf_counter()
    model, optimizer, scheduler = training.build_model_and_optimizer(rp, cfg)
    build_s = time.perf_counter() - t_build
    mbs = int(cfg.train.micro_batch_size)
    ctx = training.bare_context(rp, cfg, model, optimizer, scheduler,
                                _batches(a.steps * rp.num_microbatches, mbs, rp.seq_length, int(cfg.model.vocab_size),
                                         rp.device))
    steps = []
    for _ in range(a.steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        training.forward_backward(ctx)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        fb_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with training.cpu_compat_mode(rp):  # a no-op on CUDA
            update_ok, grad_norm, _ = optimizer.step()
        scheduler.step(increment=1)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        steps.append({"fwd_bwd_s": t1 - t0, "step_s": t2 - t0, "fwd_bwd_peak_gib": fb_peak / GIB,
                      "optimizer_peak_gib": torch.cuda.max_memory_allocated() / GIB,
                      "grad_norm": float(grad_norm) if grad_norm is not None else None, "update_ok": bool(update_ok)})
    outside = outside_allocator_gib()  # what the planner's CONTEXT_GIB margin stands for
    del ctx, model, optimizer, scheduler
    gc.collect()
    torch.cuda.empty_cache()
    ps.destroy_model_parallel()
    rest = steps[1:] or steps
    fb = max(s["fwd_bwd_peak_gib"] for s in rest)
    opt = max(s["optimizer_peak_gib"] for s in rest)
    st = plan["stages"][0]
    return {
        "case": name, "overrides": [*CASES[name], *a.overrides], "pattern": plan["pattern"],
        "micro_batch_size": mbs, "recompute": plan["recompute"], "recompute_modules": plan["recompute_modules"],
        "baseline_gib": baseline / GIB, "build_s": build_s,
        "measured": {"peak_gib": max(fb, opt), "fwd_bwd_peak_gib": fb, "optimizer_peak_gib": opt,
                     "step_s_median": stats.median([s["step_s"] for s in rest]),
                     "fwd_bwd_s_median": stats.median([s["fwd_bwd_s"] for s in rest]),
                     "outside_allocator_gib": outside},
        "planned": {"peak_gib": plan["peak_gib"], "fwd_bwd_peak_gib": st["fwd_bwd_peak_gib"],
                    "optimizer_peak_gib": st["step_peak_gib"], "activations_gib": st["activations_gib"],
                    "static_gib": st["weights_gib"] + st["grads_gib"] + st["optimizer_gib"],
                    "transient_gib": st["transient_gib"], "activations_by_kind_gib": st["activations_by_kind_gib"],
                    "head_gib": st["head_gib"]},
        "steps": steps,
    }


def run(a) -> dict:
    import torch

    from nano_hybrid.config import ConfigError

    if not torch.cuda.is_available():
        raise ConfigError("plan_vs_measured.py measures GPU memory: it needs a CUDA device")
    names = [c.strip() for c in a.cases.split(",")] if a.cases else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ConfigError(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    for n in names:  # every config must compose and plan before any GPU work
        from nano_hybrid.plan import make_plan

        make_plan(case_config(n, a.backend, a.overrides), 1)
    t0 = time.perf_counter()
    results, oom, failed = [], [], []
    for n in names:
        kind, payload = measure_in_child(n, a)
        if kind == "ok":
            results.append(payload)
            r = payload
            print(f"{n}: planned {r['planned']['peak_gib']:.2f} GiB, measured {r['measured']['peak_gib']:.2f} GiB "
                  f"(fwd+bwd {r['measured']['fwd_bwd_peak_gib']:.2f}, optimizer {r['measured']['optimizer_peak_gib']:.2f}), "
                  f"step {r['measured']['step_s_median']:.3f} s", flush=True)
        elif kind == "oom":
            oom.append(n)
            print(f"{n}: CUDA out of memory ({payload})", flush=True)
        else:
            failed.append({"case": n, "error": payload})
            print(f"{n}: failed\n{payload}", flush=True)
    return {"env": environment.env_info(), "backend": a.backend, "steps": a.steps, "wall_s": time.perf_counter() - t0,
            "cases": results, "out_of_memory": oom, "failed": failed,
            "recompute_table": recompute_table(results)}


def child_command(name: str, a, out_json: str) -> list[str]:
    """The command that measures case ``name`` alone (``--worker-case``) and writes its result to ``out_json``."""
    return [sys.executable, str(environment.REPO_ROOT / "scripts" / "plan_vs_measured.py"), "--backend", a.backend, "--steps", str(a.steps),
            "--worker-case", name, "--worker-out", out_json, *a.overrides]


def measure_in_child(name: str, a, runner=subprocess.run) -> tuple[str, object]:
    """Measure one case in a process of its own: ("ok", result) | ("oom", message) | ("failed", log tail).
    One process per case: what a case leaves behind (allocator state, megatron's global MoE aux-loss tracker
    sized for its layer count, parallel state) cannot leak into the next case's peak or break it."""
    with tempfile.TemporaryDirectory() as d:
        out_json = str(Path(d) / "case.json")
        p = runner(child_command(name, a, out_json), capture_output=True, text=True)
        if p.returncode == 0 and Path(out_json).exists():
            got = json.loads(Path(out_json).read_text())
            return ("ok", got["result"]) if "result" in got else ("oom", got["out_of_memory"])
        return "failed", f"exit code {p.returncode}: " + "\n".join((p.stdout + p.stderr).splitlines()[-15:])


def worker(a) -> int:
    """``--worker-case``: measure one case, write {"result": ...} or {"out_of_memory": message} to --worker-out."""
    import torch

    from nano_hybrid.parallel import destroy_parallel

    try:
        got = {"result": measure_case(a.worker_case, a)}
    except torch.cuda.OutOfMemoryError as e:
        got = {"out_of_memory": str(e).splitlines()[0][:160]}
    finally:
        destroy_parallel()
    Path(a.worker_out).write_text(json.dumps(got))
    return 0


def recompute_table(results: list[dict]) -> list[dict]:
    """The slice13-mbs2-* cases against slice13-mbs2-none: peak, memory saved, step time paid."""
    base = next((r for r in results if r["case"] == "slice13-mbs2-none"), None)
    rows = []
    for r in results:
        if base is None or not r["case"].startswith("slice13-mbs2-"):
            continue
        m, b = r["measured"], base["measured"]
        rows.append({
            "case": r["case"], "recompute": r["recompute"], "modules": r["recompute_modules"],
            "fwd_bwd_peak_gib": m["fwd_bwd_peak_gib"], "saved_gib": b["fwd_bwd_peak_gib"] - m["fwd_bwd_peak_gib"],
            "planned_saved_gib": base["planned"]["fwd_bwd_peak_gib"] - r["planned"]["fwd_bwd_peak_gib"],
            "step_s": m["step_s_median"], "time_paid_pct": 100 * (m["step_s_median"] / b["step_s_median"] - 1),
        })
    return rows


def markdown(res: dict) -> str:
    rows = []
    for r in res["cases"]:
        p, m = r["planned"], r["measured"]
        rows.append([r["case"], len(r["pattern"]), r["micro_batch_size"],
                     r["recompute"] + (f" {','.join(r['recompute_modules'])}" if r["recompute_modules"] else ""),
                     p["fwd_bwd_peak_gib"], m["fwd_bwd_peak_gib"], 100 * (p["fwd_bwd_peak_gib"] / m["fwd_bwd_peak_gib"] - 1),
                     p["optimizer_peak_gib"], m["optimizer_peak_gib"],
                     100 * (p["optimizer_peak_gib"] / m["optimizer_peak_gib"] - 1),
                     p["peak_gib"], m["peak_gib"], 100 * (p["peak_gib"] / m["peak_gib"] - 1),
                     "-" if m.get("outside_allocator_gib") is None else m["outside_allocator_gib"]])
    out = [f"# Memory planner vs measured ({res['env'].get('gpu')}, kernels.backend={res['backend']}, "
           f"{res['steps']} steps, first left out)", "", reporting.env_markdown(res["env"]), "",
           "Peaks in GiB (torch.cuda.max_memory_allocated), seq 8192, bf16, 32 experts top-6, one GPU.", "",
           reporting.md_table(["case", "layers", "mbs", "recompute", "plan fwd+bwd", "meas fwd+bwd", "err %",
                        "plan opt step", "meas opt step", "err %", "plan peak", "meas peak", "err %",
                        "outside allocator"], rows)]
    if res["out_of_memory"]:
        out += ["", f"CUDA out of memory (not measured): {', '.join(res['out_of_memory'])}"]
    for f in res.get("failed", []):
        out += ["", f"Failed (not measured): {f['case']}", "", "```", f["error"], "```"]
    if res["recompute_table"]:
        out += ["", "## Recompute (nano30b_slice, 13 layers, mbs 2 x 8192)", "",
                reporting.md_table(["case", "fwd+bwd peak GiB", "saved GiB", "planned saved GiB", "step s", "time paid %"],
                            [[r["case"], r["fwd_bwd_peak_gib"], r["saved_gib"], r["planned_saved_gib"], r["step_s"],
                              r["time_paid_pct"]] for r in res["recompute_table"]])]
    return "\n".join(out)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="mamba_ssm", help="kernels.backend of every case (mamba_ssm | helion)")
    ap.add_argument("--steps", type=int, default=4, help="training steps per case (the first is left out)")
    ap.add_argument("--cases", default=None, help=f"comma-separated subset of: {', '.join(CASES)}")
    ap.add_argument("--out", default=None, help="output folder (default $OUT or runs/bench/<gpu>)")
    ap.add_argument("--worker-case", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    return reporting.parse_args_with_overrides(ap, argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker_case:
        return worker(a)
    return reporting.bench_main(argv, parse_args, run, lambda res, a: f"plan_vs_measured_{a.backend}", markdown)
