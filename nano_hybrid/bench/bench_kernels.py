"""Per-kernel device-time breakdown of one Mamba-2 mixer op forward+backward, per kernel backend.

The op is exactly what Megatron-Core's MambaMixer runs in training (``_ssm_training``):

    y = mamba_split_conv1d_scan_combined(zxBCdt, conv_w, conv_b, dt_bias.float(), A=-exp(A_log.float()), D,
                                         chunk_size=128, activation="silu", headdim=64, ngroups=8,
                                         norm_before_gate=False)
    y = rearrange(y, "b l d -> l b d").contiguous()
    y = RMSNormGated(d_inner, eps=1e-5, group_size=d_inner/ngroups, norm_before_gate=False)(y)

with bf16 parameters (as under Megatron's Float16Module) and ops taken from ``kernels.registry``.

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
from dataclasses import asdict, dataclass
from pathlib import Path
from nano_hybrid.bench import environment, profiling, reporting, stats




@dataclass(frozen=True)
class MixerShape:
    batch: int
    seqlen: int
    nheads: int
    headdim: int
    ngroups: int
    d_state: int
    d_conv: int = 4
    chunk_size: int = 128

    @property
    def d_inner(self) -> int:
        return self.nheads * self.headdim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.ngroups * self.d_state

    @property
    def zxbcdt_dim(self) -> int:
        return 2 * self.d_inner + 2 * self.ngroups * self.d_state + self.nheads

    @property
    def group_size(self) -> int:
        return self.d_inner // self.ngroups


# Nano 30B-A3B mixer shapes (docs/ARCHITECTURE.md). tp2 = one rank's share at tensor-parallel 2.
SHAPES = {
    "nano": MixerShape(batch=2, seqlen=8192, nheads=64, headdim=64, ngroups=8, d_state=128),
    "tp2": MixerShape(batch=2, seqlen=8192, nheads=32, headdim=64, ngroups=4, d_state=128),
    "l4096b4": MixerShape(batch=4, seqlen=4096, nheads=64, headdim=64, ngroups=8, d_state=128),
    # CPU smoke-test size only (not a benchmark).
    "tiny": MixerShape(batch=1, seqlen=256, nheads=4, headdim=16, ngroups=2, d_state=16, chunk_size=64),
}

OPS = ("split_fwd", "split_fwdbwd", "norm_fwdbwd", "mixer_fwdbwd")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# bf16 operands: relative L2 error of a correct kernel vs another correct kernel stays well under this.
REL_ERR_TOL = {"bf16": 2e-2, "fp16": 1e-2, "fp32": 1e-3}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", required=True, help="baseline kernel backend A (torch | mamba_ssm | helion)")
    p.add_argument("--compare", default=None, help="candidate backend B, timed side by side with A")
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
    a = p.parse_args(argv)
    for k in ("warmup", "profile_iters"):
        if getattr(a, k) < 0:
            p.error(f"--{k.replace('_', '-')} must be >= 0")
    for k in ("rounds", "iters"):
        if getattr(a, k) < 1:
            p.error(f"--{k} must be >= 1")
    if a.compare is not None and a.compare == a.backend:
        p.error("--compare must name a different backend than --backend (the A-vs-A control is built in)")
    return a


class MixerOp:
    """One backend's split-conv1d-scan + gated-norm, bound to shared inputs and parameters."""

    def __init__(self, backend, shape: MixerShape, params: dict, device, dtype):
        import torch

        self.backend = backend
        self.shape = shape
        self.p = params
        self.norm = backend.RMSNormGated(shape.d_inner, eps=1e-5, group_size=shape.group_size,
                                         norm_before_gate=False, device=device, dtype=dtype)
        with torch.no_grad():
            self.norm.weight.copy_(params["norm_weight"])

    def split(self):
        import torch

        p, s = self.p, self.shape
        A = -torch.exp(p["A_log"].float())
        return self.backend.mamba_split_conv1d_scan_combined(
            p["zxbcdt"], p["conv_w"], p["conv_b"], p["dt_bias"].float(), A, D=p["D"],
            chunk_size=s.chunk_size, activation="silu", headdim=s.headdim, ngroups=s.ngroups,
            norm_before_gate=False,
        )

    def mixer(self):
        # as in MambaMixer._ssm_training: the op's (b, l, d) output is copied to (l, b, d) for the norm and out_proj
        return self.norm(self.split().transpose(0, 1).contiguous())

    def leaves(self):
        return [self.p[k] for k in ("zxbcdt", "conv_w", "conv_b", "dt_bias", "A_log", "D")] + [self.norm.weight]

    def zero_grad(self):
        for t in self.leaves() + [self.p["norm_in"]]:
            t.grad = None

    # the four timed closures -------------------------------------------------------------------
    def split_fwd(self):
        return self.split()

    def split_fwdbwd(self):
        self.zero_grad()
        self.split().backward(self.p["dy"])

    def norm_fwdbwd(self):
        self.zero_grad()
        self.norm(self.p["norm_in"]).backward(self.p["dy_lbd"])

    def mixer_fwdbwd(self):
        self.zero_grad()
        self.mixer().backward(self.p["dy_lbd"])

    def outputs_and_grads(self) -> dict:
        self.zero_grad()
        y = self.mixer()
        y.backward(self.p["dy_lbd"])
        names = ["zxbcdt", "conv_w", "conv_b", "dt_bias", "A_log", "D", "norm_weight"]
        out = {"y": y.detach().float()}
        for n, t in zip(names, self.leaves()):
            out[f"d_{n}"] = t.grad.detach().float().clone()
        self.zero_grad()
        return out


def make_params(shape: MixerShape, device, dtype, seed: int) -> dict:
    """Random inputs and parameters with Megatron's init ranges (never zeros)."""
    import math

    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*size, scale=1.0, dt=dtype):
        return (torch.randn(*size, generator=g) * scale).to(device=device, dtype=dt)

    s = shape
    # dt bias so that softplus(dt_bias) lies in [1e-3, 0.1] (MambaMixer init), A in [1, 16].
    dt = torch.exp(torch.rand(s.nheads, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    dt_bias = (dt + torch.log(-torch.expm1(-dt))).to(device=device, dtype=dtype)
    A_log = torch.log(torch.empty(s.nheads).uniform_(1, 16, generator=g)).to(device=device, dtype=dtype)
    p = {
        "zxbcdt": rnd(s.batch, s.seqlen, s.zxbcdt_dim),
        "conv_w": (torch.rand(s.conv_dim, s.d_conv, generator=g) - 0.5).to(device=device, dtype=dtype),
        "conv_b": rnd(s.conv_dim, scale=0.1),
        "dt_bias": dt_bias,
        "A_log": A_log,
        "D": (1.0 + 0.1 * torch.randn(s.nheads, generator=g)).to(device=device, dtype=dtype),
        "norm_weight": (1.0 + 0.1 * torch.randn(s.d_inner, generator=g)).to(device=device, dtype=dtype),
        "norm_in": rnd(s.seqlen, s.batch, s.d_inner),
        # the gradients as Megatron's mixer hands them back: the norm and out_proj run on (l, b, d), so the
        # norm gets a contiguous (l, b, d) gradient and the op a (b, l, d) view of one
        "dy_lbd": rnd(s.seqlen, s.batch, s.d_inner),
    }
    p["dy"] = p["dy_lbd"].transpose(0, 1)
    for k in ("zxbcdt", "conv_w", "conv_b", "dt_bias", "A_log", "D", "norm_in"):
        p[k].requires_grad_(True)
    return p


def rel_err(a, b) -> float:
    import torch

    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def check_against(ref: dict, cand: dict) -> dict:
    return {k: rel_err(cand[k], ref[k]) for k in ref}


def run(args: argparse.Namespace) -> dict:
    import torch

    from kernels.registry import get_backend

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but no CUDA GPU is visible")
    dtype = getattr(torch, DTYPES[args.dtype])
    shape = SHAPES[args.shape]
    backends = [args.backend] + ([args.compare] if args.compare else [])
    be = {name: get_backend(name) for name in backends}  # fails early with one clear message
    params = make_params(shape, device, dtype, args.seed)
    ops = {name: MixerOp(be[name], shape, params, device, dtype) for name in backends}

    arms = backends + ([] if args.no_control else [args.backend])
    labels = stats.arm_labels(arms)
    arm_ops = [ops[a] for a in arms]

    # correctness: B against A (same inputs), and A against itself run twice (determinism / races)
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

    kernels = {}
    if args.profile_iters and device.type == "cuda":
        for name in backends:
            table = profiling.profile_device_table(ops[name].mixer_fwdbwd, args.profile_iters)
            if name == "mamba_ssm":
                table["baseline_kernel_check"] = profiling.check_expected_kernels(table)
            kernels[name] = table
    elif args.profile_iters:
        kernels = {"skipped": "the per-kernel table needs a CUDA GPU"}

    return {
        "benchmark": "bench_kernels",
        "env": environment.env_info(),
        "backend_settings": {name: be[name].settings_dict() for name in backends},
        "args": vars(args),
        "shape": {**asdict(shape), "d_inner": shape.d_inner, "conv_dim": shape.conv_dim,
                  "zxbcdt_dim": shape.zxbcdt_dim, "group_size": shape.group_size, "name": args.shape},
        "dtype": args.dtype,
        "device": str(device),
        "arms": labels,
        "ops": {
            "split_fwd": "mamba_split_conv1d_scan_combined forward",
            "split_fwdbwd": "mamba_split_conv1d_scan_combined forward + backward",
            "norm_fwdbwd": "gated RMSNorm (group_size d_inner/ngroups, norm_before_gate=False) forward + backward",
            "mixer_fwdbwd": "split-conv1d-scan, its output copied to (l, b, d), gated RMSNorm, forward + backward",
        },
        "times_ms": summary,
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
             f"norm group_size {sh['group_size']}.", "",
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
    from kernels.registry import BackendUnavailableError, UnknownBackendError

    args = parse_args(argv)
    try:
        res = run(args)
    except (UnknownBackendError, BackendUnavailableError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else reporting.default_out_dir()
    jp, mp = reporting.write_results(out, output_stem(args), res, markdown(res))
    print(markdown(res))
    print(f"\nwrote {jp} and {mp}")
    return 0 if res["correctness"]["passed"] else 1
