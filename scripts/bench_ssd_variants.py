#!/usr/bin/env python3
"""SSD kernel variants side by side on one GPU: mamba-ssm vs Helion v1 (committed kernels) vs a candidate
variant (``--variant v2``, the default; ``v3``/``v4``: backward variants of ``kernels.ssd_helion_bwd``; ``v5``:
the forward variant of ``kernels.ssd_helion`` that computes the chunk cumsum inside chunk_state_passing; ``v7``: the
backward with ssd_bwd_dx over row tiles).

Arms run in alternating order over ``--rounds`` rounds of ``--iters`` calls (CUDA events), with an
A-vs-A control of v1. Rows:
- ``chunk_scan``: mamba-ssm ``_chunk_scan_fwd`` | ``ssd_chunk_scan`` (v1) | ``ssd_chunk_scan_v2``
- ``ssd_forward``: mamba-ssm ``_mamba_chunk_scan_combined_fwd`` | ``ssd_forward_helion`` v1 | v2
- ``bwd_dbc``, ``bwd_dz_dstates``: the Helion kernels v1 | v2 on identical inputs (the mamba-ssm
  counterparts are several internal kernels; their measured per-kernel times, dB+dC+dCB+2 bmm_bwd =
  588 us and dz+dstates = 352 us, come from the profiler table in
  kernels_mamba_ssm_vs_helion_nano.md and are reported as the reference column)
- ``bwd_dx`` (v7): ``ssd_bwd_dx`` (v1, also v4's) | ``ssd_bwd_dx_v2`` + the sums of its row-tile partials
- ``ssd_backward``: ``ssd_backward_helion`` v1 | v2 (whole Helion SSD backward)
- ``cumsum_state_passing`` (v5): mamba-ssm ``_chunk_cumsum_fwd`` + ``_chunk_state_fwd`` + ``_state_passing_fwd`` |
  ``ssd_chunk_cumsum`` + ``ssd_chunk_state_passing`` (v1) | ``ssd_chunk_cumsum_state_passing``, with dt read
  strided from a zxBCdt-shaped buffer as the fused op passes it
- ``chunk_cumsum`` (v9, v10): mamba-ssm ``_chunk_cumsum_fwd`` | ``ssd_chunk_cumsum`` | ``ssd_chunk_cumsum_t``, dt
  strided as above (per call: at ~5-8 us of device time these are launch-bound; the device times come from
  ``bench_kernels.py``'s profile)
Only the rows a candidate changes run (``row_names``): v2 all but cumsum_state_passing; v3, v4 bwd_dbc /
bwd_dz_dstates and ssd_backward; v5 cumsum_state_passing and ssd_forward; v7
bwd_dbc, bwd_dz_dstates, bwd_dx and ssd_backward; v8 chunk_scan (CB in bf16 for the candidate) and ssd_forward;
v9 chunk_cumsum and ssd_forward; v10 all three.
Correctness: candidate vs v1 outputs (max abs err / max |v1|) on the same inputs for every row.
Configs: v1 uses kernels/configs/<arch>/, v2 its tuned file if present, else its generic default
(tune first: ``python scripts/tune_kernels.py --kernels ssd_bwd_dbc_v2,ssd_bwd_dz_dstates_v2,ssd_chunk_scan_v2``).

    python scripts/bench_ssd_variants.py [--shape nano] [--rounds 5 --iters 10] [--variant v3]

Writes $OUT/ssd_variants_bench.json and .md (``ssd_variants_bench_v3.*`` for v3).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path


from nano_hybrid import benchlib as bl
import torch  # noqa: E402

from kernels import ssd_helion as sh  # noqa: E402
from kernels import ssd_helion_bwd as sb  # noqa: E402
from kernels import tuning  # noqa: E402

# (bwd_dx has none: mamba-ssm's counterpart, dx + ddAcs_stable + cumsum_bwd, also covers ssd_bwd_dt's work)
MAMBA_REF_US = {"bwd_dbc": 588.0, "bwd_dz_dstates": 352.0}  # H200 profiler table, 2026-11-29


def _err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / (b.abs().max() + 1e-6))


def _outs(r):
    if isinstance(r, dict):
        return [v for v in r.values() if torch.is_tensor(v)]
    return [t for t in (r if isinstance(r, (tuple, list)) else (r,)) if torch.is_tensor(t)]


# backward rows: (row, the kernel a variant replaces); each times the v1 kernel against the variant's
BWD_ROWS = (("bwd_dbc", "ssd_bwd_dbc"), ("bwd_dz_dstates", "ssd_bwd_dz_dstates"), ("bwd_dx", "ssd_bwd_dx"))


def variant_names() -> list[str]:
    """Candidates: every forward (kernels.ssd_helion) and backward (kernels.ssd_helion_bwd) variant but v1."""
    return sorted((set(sh.VARIANTS) | set(sb.VARIANTS)) - {"v1"}, key=lambda v: int(v[1:]))


def row_names(cand: str) -> list[str]:
    """The rows ``cand`` changes, in the order they run."""
    names = []
    fwd = sh.VARIANTS.get(cand, {})
    if fwd.get("ssd_chunk_cumsum") == "ssd_chunk_cumsum_t":
        names.append("chunk_cumsum")
    if "ssd_chunk_scan" in fwd:
        names.append("chunk_scan")
    if "ssd_chunk_state_passing" in fwd:
        names.append("cumsum_state_passing")
    if fwd:
        names.append("ssd_forward")
    bwd = sb.VARIANTS.get(cand)
    if bwd is not None:
        names += [row for row, base in BWD_ROWS if base in sb._variant_map(cand)]
        names.append("ssd_backward")
    return names


def rows(md: dict, cand: str = "v2") -> dict:
    """name -> {arm: fn} with arms mamba_ssm (where one op matches), "v1" and ``cand``; their fns return
    comparable outputs. Only the rows of ``row_names(cand)``."""
    import bench_ssd_fwd

    want = row_names(cand)
    m = bench_ssd_fwd._mamba()
    c = md["c"]
    t = sh.example_inputs(md, "cuda")
    x, dt, A, B, C, D, z, dtb = (t[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias"))
    dA, dto = m.cumsum(dt, A, c, dt_bias=dtb, dt_softplus=True)
    sin, _ = sh.ssd_chunk_state_passing_helion(B, x, dto, dA)
    CB = sh.ssd_bmm_chunk_helion(C, B, c)
    out = {}
    if "chunk_cumsum" in want:
        # dt as the fused op reads it: the last h columns of a zxBCdt-shaped buffer
        (dts, *_), _ = sh._kernel_args("ssd_chunk_cumsum", md, "cuda")
        out["chunk_cumsum"] = {
            "mamba_ssm": lambda: m.cumsum(dts, A, c, dt_bias=dtb, dt_softplus=True),
            "v1": lambda: sh.ssd_chunk_cumsum_helion(dts, A, c, dt_bias=dtb, dt_softplus=True, variant="v1"),
            cand: lambda: sh.ssd_chunk_cumsum_helion(dts, A, c, dt_bias=dtb, dt_softplus=True, variant=cand),
        }
    if "chunk_scan" in want:
        CBc = CB.to(sh.forward_cb_dtype(cand, x.dtype))  # bf16 for the chunk_scan_cb16 variants (v8, v10)
        out["chunk_scan"] = {
            "mamba_ssm": lambda: m.chunk_scan(CB, x, dto, dA, C, sin, D=D, z=z),
            "v1": lambda: sh.ssd_chunk_scan_helion(CB, x, dto, dA, C, sin, D=D, z=z, variant="v1"),
            cand: lambda: sh.ssd_chunk_scan_helion(CBc, x, dto, dA, C, sin, D=D, z=z, variant=cand),
        }
    if "cumsum_state_passing" in want:
        # dt as the fused op reads it: the last h columns of a zxBCdt-shaped buffer
        (Bs, xs, dts, *_), _ = sh._kernel_args("ssd_chunk_cumsum_state_passing", md, "cuda")
        Bs, xs, dts = (v[:, : md["l"]] for v in (Bs, xs, dts))
        p, n = md["p"], md["n"]

        def m_csp():
            dA_, dto_ = m.cumsum(dts, A, c, dt_bias=dtb, dt_softplus=True)
            st = m.chunk_state(Bs, xs, dto_, dA_, states_in_fp32=True)
            si, fin = m.state_passing(st.flatten(-2), dA_[..., -1], chunk_size=c, out_dtype=C.dtype)
            return dA_, dto_, si.unflatten(-1, (p, n)), fin.unflatten(-1, (p, n))

        out["cumsum_state_passing"] = {
            "mamba_ssm": m_csp,
            "v1": lambda: sh.ssd_cumsum_states_helion(Bs, xs, dts, A, c, dt_bias=dtb, dt_softplus=True, variant="v1"),
            cand: lambda: sh.ssd_cumsum_states_helion(Bs, xs, dts, A, c, dt_bias=dtb, dt_softplus=True, variant=cand),
        }
    if "ssd_forward" in want:
        out["ssd_forward"] = {
            "mamba_ssm": lambda: m.combined_fwd(x, dt, A, B, C, c, D=D, z=z, dt_bias=dtb, dt_softplus=True),
            "v1": lambda: sh.ssd_forward_helion(x, dt, A, B, C, c, D=D, z=z, dt_bias=dtb, dt_softplus=True, variant="v1")[:2],
            cand: lambda: sh.ssd_forward_helion(x, dt, A, B, C, c, D=D, z=z, dt_bias=dtb, dt_softplus=True, variant=cand)[:2],
        }
    if "ssd_backward" not in want:
        return {k: out[k] for k in want}
    kd = dict(md)
    for row, base in BWD_ROWS:
        args, dims = sb._example_args(base, kd, "cuda")
        outs = sb._OUT_ARGS[base]

        def mk(name, args=args, dims=dims, outs=outs):
            def f():
                raw = sb._call(name, args, dims)
                return [args[i] for i in outs] + _outs(raw)
            return f

        name = sb._variant_map(cand).get(base)
        if name in sb._COMPOSITE:
            def comp(fn=sb._COMPOSITE[name], args=args, dims=dims, outs=outs):
                return lambda: [args[i] for i in outs] + _outs(fn(args, dims))
            out[row] = {"v1": mk(base), cand: comp()}
        elif name is not None:
            out[row] = {"v1": mk(base), cand: mk(name)}
    # whole Helion SSD backward (forward pieces from the v1 forward)
    o, ox, dto2, dac2, st2, _ = sh.ssd_forward_helion(x, dt, A, B, C, c, D=D, z=z, dt_bias=dtb, dt_softplus=True,
                                                    state_dtype=torch.float32)
    dout = torch.randn_like(o)
    CB2 = sh.ssd_bmm_chunk_helion(C, B, c)

    def bwd(v):
        return lambda: sb.ssd_backward_helion(dout, x, z, ox, dt, A, B, C, D, dtb, dto2, dac2, st2, CB2, c, variant=v)

    out["ssd_backward"] = {"v1": bwd("v1"), cand: bwd(cand)}
    return {k: out[k] for k in want}


def bench(md: dict, rounds: int, iters: int, cand: str = "v2") -> dict:
    res = {"dims": md, "candidate": cand, "rows": {}, "errors": {}}
    for name, arms in rows(md, cand).items():
        try:
            r1 = [o.clone() for o in _outs(arms["v1"]())]  # bwd kernels write into shared buffers
            r2 = _outs(arms[cand]())
            err = max(_err(a, b) for a, b in zip(r2, r1))
            arms = dict(arms, **{"v1#2": arms["v1"]})
            for f in arms.values():
                f()
            torch.cuda.synchronize()
            labels = list(arms)
            samples = {k: [] for k in labels}
            for order in bl.alternating_order(len(labels), rounds):
                for i in order:
                    samples[labels[i]] += bl.time_calls(arms[labels[i]], iters, "cuda")
            r = {"ms": {k: bl.summarize(v) for k, v in samples.items()}, f"{cand}_vs_v1_rel_err": err,
                 f"speedup_{cand}_vs_v1": bl.ratio_summary(samples["v1"], samples[cand]),
                 "control_v1_vs_v1": bl.ratio_summary(samples["v1"], samples["v1#2"])}
            if "mamba_ssm" in samples:
                r["speedup_v1_vs_mamba"] = bl.ratio_summary(samples["mamba_ssm"], samples["v1"])
                r[f"speedup_{cand}_vs_mamba"] = bl.ratio_summary(samples["mamba_ssm"], samples[cand])
            elif name in MAMBA_REF_US:
                r["mamba_ref_us"] = MAMBA_REF_US[name]
            res["rows"][name] = r
            print(f"{name:16s} " + "  ".join(f"{k} {v['median'] * 1e3:8.1f} us" for k, v in r["ms"].items())
                  + f"  {cand}/v1 {r[f'speedup_{cand}_vs_v1']['speedup']:.3f}x  err {err:.2e}", flush=True)
        except Exception:  # noqa: BLE001 - one row failing must not hide the others
            res["errors"][name] = traceback.format_exc()
            print(f"{name} FAILED\n{res['errors'][name]}", flush=True)
    return res


def markdown(res: dict, env: dict) -> str:
    cand = res.get("candidate", "v2")
    body = []
    for name, r in res["rows"].items():
        ms = r["ms"]
        mam = ms["mamba_ssm"]["median"] * 1e3 if "mamba_ssm" in ms else r.get("mamba_ref_us")
        v1, v2 = ms["v1"]["median"] * 1e3, ms[cand]["median"] * 1e3
        sp = r[f"speedup_{cand}_vs_v1"]
        body.append([name, f"{mam:.1f}" + ("" if "mamba_ssm" in ms else " (ref)") if mam else "-", f"{v1:.1f}", f"{v2:.1f}",
                     f"{sp['speedup']:.3f} [{sp['ci_lo']:.3f}, {sp['ci_hi']:.3f}]",
                     f"{mam / v1:.2f}" if mam else "-", f"{mam / v2:.2f}" if mam else "-",
                     f"{r['control_v1_vs_v1']['speedup']:.3f}", f"{r[f'{cand}_vs_v1_rel_err']:.1e}"])
    txt = f"# SSD kernel variants: mamba-ssm vs Helion v1 vs {cand}\n\n" + bl.env_markdown(env) + "\n\n" + bl.md_table(
        ["row", "mamba-ssm us", "v1 us", f"{cand} us", f"{cand}/v1 speedup [95% CI]", "v1 vs mamba", f"{cand} vs mamba",
         "A-vs-A (v1)", f"{cand} vs v1 err"], body)
    for k, e in res["errors"].items():
        txt += f"\n\nERROR {k}:\n```\n{e[-1500:]}\n```"
    return txt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="nano", choices=sorted(tuning.SHAPE_PRESETS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--variant", default="v2", choices=variant_names(),
                    help="the candidate compared with v1")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_ssd_variants.py needs a CUDA GPU")
    env = bl.env_info()
    res = bench(tuning.SHAPE_PRESETS[a.shape], a.rounds, a.iters, a.variant)
    data = {"env": env, "shape": a.shape, "rounds": a.rounds, "iters": a.iters, **res}
    txt = markdown(res, env)
    stem = "ssd_variants_bench" if a.variant == "v2" else f"ssd_variants_bench_{a.variant}"
    jp, mp = bl.write_results(bl.default_out_dir(), stem, data, txt)
    print(txt)
    print(f"wrote {jp} and {mp}")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
