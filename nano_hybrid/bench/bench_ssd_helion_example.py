"""The SSD op forward + backward beside the Helion project's own Mamba-2 SSD example and flash-linear-attention's
``chunk_simple_gla``, the open peers that compute the same scan.

- The Helion example is ``examples/linear/example_mamba2_ssd.py`` of pytorch/helion: a chunked linear-attention engine
  whose ``MAMBA2_SSD`` variant computes ``o_t = q_t^T S_t``, ``S_t = exp(g_t) S_{t-1} + k_t v_t^T`` on head-first
  inputs, with its pretuned sm90 configs (``_helion_aot_linear_attention_engine_cuda_sm90.py``, read through Helion's
  ``AOTAutotuneCache``). Pass the folder that holds the example's ``linear`` package with ``--example-dir`` (e.g. a
  checkout's ``examples/``).
- flash-linear-attention (fla-org/flash-linear-attention, Triton kernels) computes the same recurrence as simple GLA,
  ``o_t = sum_{s<=t} scale q_t.k_s exp(G_t - G_s) v_s`` with ``G`` the cumulative sum of the head-wise gate ``g``, on
  ``[B, T, H, K]`` inputs. Pass the folder that holds its ``fla`` package (an unpacked ``fla-core`` wheel) with
  ``--fla-dir``; it runs at its own default chunk size. Its ``einops`` dependency must be importable.

Neither peer is part of this repository; at least one folder is needed.

Two contracts, each with mamba-ssm beside it, all on the same values (chunk ``--chunk``):

- Megatron's (what the Mamba-2 layer calls): ``y = SSD(x, softplus(dt + dt_bias), A, B, C) + D x``, gated by z;
  ``mamba_ssm`` is ``mamba_chunk_scan_combined`` (autograd), ``helion`` is this project's SSD forward and backward
  kernels (``kernels.ssd_helion`` / ``kernels.ssd_helion_bwd``, the backward recomputing its chunk pieces as the
  fused op does), gradients for x, dt, B, C, z, D, dt_bias;
- the peers': ``y = SSD(x, dt, A, B, C)`` with ``dt`` already positive, no D, no z; ``mamba_ssm_plain`` is
  ``mamba_chunk_scan_combined`` on it (gradients for x, dt, B, C). Both peers take ``q = C`` and ``k = B`` expanded
  to every head, ``v = x * dt`` and ``g = A * dt`` (built once outside the timed region), so neither sees the group
  sharing of B/C nor the dt chain rule. ``helion_example`` (head-first) gives gradients for q, k, v;
  ``fla_simple_gla`` gives them for q, k, v and g (the gate's gradient is the dt path's);
- ``mamba_ssm#2``: the A-vs-A control of ``mamba_ssm``.

Per shape: median fwd+bwd wall time per call over alternating rounds (CUDA events), the speedup against mamba_ssm
with a 95% bootstrap interval, device time per call (torch.profiler), and the largest relative error of the output
against the fp32 reference.

    python scripts/bench_ssd_helion_example.py --example-dir .peer/helion_examples/examples \
        [--fla-dir .peer/fla] [--shapes nano]
"""

from __future__ import annotations

import argparse
import functools
import sys
import types
from pathlib import Path

import torch

from nano_hybrid.bench import environment, profiling, reporting, stats
from nano_hybrid.errors import ConfigError

SHAPES = {
    # Nemotron-3 Nano's mixer at mbs 2 x 8192 (TP1): 64 heads x 64, 8 groups, d_state 128
    "nano": dict(b=2, l=8192, h=64, p=64, g=8, n=128),
    "nano_b1": dict(b=1, l=8192, h=64, p=64, g=8, n=128),
    # the example's own benchmark shape family: 32 heads, one group per head, d_state 128
    "ex_h32_l4096": dict(b=1, l=4096, h=32, p=128, g=32, n=128),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--example-dir", default=None, help="folder holding the Helion example's `linear` package")
    p.add_argument("--fla-dir", default=None, help="folder holding flash-linear-attention's `fla` package")
    p.add_argument("--shapes", default="nano", help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--chunk", type=int, default=128, help="chunk size of every arm")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in args.shapes if s not in SHAPES]
    if bad:
        p.error(f"--shapes: unknown {bad}; known {sorted(SHAPES)}")
    if not (args.example_dir or args.fla_dir):
        p.error("give --example-dir (the Helion example) and/or --fla-dir (flash-linear-attention)")
    if args.example_dir and not (Path(args.example_dir) / "linear" / "linear_attention_engine.py").is_file():
        p.error(f"--example-dir {args.example_dir}: no linear/linear_attention_engine.py there")
    if args.fla_dir and not (Path(args.fla_dir) / "fla" / "ops" / "simple_gla" / "chunk.py").is_file():
        p.error(f"--fla-dir {args.fla_dir}: no fla/ops/simple_gla/chunk.py there")
    return args


def load_example(example_dir: str | Path):
    """The example's engine module, with every Helion kernel in it reading the pretuned configs."""
    import helion

    sys.path.insert(0, str(Path(example_dir).resolve()))
    import linear.linear_attention_engine as eng  # noqa: E402  (the peer's package)

    n = 0
    for obj in vars(eng).values():
        if isinstance(obj, helion.Kernel):
            obj.settings.autotune_cache = "AOTAutotuneCache"
            n += 1
    return eng, n


def load_fla(fla_dir: str | Path):
    """flash-linear-attention's ``chunk_simple_gla`` from the ``fla`` package in ``fla_dir``."""
    sys.path.insert(0, str(Path(fla_dir).resolve()))
    from fla.ops.simple_gla import chunk_simple_gla  # noqa: E402  (the peer's package)

    return chunk_simple_gla


def inputs(shape: dict, device="cuda", dtype=torch.bfloat16, seed=0) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)
    b, l, h, p, ng, n = (shape[k] for k in ("b", "l", "h", "p", "g", "n"))

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g) * scale

    dt_raw = r(b, l, h, scale=0.5) - 1.0
    return dict(
        x=r(b, l, h, p).to(device, dtype), z=r(b, l, h, p).to(device, dtype), dt_raw=dt_raw.to(device, dtype),
        dt=torch.nn.functional.softplus(dt_raw).to(device, dtype), dt_bias=r(h, scale=0.5).to(device),
        A=(-torch.rand(h, generator=g) - 0.5).to(device), D=r(h).to(device),
        B=r(b, l, ng, n, scale=0.3).to(device, dtype), C=r(b, l, ng, n, scale=0.3).to(device, dtype),
        dy=r(b, l, h, p).to(device, dtype),
    )


def peer_inputs(t: dict) -> dict:
    """The peers' arguments for the plain SSD, ``[B, T, H, ...]``: q = C and k = B per head, v = x * dt, g = A * dt
    (fp32)."""
    rep = t["x"].shape[2] // t["B"].shape[2]
    dt = t["dt"].float()
    return dict(q=t["C"].repeat_interleave(rep, dim=2), k=t["B"].repeat_interleave(rep, dim=2),
                v=(t["x"].float() * dt[..., None]).to(t["x"].dtype), g=t["A"][None, None, :] * dt, dy=t["dy"])


def example_inputs(t: dict) -> dict:
    """The Helion example's head-first arguments: ``peer_inputs`` with heads before time."""
    return {k: v.transpose(1, 2).contiguous() for k, v in peer_inputs(t).items()}


def _leaves(t: dict, keys, backward: bool) -> dict:
    return {k: t[k].detach().requires_grad_(backward) for k in keys}


def arms(eng, chunk: int, fla_gla=None) -> dict:
    """name -> fn(t, backward=True) returning the output (b, l, h, p); ``contract`` of each in ``CONTRACT``.
    ``eng``: the Helion example's engine module or None; ``fla_gla``: ``chunk_simple_gla`` or None."""
    if "selective_scan_cuda" not in sys.modules:
        sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    from kernels import tuning
    from kernels.registry import get_backend
    from kernels.ssd_helion import ssd_chunk_pieces_helion, ssd_forward_helion
    from kernels.ssd_helion_bwd import ssd_backward_helion

    settings = get_backend("helion").settings
    ex_fwd = eng.get_helion_fwd_kernel(eng.LinearAttentionVariant.MAMBA2_SSD) if eng is not None else None

    def mamba(t, backward=True):
        v = _leaves(t, ("x", "dt_raw", "B", "C", "z", "D", "dt_bias"), backward)
        y = mamba_chunk_scan_combined(v["x"], v["dt_raw"], t["A"], v["B"], v["C"], chunk, D=v["D"], z=v["z"],
                                      dt_bias=v["dt_bias"], dt_softplus=True)
        if backward:
            y.backward(t["dy"])
        return y

    def helion(t, backward=True):
        with tuning.use(settings):
            out, out_x, dt_out, dA_cumsum, _, _ = ssd_forward_helion(
                t["x"], t["dt_raw"], t["A"], t["B"], t["C"], chunk, D=t["D"], z=t["z"], dt_bias=t["dt_bias"],
                dt_softplus=True)
            if backward:
                dA_cumsum, dt_out, states_in, _, CB = ssd_chunk_pieces_helion(
                    t["B"], t["x"], t["C"], t["dt_raw"], t["A"], chunk, dt_bias=t["dt_bias"], dt_softplus=True,
                    state_dtype=t["x"].dtype, cumsum=(dA_cumsum, dt_out))
                ssd_backward_helion(t["dy"], t["x"], t["z"], out_x, t["dt_raw"], t["A"], t["B"], t["C"], t["D"],
                                    t["dt_bias"], dt_out, dA_cumsum, states_in, CB, chunk, dt_softplus=True)
        return out

    def mamba_plain(t, backward=True):
        v = _leaves(t, ("x", "dt", "B", "C"), backward)
        y = mamba_chunk_scan_combined(v["x"], v["dt"], t["A"], v["B"], v["C"], chunk, D=None, dt_softplus=False)
        if backward:
            y.backward(t["dy"])
        return y

    def example(t, backward=True):
        e = t["example"]
        v = _leaves(e, ("q", "k", "v"), backward)
        y = ex_fwd(v["q"], v["k"], v["v"], e["g"], C=chunk, scale=1.0)
        if backward:
            y.backward(e["dy"])
        return y.transpose(1, 2)

    def fla(t, backward=True):
        e = t["peer"]
        v = _leaves(e, ("q", "k", "v", "g"), backward)
        y, _ = fla_gla(v["q"], v["k"], v["v"], v["g"], scale=1.0)
        if y.shape != v["v"].shape:  # a release that reads [B, H, T, ...] (head_first) would not match
            raise ValueError(f"chunk_simple_gla returned {tuple(y.shape)} for [B, T, H, V] = {tuple(v['v'].shape)}")
        if backward:
            y.backward(e["dy"])
        return y

    fns = {"mamba_ssm": mamba, "helion": helion, "mamba_ssm_plain": mamba_plain}
    if ex_fwd is not None:
        fns["helion_example"] = example
    if fla_gla is not None:
        fns["fla_simple_gla"] = fla
    fns["mamba_ssm#2"] = mamba
    return fns


CONTRACT = {"mamba_ssm": "megatron", "helion": "megatron", "mamba_ssm_plain": "plain", "helion_example": "plain",
            "fla_simple_gla": "plain", "mamba_ssm#2": "megatron"}


def references(t: dict, chunk: int) -> dict:
    from kernels.ssd import mamba_chunk_scan_combined_ref

    f = {k: v.float() for k, v in t.items() if isinstance(v, torch.Tensor)}
    return {
        "megatron": mamba_chunk_scan_combined_ref(f["x"], f["dt_raw"], f["A"], f["B"], f["C"], chunk, D=f["D"],
                                                  z=f["z"], dt_bias=f["dt_bias"], dt_softplus=True),
        "plain": mamba_chunk_scan_combined_ref(f["x"], f["dt"], f["A"], f["B"], f["C"], chunk, D=None,
                                               dt_softplus=False),
    }


def run(args) -> dict:
    if not torch.cuda.is_available():
        raise ConfigError("bench_ssd_helion_example.py needs a CUDA GPU")
    eng, n_kernels = load_example(args.example_dir) if args.example_dir else (None, 0)
    fns = arms(eng, args.chunk, load_fla(args.fla_dir) if args.fla_dir else None)
    res = {"env": environment.env_info(), "args": vars(args), "arms": list(fns), "example_kernels": n_kernels,
           "shapes": {}}
    for sname in args.shapes:
        t = inputs(SHAPES[sname])
        t["peer"] = peer_inputs(t)
        t["example"] = example_inputs(t)
        failed, errs = {}, {}
        refs = references(t, args.chunk)
        for a in list(fns)[:-1]:
            try:
                with torch.no_grad():
                    out = fns[a](t, backward=False)
                fns[a](t)  # compile the backward too
            except Exception as e:  # an arm that cannot run this shape is reported, not timed
                failed[a] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
                print(f"[{sname}] {a} failed: {failed[a]}", flush=True)
                continue
            ref = refs[CONTRACT[a]]
            errs[a] = float((out.float() - ref).norm() / ref.norm())
            del out
        del refs
        torch.cuda.empty_cache()
        names = [a for a in fns if a not in failed and (a != "mamba_ssm#2" or "mamba_ssm" not in failed)]
        times = stats.time_arms({a: functools.partial(fns[a], t) for a in names}, warmup=args.warmup,
                                rounds=args.rounds, iters=args.iters, device="cuda")
        device_us = {}
        for a in names[:-1]:
            table = profiling.profile_device_table(lambda: fns[a](t), max(2, args.iters // 2))
            device_us[a] = table.get("total_us_per_iter")
        base = {"megatron": times.get("mamba_ssm"), "plain": times.get("mamba_ssm_plain")}
        res["shapes"][sname] = {
            "shape": SHAPES[sname], "chunk": args.chunk, "contract": {a: CONTRACT[a] for a in names},
            "times_ms": {a: stats.summarize(v) for a, v in times.items()},
            # each arm against mamba-ssm on its own contract
            "speedup_vs_mamba_ssm": {a: stats.ratio_summary(base[CONTRACT[a]], times[a]) for a in names
                                     if a not in ("mamba_ssm", "mamba_ssm_plain") and base[CONTRACT[a]]},
            "device_us_per_call": device_us, "rel_l2_err_vs_fp32_ref": errs, "arms": names, "failed": failed,
        }
        print(f"[{sname}] " + ", ".join(f"{a} {stats.median(times[a]):.3f} ms" for a in names), flush=True)
    return res


def markdown(res: dict) -> str:
    lines = ["# SSD op fwd+bwd: mamba-ssm, helion and the open peers (Helion's Mamba-2 SSD example, "
             "flash-linear-attention's chunk_simple_gla)", "",
             reporting.env_markdown(res["env"]), ""]
    for sname, r in res["shapes"].items():
        s = r["shape"]
        lines += [f"## {sname}: batch {s['b']}, seqlen {s['l']}, heads {s['h']} x {s['p']}, groups {s['g']}, "
                  f"d_state {s['n']}, chunk {r['chunk']}", ""]
        rows = []
        for a in r["arms"]:
            rows.append([a, r["contract"][a], *reporting.timing_cells(r, a),
                         f"{r['rel_l2_err_vs_fp32_ref'][a]:.2e}" if a in r["rel_l2_err_vs_fp32_ref"] else "-"])
        lines += [reporting.md_table(["arm", "contract", "median ms fwd+bwd", "p10-p90", "device us", "vs mamba_ssm, same contract [95% CI]",
                                      "output rel L2 err (fp32 ref)"], rows), ""]
        lines += [f"- {a} does not run here: {why}" for a, why in r.get("failed", {}).items()] + [""]
    return "\n".join(lines)


def main(argv=None) -> int:
    return reporting.bench_main(argv, parse_args, run, lambda res, a: "ssd_helion_example_" + "_".join(a.shapes), markdown)
