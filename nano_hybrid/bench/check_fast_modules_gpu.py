"""GPU check + timing of the production-speed attention and MoE layers (one GPU, bf16).

    python scripts/check_fast_modules_gpu.py [--iters 10] [--no-reference-timing]

1. Numerics at small shapes (hidden 256, seq 512, 8 experts): whole attention layers (attention_impl
   sdpa vs megatron's unfused DotProductAttention) and whole MoE layers (moe_experts_impl grouped vs
   megatron's SequentialMLP), same weights, bf16; each compared with an fp32 run of the reference
   module. Pass: error of the fast module <= 2 x error of the bf16 reference module + 1e-3 (outputs,
   input grads and weight grads).
2. Timing at Nemotron-3 Nano dims (hidden 2688; attention 32/2 heads of 128; MoE 128 experts top-6 of
   1856 + shared 3712, sigmoid router with expert bias), micro-batch 2, seq 8192: forward+backward of one
   attention layer and one MoE layer (the layers as built by nano_hybrid.model.build_model), CUDA
   events, plus peak memory. Targets: attention <= 11 ms, MoE <= 22 ms.

Writes ``$OUT/fast_modules.json`` (OUT defaults to runs/bench/h200).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import warnings
from pathlib import Path

import torch

from nano_hybrid.bench import profiling, stats
from nano_hybrid.errors import EXIT_BAD_INPUT


warnings.filterwarnings("ignore")

TARGET_MS = {"attention": 11.0, "moe": 22.0}
DEVICE = "cuda"


def _versions() -> dict:
    import megatron.core

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "megatron_core": megatron.core.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out


def _build(overrides, dtype):
    from nano_hybrid.config import compose
    from nano_hybrid.model import build_model

    cfg = compose(["kernels.backend=torch", *overrides])
    torch.manual_seed(0)
    return build_model(cfg, dtype=dtype), cfg


def _layer_grads(model, x, idx):
    """Run decoder layer idx on x [s, b, h]; return output, dx and {param name: grad} (fp32 copies)."""
    model.zero_grad(set_to_none=True)
    layer = model.decoder.layers[idx]
    xx = x.clone().requires_grad_()
    s = x.shape[0]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=x.device), 1)[None, None]  # True = masked
    out = layer(xx, attention_mask=mask)[0]
    g = torch.randn(out.shape, generator=torch.Generator(device=out.device).manual_seed(7), device=out.device)
    out.backward(g.to(out.dtype))
    grads = {}
    for n, p in layer.named_parameters():
        if p.grad is None:
            continue
        if n.endswith("weight1") or n.endswith("weight2"):
            for e in range(p.shape[0]):
                which = "linear_fc1" if n.endswith("weight1") else "linear_fc2"
                grads[f"{n[: -len('weight1')]}local_experts.{e}.{which}.weight"] = p.grad[e].float()
        else:
            grads[n] = p.grad.float()
    return out.float().detach(), xx.grad.float(), grads


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def numerics(kind: str) -> dict:
    """kind: attention (pattern '*') or moe (pattern 'E') at small shapes."""
    from nano_hybrid.model.experts import copy_grouped_weights

    small = ["model=tiny", "model.seq_length=512", "model.hybrid_override_pattern=" + ("'*'" if kind == "attention" else "E")]
    fast_impl = ["model.attention_impl=sdpa", "model.moe_experts_impl=grouped"]
    ref_impl = ["model.attention_impl=unfused", "model.moe_experts_impl=sequential"]
    fast, _ = _build(small + fast_impl, torch.bfloat16)
    ref16, _ = _build(small + ref_impl, torch.bfloat16)
    ref32, cfg = _build(small + ref_impl, torch.float32)
    copy_grouped_weights(fast, ref16)
    copy_grouped_weights(fast, ref32)
    s, b, h = 512, 2, int(cfg.model.hidden_size)
    x = torch.randn(s, b, h, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(3))
    o32, dx32, g32 = _layer_grads(ref32, x, 0)
    o16, dx16, g16 = _layer_grads(ref16, x.bfloat16(), 0)
    of, dxf, gf = _layer_grads(fast, x.bfloat16(), 0)
    rows = {"output": (_rel(of, o32), _rel(o16, o32)), "input_grad": (_rel(dxf, dx32), _rel(dx16, dx32))}
    for n, g in g32.items():
        if n in gf and n in g16:
            rows[f"grad:{n}"] = (_rel(gf[n], g), _rel(g16[n], g))
    missing = sorted(set(g32) - set(gf))
    worst = max(rows.items(), key=lambda kv: kv[1][0] - 2 * kv[1][1])
    ok = not missing and all(fe <= 2 * re + 1e-3 for fe, re in rows.values())
    return {
        "pass": ok,
        "criterion": "rel. L2 error vs fp32 reference module: fast_bf16 <= 2 * reference_bf16 + 1e-3",
        "n_compared": len(rows),
        "missing_grads": missing,
        "output_rel_err": {"fast_bf16": rows["output"][0], "reference_bf16": rows["output"][1]},
        "input_grad_rel_err": {"fast_bf16": rows["input_grad"][0], "reference_bf16": rows["input_grad"][1]},
        "worst": {"name": worst[0], "fast_bf16": worst[1][0], "reference_bf16": worst[1][1]},
        "shapes": {"seq": s, "batch": b, "hidden": h},
    }


def _sdpa_ctx(backends):
    """None: SDPA's own choice; else a comma list of SDPBackend names tried in that priority order."""
    import contextlib

    if not backends:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [getattr(SDPBackend, b.strip().upper()) for b in backends.split(",")]
    return sdpa_kernel(order, set_priority=True)


def _profile_top(step, n_iters=2, top=20) -> dict:
    """Top CUDA kernels of ``step`` by device time per iteration (``profiling.profile_device_table``),
    plus the device span / busy / idle time per iteration over back-to-back steps."""

    t = profiling.profile_device_table(step, n_iters)
    return {"rows": t["rows"][:top], **{k: t.get(k) for k in ("total_us_per_iter", "span_us_per_iter",
                                                             "busy_us_per_iter", "idle_us_per_iter")}}


ROUNDS = 5  # --rounds


def time_layer(overrides, idx, mb, seq, iters, warmup=3, sdpa_backends=None, profile_top=0, diag=False) -> dict:
    with _sdpa_ctx(sdpa_backends):
        return _time_layer(overrides, idx, mb, seq, iters, warmup, profile_top, diag)


def _round_ms(step, iters) -> float:
    """CUDA events around ``iters`` back-to-back calls: ms per call, the gaps between calls included."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        step()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def _diagnose(step, iters, rounds) -> dict:
    """Where a timed round's time goes (--diag): (1) alternating rounds timed as a whole (gaps between calls
    included) and per call (an event pair around each call, as bench_layers.py: gaps excluded); (2) one whole
    round under torch.profiler: kernel time, device span / idle, the longest idle stretches with their
    neighbouring kernels, and the host's stalling CUDA runtime calls; with the round's own event time."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    whole, per_call = [], []
    for _ in range(rounds):
        whole.append(_round_ms(step, iters))
        per_call.extend(stats.time_calls(step, iters, "cuda"))

    def med(v):
        return sorted(v)[len(v) // 2]

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        profiled_ms = _round_ms(step, iters)
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/trace.json"
        prof.export_chrome_trace(path)
        import json as _json

        with open(path) as f:
            tr = _json.load(f)
    events = tr["traceEvents"] if isinstance(tr, dict) else tr
    dev = [e for e in events if e.get("ph") == "X" and e.get("cat") in profiling.DEVICE_EVENT_CATS]
    table = profiling.kernel_table(dev, iters)
    return {
        "round_ms_median": med(whole), "per_call_ms_median": med(per_call), "rounds": rounds, "iters": iters,
        "profiled_round_event_ms_per_iter": profiled_ms,
        "profiled_round": {k: table.get(k) for k in ("total_us_per_iter", "span_us_per_iter", "busy_us_per_iter",
                                                    "idle_us_per_iter")},
        "longest_idle": profiling.device_gaps(dev, top=10, min_us=10.0),
        "stalling_runtime_calls": profiling.runtime_sync_calls(events, iters),
    }


def _time_layer(overrides, idx, mb, seq, iters, warmup, profile_top, diag=False) -> dict:
    model, cfg = _build(overrides, torch.bfloat16)
    model.train()
    layer = model.decoder.layers[idx]
    h = int(cfg.model.hidden_size)
    x = torch.randn(seq, mb, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(seq, mb, h, device="cuda", dtype=torch.bfloat16)
    mask = None

    def step():
        # grads set to None first, as bench_layers.py does: the layer's own fwd+bwd, without adding each grad to
        # the last step's (x.grad and the parameters: five elementwise adds, ~150 us per step at Nano dims; in
        # training x.grad is never accumulated and the parameter grads go to megatron DDP's buffer, which the
        # step time, not the layer time, counts)
        model.zero_grad(set_to_none=True)
        x.grad = None
        out = layer(x, attention_mask=mask)[0]
        out.backward(g)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    # ROUNDS rounds of `iters` back-to-back steps (the host enqueues ahead, as in training, so the
    # per-layer Python launch latency is not added to every iteration); ms per step = round / iters

    with profiling.SmiSampler(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]) as smi:
        times = sorted(_round_ms(step, iters) for _ in range(ROUNDS))
    res = {
        "median_ms": times[len(times) // 2],
        "min_ms": times[0],
        "max_ms": times[-1],
        "iters": iters,
        "rounds": ROUNDS,
        "round_ms": times,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30,
        "layer_params": sum(p.numel() for p in layer.parameters()),
        "gpu_during_rounds": smi.summary(),
    }
    if diag:
        res["diag"] = _diagnose(step, iters, ROUNDS)
        dg = res["diag"]
        print(f"  diag: round {dg['round_ms_median']:.3f} ms/call, per call {dg['per_call_ms_median']:.3f} ms; profiled round "
              f"{dg['profiled_round_event_ms_per_iter']:.3f} ms/call: kernels {dg['profiled_round']['total_us_per_iter']:.0f} us, "
              f"span {dg['profiled_round']['span_us_per_iter']:.0f} us, idle {dg['profiled_round']['idle_us_per_iter']:.0f} us",
              flush=True)
        print(f"  longest idle: {dg['longest_idle'][:5]}", flush=True)
        print(f"  stalling runtime calls: {dg['stalling_runtime_calls']}", flush=True)
    print(f"  GPU during the timed rounds: {res['gpu_during_rounds']}", flush=True)
    if profile_top:
        prof = _profile_top(step, n_iters=3, top=profile_top)
        res["profile_top_kernels"] = prof.pop("rows")
        res["profile_device"] = prof
        for r in res["profile_top_kernels"]:
            print(f"  {r['us_per_iter']:9.1f} us  x{r['calls_per_iter']:.0f}  {r['kernel']}", flush=True)
        print(f"  device per step: kernels {prof['total_us_per_iter']:.0f} us, busy {prof.get('busy_us_per_iter') or 0:.0f} us, "
              f"span {prof.get('span_us_per_iter') or 0:.0f} us, idle {prof.get('idle_us_per_iter') or 0:.0f} us", flush=True)
    del model, layer, x, g
    torch.cuda.empty_cache()
    return res


def _diag_lines(v: dict) -> list[str]:
    """Markdown bullets for a timed layer's GPU state during the rounds and its --diag results."""
    out = []
    g = v.get("gpu_during_rounds") or {}
    if g.get("samples"):
        clk, pw = g.get("clocks.sm") or {}, g.get("power.draw") or {}
        reasons = next((g[k] for k in g if k.startswith("clocks_")), None)
        out.append(f"- GPU during the timed rounds ({g['samples']} nvidia-smi samples): SM clock min / median / max "
                   f"{clk.get('min')} / {clk.get('median')} / {clk.get('max')} MHz, power max {pw.get('max')} W, "
                   f"clock-event reasons {reasons} (0x4: software power cap)")
    d = v.get("diag")
    if d:
        pr = d["profiled_round"]
        out.append(f"- round timing {d['round_ms_median']:.3f} ms per step, per-call events {d['per_call_ms_median']:.3f} ms "
                   f"(the gaps between calls are the difference)")
        out.append(f"- one profiled round of {d['iters']} steps: {d['profiled_round_event_ms_per_iter']:.3f} ms per step by its "
                   f"events; kernels {pr['total_us_per_iter']:.0f} us, span {pr['span_us_per_iter']:.0f} us, idle "
                   f"{pr['idle_us_per_iter']:.0f} us per step; stalling runtime calls {d['stalling_runtime_calls'] or 'none'}")
    return out


def _markdown(r: dict) -> str:
    t = r["timing"]
    sh = t["shapes"]
    lines = [
        f"# Attention and MoE layers, forward+backward ({r['gpu']}, {r['date']})",
        "",
        f"torch {r['versions']['torch']}, triton {r['versions']['triton']}, megatron-core "
        f"{r['versions']['megatron_core']}; bf16, micro-batch {sh['micro_batch']}, seq {sh['seq']}, Nano dims; "
        "`scripts/check_fast_modules_gpu.py` (CUDA events around rounds of back-to-back fwd+bwd steps; "
        "median of the rounds' ms per step).",
        "",
        "| layer | implementation | ms | peak GB | target ms |",
        "|---|---|---|---|---|",
    ]
    for key, v in t.items():
        if key == "shapes":
            continue
        kind, impl = key.split("_", 1)
        if "error" in v:
            lines.append(f"| {kind} | {impl} | failed: {v['error'][:80]} | | |")
            continue
        lines.append(f"| {kind} | {impl} | {v['median_ms']:.2f} | {v['peak_mem_gb']:.1f} | {v.get('target_ms', '')} |")
    for key, v in t.items():
        if key == "shapes" or "error" in v:
            continue
        notes = _diag_lines(v)
        if notes:
            lines += ["", f"{key}:", *notes]
    lines += ["", "Numerics (small shapes, bf16, rel. L2 error vs an fp32 run of megatron's module):", ""]
    for kind, n in r["numerics"].items():
        lines.append(f"- {kind}: pass={n['pass']}; output {n['output_rel_err']['fast_bf16']:.2e} "
                     f"(megatron module in bf16: {n['output_rel_err']['reference_bf16']:.2e}); worst "
                     f"{n['worst']['name']} {n['worst']['fast_bf16']:.2e} vs {n['worst']['reference_bf16']:.2e}")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=10, help="back-to-back steps per timed round")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per layer (median reported)")
    ap.add_argument("--mb", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--smoke-cpu", action="store_true",
                    help="run only the numerics part on CPU (checks this script's logic; no timing, no JSON)")
    ap.add_argument("--no-reference-timing", action="store_true",
                    help="skip timing megatron's unfused attention / SequentialMLP (~2 s each, 80 GB peak)")
    ap.add_argument("--sdpa-backends", default="",
                    help="extra attention variants, ';'-separated priority lists of SDPBackend names, "
                         "e.g. 'cudnn_attention,flash_attention;flash_attention'")
    ap.add_argument("--profile-top", type=int, default=0, help="profile each timed layer: top-N CUDA kernels")
    ap.add_argument("--skip-numerics", action="store_true")
    ap.add_argument("--diag", action="store_true",
                    help="per timed fast layer: round vs per-call timing, a profiled whole round (idle stretches, "
                         "stalling runtime calls)")
    ap.add_argument("--kinds", default="attention,moe", help="layer kinds to time: attention, moe or both")
    return ap


def smoke_cpu() -> int:
    """``--smoke-cpu``: the numerics part only, on CPU (checks this module's logic; no timing, no JSON)."""
    global DEVICE
    DEVICE = "cpu"
    from nano_hybrid.config import compose
    from nano_hybrid.parallel import destroy_parallel, initialize_parallel

    initialize_parallel(compose(["model=tiny", "parallel=single", "kernels.backend=torch"]))
    res = {k: numerics(k) for k in ("attention", "moe")}
    destroy_parallel()
    print(json.dumps(res, indent=2))
    return 0 if all(v["pass"] for v in res.values()) else 1


def timing_variants(args, kinds: set[str]) -> list[tuple]:
    """(kind, impl, overrides, SDPA backends) per layer to time: the fast modules, the extra SDPA backend lists,
    megatron's reference implementations (unless --no-reference-timing); only the ``kinds`` asked for."""
    variants = [("attention", "sdpa", ["model.hybrid_override_pattern='*'", "model.attention_impl=sdpa"], None),
                ("moe", "grouped", ["model.hybrid_override_pattern=E", "model.moe_experts_impl=grouped"], None)]
    for be in filter(None, args.sdpa_backends.split(";")):
        variants.append(("attention", f"sdpa[{be}]", ["model.hybrid_override_pattern='*'", "model.attention_impl=sdpa"], be))
    if not args.no_reference_timing:
        variants += [("attention", "unfused", ["model.hybrid_override_pattern='*'", "model.attention_impl=unfused"], None),
                     ("moe", "sequential", ["model.hybrid_override_pattern=E", "model.moe_experts_impl=sequential"], None)]
    return [v for v in variants if v[0] in kinds]


def time_variants(args, variants: list[tuple], timing: dict) -> None:
    """Each variant's layer timed at Nano's dims into ``timing`` (a variant that fails is recorded, the next runs)."""
    nano = ["model=nano30b", "model.vocab_size=1024", f"model.seq_length={args.seq}"]
    for kind, impl, ov, be in variants:
        try:
            fast = impl in ("sdpa", "grouped") or bool(be)
            r = time_layer(nano + ov, 0, args.mb, args.seq, args.iters, sdpa_backends=be,
                           profile_top=args.profile_top if fast else 0, diag=args.diag and fast)
        except Exception as e:  # a backend SDPA cannot use for these inputs: record it, go on
            timing[f"{kind}_{impl}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"timing {kind} {impl}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        if impl.startswith("sdpa") or impl == "grouped":
            r["target_ms"] = TARGET_MS[kind]
            r["meets_target"] = r["median_ms"] <= TARGET_MS[kind]
        timing[f"{kind}_{impl}"] = r
        print(f"timing {kind} {impl}: {r['median_ms']:.2f} ms (peak {r['peak_mem_gb']:.1f} GB)", flush=True)


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    global ROUNDS
    ROUNDS = max(1, args.rounds)
    if args.smoke_cpu:
        return smoke_cpu()
    if not torch.cuda.is_available():
        print("error: scripts/check_fast_modules_gpu.py needs a CUDA GPU", file=sys.stderr)
        return EXIT_BAD_INPUT
    from nano_hybrid.config import compose
    from nano_hybrid.parallel import destroy_parallel, initialize_parallel

    out_dir = Path(os.environ.get("OUT", "runs/bench/h200"))
    out_dir.mkdir(parents=True, exist_ok=True)
    initialize_parallel(compose(["model=tiny", "parallel=single", "kernels.backend=torch"]))
    result = {
        "script": "scripts/check_fast_modules_gpu.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "versions": _versions(),
        "dtype": "bf16",
        "numerics": {},
        "timing": {},
    }
    for kind in ("attention", "moe") if not args.skip_numerics else ():
        result["numerics"][kind] = numerics(kind)
        print(f"numerics {kind}: {json.dumps(result['numerics'][kind]['output_rel_err'])} "
              f"pass={result['numerics'][kind]['pass']}", flush=True)
    result["timing"]["shapes"] = {"micro_batch": args.mb, "seq": args.seq, "hidden": 2688, "attention_heads": 32,
                                  "query_groups": 2, "kv_channels": 128, "experts": 128, "topk": 6, "moe_ffn": 1856,
                                  "shared_expert_ffn": 3712}
    kinds = {k.strip() for k in args.kinds.split(",") if k.strip()}
    if not kinds <= {"attention", "moe"}:
        ap.error(f"--kinds: choose from attention, moe; got {sorted(kinds)}")
    time_variants(args, timing_variants(args, kinds), result["timing"])
    destroy_parallel()
    stem = "fast_modules_profile" if args.skip_numerics else "fast_modules"
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(_markdown(result))
    print(f"wrote {path} and {stem}.md")
    return 0 if all(v["pass"] for v in result["numerics"].values()) else 1
