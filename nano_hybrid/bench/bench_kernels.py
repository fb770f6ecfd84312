"""Per-kernel device-time breakdown of one Mamba-2 mixer op forward+backward, per kernel backend.

The op is exactly what Megatron-Core's MambaMixer runs in training (``_ssm_training``):

    zxBCdt = rearrange(in_proj_out, "l b d -> b l d")     # a (b, l, d) view of (l, b, d) memory
    zxBCdt = zxBCdt if backend.strided_zxbcdt else zxBCdt.contiguous()
    y = mamba_split_conv1d_scan_combined(zxBCdt, conv_w, conv_b, dt_bias.float(), A=-exp(A_log.float()), D,
                                         chunk_size=128, activation="silu", headdim=64, ngroups=8,
                                         norm_before_gate=False)
    y = rearrange(y, "b l d -> l b d").contiguous()
    y = RMSNormGated(d_inner, eps=1e-5, group_size=d_inner/ngroups, norm_before_gate=False)(y)

with bf16 parameters (as under Megatron's Float16Module) and ops taken from ``kernels.registry``. zxBCdt is a
(b, l, d) view of (l, b, d) memory, as Megatron's in_proj produces it; ``--zxbcdt-layout contiguous`` makes it a
contiguous (b, l, d) tensor instead.

    python scripts/bench_kernels.py --backend mamba_ssm                      # kernel table (baseline check)
    python scripts/bench_kernels.py --backend mamba_ssm --compare helion     # + side-by-side ratios
    python scripts/bench_kernels.py --backend mamba_ssm --shape tp2          # per-rank shape at TP=2

Method: warm-up, then R rounds; each round times every arm (A, B, and A again as the A-vs-A control)
for N calls with CUDA events, in ABBA order. Reported: medians per arm and op, the speedup B/A as
median(A)/median(B) with a 95% bootstrap interval, and the control A/A#2 (its distance from 1.0 is
the noise floor). A correctness check (B against A, relative L2 error of output and all gradients)
runs before timing. The kernel table comes from torch.profiler over --profile-iters iterations.
Writes ``kernels_<A>[_vs_<B>]_<shape>.json`` and ``.md`` to $OUT (default runs/bench/<gpu>).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from nano_hybrid.bench import environment, profiling, reporting, stats
from nano_hybrid.bench.arms import op_backend, op_fused_norm
from nano_hybrid.bench.mixer import (OPS, SHAPES, MixerOp, add_zxbcdt_layout_arg, check_against, make_params,
                                     state_passing_taken)
from nano_hybrid.errors import EXIT_BAD_INPUT, ConfigError


DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# bf16 operands: relative L2 error of a correct kernel vs another correct kernel stays well under this.
REL_ERR_TOL = {"bf16": 2e-2, "fp16": 1e-2, "fp32": 1e-3}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", required=True, help="baseline kernel backend A (torch | mamba_ssm | helion), "
                                                     "helion optionally with :kernels.helion.<setting>=value keys; "
                                                     "any with :model.mamba_fused_norm=true (the mixer rows run the "
                                                     "gated norm inside the op)")
    p.add_argument("--compare", default=None, help="candidate backend B, timed side by side with A (same syntax), "
                                                   "e.g. helion:kernels.helion.save_conv_states=false")
    p.add_argument("--shape", default="nano", choices=sorted(SHAPES), help="mixer shape (default nano)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per arm and op before timing")
    p.add_argument("--rounds", type=int, default=6, help="alternation rounds")
    p.add_argument("--iters", type=int, default=10, help="timed calls per arm, op and round")
    p.add_argument("--profile-iters", type=int, default=5, help="iterations under torch.profiler (0: skip)")
    p.add_argument("--no-control", action="store_true", help="skip the A-vs-A control arm")
    p.add_argument("--out", default=None, help="output dir (default $OUT or runs/bench/<gpu>)")
    p.add_argument("--seed", type=int, default=0)
    add_zxbcdt_layout_arg(p)
    a = p.parse_args(argv)
    for k in ("warmup", "profile_iters"):
        if getattr(a, k) < 0:
            p.error(f"--{k.replace('_', '-')} must be >= 0")
    for k in ("rounds", "iters"):
        if getattr(a, k) < 1:
            p.error(f"--{k} must be >= 1")
    from nano_hybrid.bench.arms import parse_op_arm

    # backend[:kernels.helion.<setting>=value...][:model.mamba_fused_norm=...]: an arm's label (file-name safe) keys
    # its results
    a.arm_specs = {}
    for k in ("backend", "compare"):
        spec = getattr(a, k)
        if spec is None:
            continue
        try:
            arm = parse_op_arm(spec)
        except ValueError as e:
            p.error(f"--{k}: {e}")
        a.arm_specs[arm.label] = arm
        setattr(a, k, arm.label)
    if a.compare is not None and a.compare == a.backend:
        p.error("--compare must name a different backend or settings than --backend (the A-vs-A control is built in)")
    return a


def check_correctness(args, ops: dict) -> dict:
    """Relative L2 errors of output and gradients: B against A (same inputs), A against itself run twice
    (determinism / races); ``passed`` when B is within ``REL_ERR_TOL`` of A."""
    ref = ops[args.backend].outputs_and_grads()
    correctness = {"tolerance": REL_ERR_TOL[args.dtype]}
    again = ops[args.backend].outputs_and_grads()
    correctness[f"{args.backend}_vs_itself"] = check_against(ref, again)
    ok = True
    if args.compare:
        errs = check_against(ref, ops[args.compare].outputs_and_grads())
        correctness[f"{args.compare}_vs_{args.backend}"] = errs
        bad = {k: v for k, v in errs.items() if not (v <= REL_ERR_TOL[args.dtype])}
        ok = not bad
        if bad:
            print(f"WARNING: {args.compare} differs from {args.backend} beyond tolerance "
                  f"{REL_ERR_TOL[args.dtype]}: {bad}", file=sys.stderr)
    correctness["passed"] = ok
    del ref, again
    return correctness


def kernel_tables(args, ops: dict, backends: list[str], device) -> dict:
    """Per backend, the torch.profiler kernel table of the mixer fwd+bwd (CUDA only); mamba_ssm's is checked
    against the expected kernel list."""
    kernels = {}
    if args.profile_iters and device.type == "cuda":
        for name in backends:
            table = profiling.profile_device_table(ops[name].mixer_fwdbwd, args.profile_iters)
            if name == "mamba_ssm":
                table["baseline_kernel_check"] = profiling.check_expected_kernels(table)
            kernels[name] = table
    elif args.profile_iters:
        kernels = {"skipped": "the per-kernel table needs a CUDA GPU"}
    return kernels


def run(args: argparse.Namespace) -> dict:
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda requested but no CUDA GPU is visible")
    dtype = getattr(torch, DTYPES[args.dtype])
    shape = SHAPES[args.shape]
    backends = [args.backend] + ([args.compare] if args.compare else [])
    be = {name: op_backend(args.arm_specs[name]) for name in backends}  # fails early with one clear message
    params = make_params(shape, device, dtype, args.seed, zxbcdt_layout=args.zxbcdt_layout)
    ops = {name: MixerOp(be[name], shape, params, device, dtype, fused_norm=op_fused_norm(args.arm_specs[name]))
           for name in backends}

    arms = backends + ([] if args.no_control else [args.backend])
    labels = stats.arm_labels(arms)
    arm_ops = [ops[a] for a in arms]

    correctness = check_correctness(args, ops)

    # warm-up (compilation / autotuning), then alternate arms over rounds
    for name in backends:
        for op in OPS:
            for _ in range(args.warmup):
                getattr(ops[name], op)()
    stats.sync(device)
    times: dict[str, dict[str, list[float]]] = {lab: {op: [] for op in OPS} for lab in labels}
    for order in stats.alternating_order(len(arms), args.rounds):
        for i in order:
            for op in OPS:
                times[labels[i]][op] += stats.time_calls(getattr(arm_ops[i], op), args.iters, device)

    summary = {lab: {op: stats.summarize(times[lab][op]) for op in OPS} for lab in labels}
    ratios = {}
    if args.compare:
        ratios[f"{args.compare}_vs_{args.backend}"] = {
            op: stats.ratio_summary(times[args.backend][op], times[args.compare][op]) for op in OPS}
    if not args.no_control:
        ratios[f"control_{labels[-1]}_vs_{args.backend}"] = {
            op: stats.ratio_summary(times[args.backend][op], times[labels[-1]][op]) for op in OPS}

    kernels = kernel_tables(args, ops, backends, device)

    return {
        "benchmark": "bench_kernels",
        "env": environment.env_info(),
        "backend_settings": {name: be[name].settings_dict() for name in backends},
        "args": {k: v for k, v in vars(args).items() if k != "arm_specs"},
        "arm_settings": {lab: {"backend": x.backend, **dict(x.overrides)} for lab, x in args.arm_specs.items()},
        "shape": {**asdict(shape), "d_inner": shape.d_inner, "conv_dim": shape.conv_dim,
                  "zxbcdt_dim": shape.zxbcdt_dim, "group_size": shape.group_size, "name": args.shape},
        "dtype": args.dtype,
        "zxbcdt_layout": args.zxbcdt_layout,
        "device": str(device),
        "arms": labels,
        "ops": {
            "split_fwd": "mamba_split_conv1d_scan_combined forward",
            "split_fwdbwd": "mamba_split_conv1d_scan_combined forward + backward",
            "norm_fwdbwd": "gated RMSNorm (group_size d_inner/ngroups, norm_before_gate=False) forward + backward",
            "mixer_fwdbwd": "split-conv1d-scan, its output made a contiguous (l, b, d) tensor, gated RMSNorm, "
                            "forward + backward",
        },
        "times_ms": summary,
        # the chunk-state path each helion arm took at this shape (kernels.helion.state_passing)
        "state_passing": {name: state_passing_taken(be[name], shape) for name in backends
                          if getattr(be[name], "settings", None) is not None},
        "ratios": ratios,
        "correctness": correctness,
        "kernels": kernels,
    }


def markdown(res: dict) -> str:
    env, sh = res["env"], res["shape"]
    lines = [f"# Mamba-2 mixer op: {' vs '.join(dict.fromkeys(a.split('#')[0] for a in res['arms']))} "
             f"({sh['name']}, {res['dtype']})", "",
             f"{reporting.env_markdown(env)}", "",
             f"Shape: batch {sh['batch']}, seqlen {sh['seqlen']}, nheads {sh['nheads']}, headdim {sh['headdim']}, "
             f"ngroups {sh['ngroups']}, d_state {sh['d_state']}, chunk {sh['chunk_size']}, "
             f"norm group_size {sh['group_size']}; zxbcdt layout {res['zxbcdt_layout']}"
             f"{' (a (b, l, d) view of (l, b, d) memory)' if res['zxbcdt_layout'] == 'megatron' else ''}.", "",
             "Median ms per call (p10-p90):", ""]
    rows = []
    for op in OPS:
        rows.append([op] + [f"{res['times_ms'][a][op]['median']:.3f} ({res['times_ms'][a][op]['p10']:.3f}-"
                            f"{res['times_ms'][a][op]['p90']:.3f})" for a in res["arms"]])
    lines.append(reporting.md_table(["op"] + res["arms"], rows))
    for name, r in res["ratios"].items():
        lines += ["", f"Speedup {name} (median ratio, {int(100 * next(iter(r.values()))['ci_level'])}% bootstrap CI):", ""]
        lines.append(reporting.md_table(["op", "speedup", "CI"],
                                 [[op, f"{v['speedup']:.3f}x", f"[{v['ci_lo']:.3f}, {v['ci_hi']:.3f}]"]
                                  for op, v in r.items()]))
    c = res["correctness"]
    lines += ["", f"Correctness (relative L2 error, tolerance {c['tolerance']}): "
              + ("passed" if c["passed"] else "FAILED")]
    for k, v in c.items():
        if isinstance(v, dict):
            lines.append(f"- {k}: max {max(v.values()):.2e} (" + ", ".join(f"{n} {e:.1e}" for n, e in v.items()) + ")")
    for name, t in res["kernels"].items():
        if not isinstance(t, dict):
            lines += ["", f"Kernel table: {t}"]
            continue
        lines += ["", f"## Kernels, {name}: {t['total_us_per_iter']:.1f} us/iter of device time "
                  f"(mixer fwd+bwd; norm {t['by_category'].get('norm', 0):.1f}, "
                  f"ssd+conv {t['by_category'].get('ssd', 0):.1f}, other {t['by_category'].get('other', 0):.1f})", ""]
        lines.append(reporting.md_table(["us/iter", "share", "calls", "kernel"],
                                 [[f"{r['us_per_iter']:.1f}", f"{100 * r['share']:.1f}%",
                                   f"{r['calls_per_iter']:g}", f"`{r['kernel']}`"] for r in t["rows"]]))
        chk = t.get("baseline_kernel_check")
        if chk:
            lines += ["", "Baseline kernel list (shared/baselines/h200-mamba-ssm-nano30b.md): "
                      + ("reproduced" if chk["matches"] else
                         f"NOT reproduced: missing {chk['missing']}, wrong call counts {chk['wrong_calls']}")
                      + (f"; other kernels: {', '.join(chk['extra_kernels'])}" if chk["extra_kernels"] else "")]
    return "\n".join(lines)


def output_stem(args) -> str:
    return f"kernels_{args.backend}" + (f"_vs_{args.compare}" if args.compare else "") + f"_{args.shape}"


def main(argv=None) -> int:
    from kernels.registry import BackendUnavailableError, KernelSwitchError, UnknownBackendError

    args = parse_args(argv)
    try:
        reporting.check_args(args)
        res = run(args)
    except (ValueError, UnknownBackendError, BackendUnavailableError, KernelSwitchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    out = Path(args.out) if args.out else reporting.default_out_dir()
    jp, mp = reporting.write_results(out, output_stem(args), res, markdown(res))
    print(markdown(res))
    print(f"\nwrote {jp} and {mp}")
    return 0 if res["correctness"]["passed"] else 1
