"""Per-kernel counterparts from a ``bench_kernels.py --backend mamba_ssm --compare helion`` result.

Each Helion kernel (or pair) replaces one or more mamba-ssm / causal-conv1d kernels (``GROUPS``: fused kernels
are compared against the sum of what they replace). From the two per-kernel device-time tables that
``bench_kernels.py`` profiled in one process, this reports per group: mamba-ssm us, Helion us and the ratio;
whether any Helion kernel is slower than its counterpart; and the geometric mean over the ten mamba-ssm
kernels with the largest time in the baseline table (``../shared/baselines/h200-mamba-ssm-nano30b.md``; the
benchmark's own elementwise adds and torch reductions are not kernels of the op and are left out), each
mamba-ssm kernel counted with the ratio of the group it belongs to.

    python scripts/kernel_counterparts.py runs/bench/h200/kernels_mamba_ssm_vs_helion_nano.json

Writes ``<input stem>_counterparts.{json,md}`` beside the input (or to --out).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from nano_hybrid.errors import EXIT_BAD_INPUT


# Helion kernels -> the mamba-ssm / causal-conv1d kernels they replace (kernels/ssd_helion_bwd.py docstring).
# mamba-ssm's B9 (_chunk_scan_bwd_ddAcs_stable) is split between ssd_bwd_dx (its intra-chunk part) and
# ssd_bwd_dt (its cumsum, with B10), so those two Helion kernels form one group.
GROUPS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("_helion_rmsnorm_gated_fwd_kernel",): ("_layer_norm_fwd_1pass_kernel",),
    ("_helion_rmsnorm_gated_bwd_kernel",): ("_layer_norm_bwd_kernel",),
    ("_helion_causal_conv1d_fwd_kernel",): ("causal_conv1d_channellast_fwd_kernel",),
    ("_helion_causal_conv1d_bwd_kernel",): ("causal_conv1d_channellast_bwd_kernel",),
    ("_helion__chunk_cumsum_kernel",): ("_chunk_cumsum_fwd_kernel",),
    ("_helion__chunk_state_passing_kernel",): ("_chunk_state_fwd_kernel", "_state_passing_fwd_kernel"),
    ("_helion__bmm_chunk_kernel",): ("_bmm_chunk_fwd_kernel",),
    ("_helion__chunk_scan_kernel",): ("_chunk_scan_fwd_kernel",),
    ("_helion_ssd_bwd_dz_dstates",): ("_chunk_scan_bwd_dz_kernel", "_chunk_scan_bwd_dstates_kernel"),
    ("_helion_ssd_bwd_dstates",): ("_chunk_scan_bwd_dstates_kernel",),  # an ungated SSD output (the norm in the op)
    ("_helion_ssd_bwd_state_passing",): ("_state_passing_bwd_kernel",),
    # dx over row tiles (its ddacs_row and dD partials are summed by torch reduce kernels, not in this group)
    ("_helion_ssd_bwd_dx", "_helion_ssd_bwd_dt"): ("_chunk_scan_chunk_state_bwd_dx_kernel",
                                                  "_chunk_scan_bwd_ddAcs_stable_kernel", "_chunk_cumsum_bwd_kernel"),
    ("_helion_ssd_bwd_dc_dcb", "_helion_ssd_bwd_db"): ("_chunk_state_bwd_db_kernel", "_chunk_scan_bwd_dc_kernel",
                                                      "_chunk_scan_bwd_dcb_kernel", "_bmm_chunk_bwd_kernel"),
}

# the baseline table's kernels by time, largest first, without the benchmark's adds and torch reductions
BASELINE_TOP10 = ("_layer_norm_bwd_kernel", "_chunk_scan_chunk_state_bwd_dx_kernel", "_chunk_scan_fwd_kernel",
                  "_chunk_state_fwd_kernel", "causal_conv1d_channellast_bwd_kernel",
                  "causal_conv1d_channellast_fwd_kernel", "_chunk_scan_bwd_ddAcs_stable_kernel",
                  "_state_passing_fwd_kernel", "_chunk_scan_bwd_dz_kernel", "_state_passing_bwd_kernel")


def _times(table: dict) -> dict[str, float]:
    return {r["kernel"]: float(r["us_per_iter"]) for r in table["rows"]}


def counterparts(mamba_table: dict, helion_table: dict) -> dict:
    """Group rows, the slower groups and the top-10 geometric mean from two kernel tables (profiling.kernel_table)."""
    m, h = _times(mamba_table), _times(helion_table)
    rows, missing = [], []
    for hks, mks in GROUPS.items():
        if not all(k in h for k in hks) or not all(k in m for k in mks):
            continue
        mu, hu = sum(m[k] for k in mks), sum(h[k] for k in hks)
        rows.append({"helion": list(hks), "replaces": list(mks), "mamba_us": mu, "helion_us": hu, "ratio": mu / hu})
    covered = {k for r in rows for k in r["replaces"]}
    # a group is missing when no present group covers its mamba-ssm kernels
    missing = [list(hks) for hks, mks in GROUPS.items() if not set(mks) <= covered]
    # a mamba-ssm kernel replaced by several present groups counts with the last one
    by_member = {k: r["ratio"] for r in rows for k in r["replaces"]}
    top = [(k, by_member[k]) for k in BASELINE_TOP10 if k in by_member]
    geo = math.exp(sum(math.log(r) for _, r in top) / len(top)) if top else None
    return {"groups": sorted(rows, key=lambda r: -r["mamba_us"]), "missing_groups": missing,
            "slower_than_counterpart": [" + ".join(r["helion"]) for r in rows if r["ratio"] < 1.0],
            "top10": [{"mamba_kernel": k, "ratio": r} for k, r in top], "top10_geomean": geo,
            "top10_complete": len(top) == len(BASELINE_TOP10)}


def markdown(res: dict, src: str) -> str:
    lines = [f"# Helion kernels vs the mamba-ssm kernels they replace ({src})", "",
             "Device time per mixer fwd+bwd from one process's profile (`scripts/kernel_counterparts.py`).", "",
             "| Helion kernel(s) | replace | mamba-ssm us | Helion us | ratio |", "|---|---|---|---|---|"]
    for r in res["groups"]:
        lines.append(f"| {' + '.join(f'`{k}`' for k in r['helion'])} | {', '.join(f'`{k}`' for k in r['replaces'])} | {r['mamba_us']:.1f} | "
                     f"{r['helion_us']:.1f} | {r['ratio']:.2f} |")
    g = res["top10_geomean"]
    lines += ["", f"Slower than their counterparts: {', '.join(res['slower_than_counterpart']) or 'none'}.",
              f"Top-10 mamba-ssm kernels of the baseline table, geometric mean of their groups' ratios: "
              f"{'-' if g is None else f'{g:.3f}'}" + ("" if res["top10_complete"] else " (incomplete)") + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result", help="a bench_kernels.py JSON with kernels.mamba_ssm and kernels.helion tables")
    ap.add_argument("--out", default=None, help="output directory (default: beside the input)")
    a = ap.parse_args(argv)
    p = Path(a.result)
    d = json.loads(p.read_text())
    k = d.get("kernels", {})
    if "mamba_ssm" not in k or "helion" not in k:
        print(f"error: {p} has no kernels.mamba_ssm / kernels.helion tables (run bench_kernels.py with "
              "--backend mamba_ssm --compare helion and profiling on)", file=sys.stderr)
        return EXIT_BAD_INPUT
    res = counterparts(k["mamba_ssm"], k["helion"])
    res.update(source=str(p), date=d.get("env", {}).get("date_utc"), gpu=d.get("env", {}).get("gpu"),
               script="scripts/kernel_counterparts.py")
    out = Path(a.out) if a.out else p.parent
    out.mkdir(parents=True, exist_ok=True)
    stem = p.stem + "_counterparts"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res, p.name)
    (out / f"{stem}.md").write_text(md)
    print(md)
    return 0
