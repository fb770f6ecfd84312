"""Summarize a training run's metrics.jsonl, and optionally check its losses against a reference run.

    python scripts/run_summary.py RUN_DIR [--out summary.json]
    python scripts/run_summary.py RUN_DIR --ref REF_RUN_DIR --steps 50 --rtol 0.02 --out check.json
    python scripts/run_summary.py RUN_DIR --ref REF_RUN_DIR --rtol 0.02 --rtol-first 2e-3 --mean-rtol 5e-3

Summary: steps run, first/last loss, NaN/inf losses, median step time (after --skip warm-up steps),
median tokens/s/GPU and TFLOP/s/GPU, peak memory. With --ref (e.g. a DP2/TP2/EP2 run against the
single-GPU run with the same global batch, seed and data): per-step relative loss difference
|loss - ref| / |ref| over the first --steps steps; the check passes when every step has both losses,
none is NaN, the largest difference is <= --rtol and the step-1 difference is <= --rtol-first (and,
with --mean-rtol, the mean of the per-step differences is <= --mean-rtol).
Exit code 1 when the check fails (the JSON is written either way); a missing, empty or non-JSON metrics file stops
with one ``error: ...`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from nano_hybrid.bench import stats
from nano_hybrid.errors import EXIT_BAD_INPUT


def load_metrics(run_dir: Path | str) -> list[dict]:
    p = Path(run_dir)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.is_file():
        raise FileNotFoundError(f"no metrics file at {p}")
    recs = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{i}: not a JSON line ({e})") from None
    if not recs:
        raise ValueError(f"{p} holds no records")
    # after a resume the same step may appear twice: keep the last record of each step
    try:
        by_step = {int(r["step"]): r for r in recs}
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{p}: a record without a step number (not a run's metrics.jsonl)") from None
    return [by_step[s] for s in sorted(by_step)]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


DEFAULT_SKIP = 5  # warm-up steps left out of the step-time medians


def summarize_run(recs: list[dict], skip: int = DEFAULT_SKIP) -> dict:
    losses = [r.get("loss") for r in recs]
    bad = [int(r["step"]) for r in recs if not _finite(r.get("loss"))]
    timed = recs[skip:] if len(recs) > skip else recs

    def med(key):
        xs = [r[key] for r in timed if _finite(r.get(key))]
        return stats.median(xs) if xs else None

    mems = [r["mem_gb"] for r in recs if _finite(r.get("mem_gb"))]
    return {
        "steps": len(recs),
        "first_step": int(recs[0]["step"]),
        "last_step": int(recs[-1]["step"]),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "nonfinite_loss_steps": bad,
        "no_nan": not bad,
        "timed_from_step": int(timed[0]["step"]),
        "median_step_time_s": med("step_time_s"),
        "p90_step_time_s": (stats.percentile([r["step_time_s"] for r in timed if _finite(r.get("step_time_s"))], 90)
                            if any(_finite(r.get("step_time_s")) for r in timed) else None),
        "median_tokens_per_s_per_gpu": med("tokens_per_s_per_gpu"),
        "median_tflops_per_gpu": med("tflops_per_gpu"),
        "peak_mem_gb": max(mems) if mems else None,
        "backend": recs[-1].get("backend"),
        "world_size": recs[-1].get("world_size"),
    }


def compare_losses(recs: list[dict], ref: list[dict], steps: int, rtol: float, rtol_first: float,
                   mean_rtol: float | None = None) -> dict:
    a = {int(r["step"]): r.get("loss") for r in recs}
    b = {int(r["step"]): r.get("loss") for r in ref}
    first = min(b)
    want = list(range(first, first + steps))
    missing = [s for s in want if s not in a or s not in b]
    diffs = {}
    nonfinite = []
    for s in want:
        if s in a and s in b:
            if not (_finite(a[s]) and _finite(b[s])):
                nonfinite.append(s)
                continue
            diffs[s] = abs(a[s] - b[s]) / max(abs(b[s]), 1e-12)
    max_d = max(diffs.values()) if diffs else None
    mean_d = sum(diffs.values()) / len(diffs) if diffs else None
    first_d = diffs.get(first)
    passed = (not missing and not nonfinite and max_d is not None and max_d <= rtol
              and first_d is not None and first_d <= rtol_first
              and (mean_rtol is None or mean_d <= mean_rtol))
    return {
        "steps_compared": len(diffs),
        "steps_wanted": steps,
        "missing_steps": missing,
        "nonfinite_steps": nonfinite,
        "rtol": rtol,
        "rtol_first": rtol_first,
        "mean_rtol": mean_rtol,
        "first_step_rel_diff": first_d,
        "max_rel_diff": max_d,
        "max_rel_diff_step": max(diffs, key=diffs.get) if diffs else None,
        "mean_rel_diff": mean_d,
        "rel_diff_per_step": {str(s): d for s, d in diffs.items()},
        "passed": passed,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--ref", default=None, help="reference run dir (or metrics.jsonl) to compare losses with")
    p.add_argument("--steps", type=int, default=50, help="compare the first N steps (default 50)")
    p.add_argument("--rtol", type=float, default=0.02, help="max per-step relative loss difference (default 0.02)")
    p.add_argument("--rtol-first", type=float, default=5e-3, help="max relative difference at the first step")
    p.add_argument("--mean-rtol", type=float, default=None,
                   help="also require the mean per-step relative difference <= this (default: not checked)")
    p.add_argument("--skip", type=int, default=None,
                   help=f"warm-up steps left out of step-time medians (default {DEFAULT_SKIP}; a run shorter than the "
                        "default is timed whole)")
    p.add_argument("--label", default=None)
    p.add_argument("--out", default=None, help="write the JSON here (default: print only)")
    a = p.parse_args(argv)
    explicit_skip = a.skip is not None
    a.skip = DEFAULT_SKIP if a.skip is None else a.skip
    if a.steps < 1 or a.rtol <= 0 or a.rtol_first <= 0 or a.skip < 0 or (a.mean_rtol is not None and a.mean_rtol <= 0):
        print("error: --steps must be >= 1, --rtol/--rtol-first/--mean-rtol > 0, --skip >= 0", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        recs = load_metrics(a.run_dir)
        ref = load_metrics(a.ref) if a.ref else None
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    short = min(len(recs), len(ref) if ref else len(recs))
    if explicit_skip and a.skip >= short:  # an explicit --skip is honoured or refused
        print(f"error: --skip {a.skip} leaves no step to time (the run holds {short} steps)", file=sys.stderr)
        return EXIT_BAD_INPUT
    res = {"run_dir": str(a.run_dir), "label": a.label, "summary": summarize_run(recs, a.skip)}
    ok = res["summary"]["no_nan"]
    if a.ref:
        res["ref_dir"] = str(a.ref)
        res["ref_summary"] = summarize_run(ref, a.skip)
        res["loss_check"] = compare_losses(recs, ref, a.steps, a.rtol, a.rtol_first, a.mean_rtol)
        ok = ok and res["loss_check"]["passed"]
    res["passed"] = ok
    text = json.dumps(res, indent=2)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    s = res["summary"]
    line = (f"{a.label or a.run_dir}: {s['steps']} steps, loss {s['first_loss']} -> {s['last_loss']}, "
            f"no NaN {s['no_nan']}, median step {s['median_step_time_s']} s, "
            f"tokens/s/GPU {s['median_tokens_per_s_per_gpu']}, TFLOP/s/GPU {s['median_tflops_per_gpu']}, "
            f"peak mem {s['peak_mem_gb']} GB")
    if a.ref:
        c = res["loss_check"]
        line += (f"; vs ref over {c['steps_compared']}/{c['steps_wanted']} steps: max rel diff {c['max_rel_diff']} "
                 f"(tol {c['rtol']}), first {c['first_step_rel_diff']} (tol {c['rtol_first']}), "
                 f"mean {c['mean_rel_diff']} (tol {c['mean_rtol']}) -> "
                 f"{'PASS' if c['passed'] else 'FAIL'}")
    print(line)
    return 0 if ok else 1
