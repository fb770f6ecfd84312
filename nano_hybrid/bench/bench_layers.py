"""Forward+backward time per layer kind (M, E, *) of our megatron-core layers at Nano dims, the
52-layer estimate, and the Mamba-2 layer (with its projections) per kernel backend side by side.

    python scripts/bench_layers.py                                     # mamba_ssm on GPU, mbs 2, seq 8192, bf16
    python scripts/bench_layers.py --backends mamba_ssm,helion         # + Mamba layer A/B and projected 52-layer ratio
    python scripts/bench_layers.py --backends mamba_ssm,helion,helion:zxbcdt_copy   # + helion with megatron's zxbcdt copy
    python scripts/bench_layers.py --backends torch --micro-batch 1 --seq 128 model=tiny   # CPU smoke size

Everything after the --flags is a Hydra override (default model=nano30b). The layers are built with
``nano_hybrid.model.build_model`` (our layer spec: SDPA attention, grouped-GEMM MoE, backend Mamba
mixers) for the pattern ``M*E`` (one layer of each kind) with the full model's dims, and timed one
at a time on random hidden states [seq, batch, hidden] (CUDA events, medians). "rest" = the whole
3-layer model's fwd+bwd (embedding, final norm, LM head, loss) minus its three layers.

52-layer estimate = n_M * M + n_E * E + n_* * attention + rest, with the counts of the full pattern
(model.hybrid_override_pattern of the composed config: 23 M, 23 E, 6 * for nano30b).
With several backends, the M layer runs once per backend per round (ABBA order, plus an A-vs-A
control); the projected 52-layer speedup of backend B is est_A / est_B (E, *, rest shared).
Writes layers_<model>_<backends>.json (+ .md) to $OUT (default runs/bench/<gpu>).
"""

from __future__ import annotations

import argparse

from nano_hybrid.bench import environment, reporting, stats, training
from nano_hybrid.bench.arms import set_kernel_backend
from nano_hybrid.errors import ConfigError


KIND_NAMES = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}


def _backend(spec: str, cfg):
    """A --backends entry -> (KernelBackend, fused_norm): a backend name, optionally with ``kernels.helion.<setting>=value``
    keys (``helion:kernels.helion.save_conv_states=false``), resolved as a training run resolves it (the composed
    config's ``kernels.helion`` plus the entry's keys, ``arms.arm_backends``), and ``model.mamba_fused_norm=true|false``
    (default: the composed config's); or "helion:zxbcdt_copy" (the helion backend with the mixer's zxbcdt copy that
    megatron makes for mamba-ssm, to measure what skipping it gains)."""
    import dataclasses

    from nano_hybrid.bench.arms import FUSED_NORM, Arm, arm_backends, parse_op_arm
    from nano_hybrid.model.config import model_dict

    fused = model_dict(cfg.model)["mamba_fused_norm"]
    name, _, opt = spec.partition(":")
    if opt == "zxbcdt_copy":
        return dataclasses.replace(arm_backends(cfg, [Arm(name)])[Arm(name)], strided_zxbcdt=False), fused
    try:
        arm = parse_op_arm(spec)
    except ValueError as e:
        raise ConfigError(f"--backends: {e} (or helion:zxbcdt_copy)") from None
    ov = dict(arm.overrides)
    fused = ov.pop(FUSED_NORM, fused)  # a boolean (parse_arm checks it)
    arm = Arm(arm.backend, tuple(ov.items()))
    return arm_backends(cfg, [arm])[arm], fused


def _use(model, arm) -> None:
    """Switch the model's Mamba mixers to an arm (``_backend``'s pair)."""
    from nano_hybrid.bench.arms import set_fused_norm

    backend, fused = arm
    set_kernel_backend(model, backend)
    set_fused_norm(model, fused)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="mamba_ssm",
                   help="comma-separated kernel backends for the Mamba layer, each backend[:kernels.helion.<setting>="
                        "value...][:model.mamba_fused_norm=true|false] or helion:zxbcdt_copy; the first is the baseline")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--no-control", action="store_true", help="skip the A-vs-A control of the Mamba layer")
    p.add_argument("--n-boot", type=int, default=2000)
    p.add_argument("--out", default=None)
    a = reporting.parse_args_with_overrides(p, argv)
    a.backend_list = a.arms
    if not a.backend_list or len(set(a.backend_list)) != len(a.backend_list):
        p.error("--backends must list distinct backends (the A-vs-A control is built in)")
    for k in ("micro_batch", "seq", "rounds", "iters"):
        if getattr(a, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    return a


def pattern_counts(pattern: str) -> dict[str, int]:
    body = pattern.replace("|", "")
    unknown = sorted(set(body) - set(KIND_NAMES))
    if unknown:
        raise ValueError(f"pattern {pattern!r} has layer symbols this benchmark does not know: {unknown}")
    return {k: body.count(k) for k in KIND_NAMES if body.count(k)}


def estimate(per_kind_ms: dict[str, float], counts: dict[str, int], rest_ms: float) -> dict:
    missing = [k for k in counts if k not in per_kind_ms]
    if missing:
        raise ValueError(f"no timing for layer kind(s) {missing}")
    parts = {KIND_NAMES[k]: counts[k] * per_kind_ms[k] for k in counts}
    total = sum(parts.values()) + rest_ms
    return {"total_ms": total, "parts_ms": {**parts, "rest": rest_ms},
            "shares": {k: v / total for k, v in {**parts, "rest": rest_ms}.items()}}


def layer_fns(a, cfg, model, bench_pattern: str, device, dtype) -> dict:
    """Timed closures on fixed inputs: one per layer kind of ``bench_pattern`` (the layer's fwd+bwd on a hidden
    state) and ``"model"`` (the whole model's fwd+bwd from tokens)."""
    import torch

    layers = list(model.decoder.layers)
    if len(layers) != len(bench_pattern):
        raise RuntimeError(f"built {len(layers)} layers for pattern {bench_pattern!r}")
    mask = training.causal_mask_for(cfg, a.seq, device)
    b, s, h = a.micro_batch, a.seq, int(cfg.model.hidden_size)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(s, b, h, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
    dy = torch.randn(s, b, h, generator=g).to(device=device, dtype=dtype)
    vocab = int(cfg.model.vocab_size)
    tokens = torch.randint(0, vocab, (b, s), generator=g).to(device)
    labels = torch.randint(0, vocab, (b, s), generator=g).to(device)
    pos = torch.arange(s, device=device).unsqueeze(0).expand(b, s)

    def layer_fn(layer):
        def f():
            model.zero_grad(set_to_none=True)
            x.grad = None
            out = layer(hidden_states=x, attention_mask=mask)
            if isinstance(out, tuple):
                out = out[0]
            out.backward(dy)
        return f

    def model_fn():
        model.zero_grad(set_to_none=True)
        loss = model(tokens, pos, mask, labels=labels)
        loss.float().mean().backward()

    fns = {sym: layer_fn(layer) for sym, layer in zip(bench_pattern, layers)}
    fns["model"] = model_fn
    return fns


def time_layers(a, model, fns: dict, backends: dict, labels_m: list[str], device) -> dict:
    """Warm-up, then ``a.rounds`` rounds: the Mamba layer per arm in ABBA order (A-vs-A control included), the
    other layers and the model under the first backend; per-call ms per key (``M[<arm>]``, layer kinds, model)."""
    import torch

    arms = a.backend_list + ([] if a.no_control else [a.backend_list[0]])
    # warm-up every backend's Mamba layer and the other measurements
    for bk in a.backend_list:
        _use(model, backends[bk])
        for _ in range(a.warmup):
            fns["M"]()
    _use(model, backends[a.backend_list[0]])
    for key, f in fns.items():
        if key != "M":
            for _ in range(a.warmup):
                f()
    stats.sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    times = {f"M[{lab}]": [] for lab in labels_m}
    times.update({key: [] for key in fns if key != "M"})
    for order in stats.alternating_order(len(arms), a.rounds):
        for i in order:
            _use(model, backends[arms[i]])
            times[f"M[{labels_m[i]}]"] += stats.time_calls(fns["M"], a.iters, device)
        _use(model, backends[a.backend_list[0]])
        for key in fns:
            if key != "M":
                times[key] += stats.time_calls(fns[key], a.iters, device)
    return times


def run(a) -> dict:
    import torch
    from omegaconf import open_dict

    from nano_hybrid.config import compose
    from nano_hybrid.model import build_model
    from nano_hybrid.parallel import destroy_parallel, initialize_parallel

    cfg = compose(["model=nano30b", "parallel=single", *a.overrides])
    full_pattern = str(cfg.model.hybrid_override_pattern)
    counts = pattern_counts(full_pattern)
    bench_pattern = "".join(k for k in ("M", "*", "E", "-") if k in counts)
    with open_dict(cfg):
        cfg.model.hybrid_override_pattern = bench_pattern
        cfg.kernels.backend = a.backend_list[0].partition(":")[0]
        cfg.model.seq_length = max(int(cfg.model.seq_length), a.seq)
    backends = {b: _backend(b, cfg) for b in a.backend_list}  # fail early, one clear message
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype or ("bf16" if cuda else "fp32")]
    if dtype == torch.bfloat16 and not cuda:
        raise ConfigError("--dtype bf16 needs a CUDA GPU (CPU runs in fp32)")
    labels_m = stats.arm_labels(a.backend_list + ([] if a.no_control else [a.backend_list[0]]))

    initialize_parallel(cfg)
    try:
        model = build_model(cfg, device=device, dtype=dtype)
        fns = layer_fns(a, cfg, model, bench_pattern, device, dtype)
        times = time_layers(a, model, fns, backends, labels_m, device)
        peak_gb = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    finally:
        destroy_parallel()
    return result(a, cfg, full_pattern, counts, bench_pattern, dtype, labels_m, times, peak_gb,
                  {spec: backends[spec][1] for spec in a.backend_list})


def result(a, cfg, full_pattern, counts, bench_pattern, dtype, labels_m, times, peak_gb, arm_fused=None) -> dict:
    """The JSON record: per-kind medians, the full model's projected step per backend, the Mamba layer's ratios;
    ``arm_fused``: each --backends entry's model.mamba_fused_norm."""
    from nano_hybrid.model.config import model_dict

    summ = {k: stats.summarize(v) for k, v in times.items()}
    base = a.backend_list[0]
    med = {k: v["median"] for k, v in summ.items()}
    layer_sum = med[f"M[{base}]"] + sum(med[k] for k in bench_pattern if k != "M")
    rest = max(med["model"] - layer_sum, 0.0)
    per_backend = {}
    for lab in labels_m:
        per_kind = {k: med[k] for k in bench_pattern if k != "M"}
        per_kind["M"] = med[f"M[{lab}]"]
        per_backend[lab] = estimate(per_kind, counts, rest)
    ratios = {}
    for lab in labels_m[1:]:
        ratios[f"{lab}_vs_{base}"] = {
            "mamba_layer": stats.ratio_summary(times[f"M[{base}]"], times[f"M[{lab}]"], n_boot=a.n_boot),
            "projected_full_model": per_backend[base]["total_ms"] / per_backend[lab]["total_ms"],
        }
    return {
        "benchmark": "bench_layers",
        "env": environment.env_info(),
        "args": {k: v for k, v in vars(a).items()},
        "model": str(cfg.model.name),
        "full_pattern": full_pattern,
        "layer_counts": counts,
        "bench_pattern": bench_pattern,
        "shape": {"micro_batch": a.micro_batch, "seq": a.seq, "hidden": int(cfg.model.hidden_size),
                  "dtype": str(dtype).removeprefix("torch."),
                  "attention_impl": str(cfg.model.get("attention_impl")),
                  "moe_experts_impl": str(cfg.model.get("moe_experts_impl")),
                  "num_moe_experts": int(cfg.model.num_moe_experts or 0),
                  "mamba_fused_norm": model_dict(cfg.model)["mamba_fused_norm"]},
        "arm_mamba_fused_norm": dict(arm_fused or {}),
        "times_ms": summ,
        "rest_ms": rest,
        "rest_ms_unclipped": med["model"] - layer_sum,
        "peak_mem_gb": peak_gb,
        "estimate_full_model": per_backend,
        "ratios": ratios,
        "method": (f"{a.warmup} warm-up calls; {a.rounds} rounds x {a.iters} timed calls each; Mamba layer per backend "
                   "in ABBA order with an A-vs-A control; CUDA events (CPU: synchronized perf_counter); medians"),
    }


def markdown(res: dict) -> str:
    sh, counts = res["shape"], res["layer_counts"]
    base = [k for k in res["estimate_full_model"]][0]
    lines = [f"# Layer forward+backward at {res['model']} dims ({sh['dtype']}, micro-batch {sh['micro_batch']}, seq {sh['seq']})",
             "", reporting.env_markdown(res["env"]), "",
             f"attention {sh['attention_impl']}, MoE experts {sh['moe_experts_impl']} ({sh['num_moe_experts']} experts); "
             f"peak memory {res['peak_mem_gb'] if res['peak_mem_gb'] is None else round(res['peak_mem_gb'], 1)} GB. "
             f"{res['method']}.", ""]
    rows = []
    for k, v in res["times_ms"].items():
        rows.append([k, f"{v['median']:.2f}", f"{v['p10']:.2f}-{v['p90']:.2f}", v["n"]])
    rows.append(["rest (model - layers)", f"{res['rest_ms']:.2f}", "", ""])
    lines.append(reporting.md_table(["measurement", "median ms", "p10-p90", "n"], rows))
    lines += ["", f"Estimate for the full pattern ({', '.join(f'{n} {k}' for k, n in counts.items())}):", ""]
    erow = []
    for lab, e in res["estimate_full_model"].items():
        erow.append([lab, f"{e['total_ms']:.1f}"] + [f"{e['parts_ms'][n]:.1f} ({100 * e['shares'][n]:.0f}%)"
                                                    for n in e["parts_ms"]])
    first = res["estimate_full_model"][base]
    lines.append(reporting.md_table(["Mamba backend", "total ms"] + list(first["parts_ms"]), erow))
    if res["ratios"]:
        lines += ["", "Speedups over " + base + ":", ""]
        lines.append(reporting.md_table(
            ["arm", "Mamba layer (95% CI)", "projected full model"],
            [[k, f"{v['mamba_layer']['speedup']:.3f}x [{v['mamba_layer']['ci_lo']:.3f}, {v['mamba_layer']['ci_hi']:.3f}]",
              f"{v['projected_full_model']:.3f}x"] for k, v in res["ratios"].items()]))
    return "\n".join(lines)


def main(argv=None) -> int:
    return reporting.bench_main(argv, parse_args, run, lambda res, a: f"layers_{res['model']}_{'_vs_'.join(a.backend_list).replace(':', '-')}",
                         markdown)
