"""Compare the step time and loss curves of two or more nano-hybrid runs (A/B of kernel backends).

    python scripts/compare_runs.py runs/tiny-torch-A runs/tiny-helion-B --warmup 10 --out compare/ --json compare/summary.json
    python scripts/compare_runs.py wandb:my-team/nano-hybrid/abc123 wandb:my-team/nano-hybrid/def456

A run is a run directory (or its ``metrics.jsonl`` file) written by ``python -m nano_hybrid.train``, or
``wandb:ENTITY/PROJECT/RUN_ID`` (needs the ``wandb`` package and credentials, e.g. ``WANDB_API_KEY``).
The first run is the baseline: ratios and loss differences are relative to it.

Per run it prints: median and p90 step time over the steps after the first ``--warmup`` steps, their
ratio to the baseline, median tokens/s/GPU over the same steps, the final loss, the mean loss over the
last 10% of steps and over all steps. Per non-baseline run it prints loss-difference statistics over
the steps both runs logged (mean and max of |b - a| and of |b - a| / |a|, over all matching steps and
over the last 10% of them; also the mean of the signed relative difference (b - a) / |a|, in which per-step
noise averages out and a persistent offset stays, and the relative difference of the two mean losses). Plots: ``loss.png`` (loss vs tokens for every run, relative difference to
the baseline below) and ``step_time.png`` (step-time distributions after warm-up).

metrics.jsonl records need ``step``, ``loss``, ``step_time_s``. When every run has validation records
(``val_loss``, from ``train.eval_interval``), the report also compares validation loss at the common
evaluation steps and loss.png shows it as markers. Tokens come from ``tokens``
(cumulative, preferred) or are accumulated from ``tokens_per_step`` / ``tokens_per_s * step_time_s``;
tokens/s/GPU from ``tokens_per_s_per_gpu`` or ``tokens_per_s / world_size`` (``world_size`` from the
record, 1 when absent). When a run was resumed from an older
checkpoint and re-logged some steps, the last record of each step wins (the curve that continued).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nano_hybrid.errors import EXIT_BAD_INPUT


class CompareError(ValueError):
    """Bad input to compare_runs (missing file, no usable records, ...)."""


@dataclass
class Run:
    name: str
    steps: np.ndarray  # int64, sorted, unique
    loss: np.ndarray
    step_time_s: np.ndarray
    tokens: np.ndarray  # cumulative tokens seen after each step
    tokens_per_s_per_gpu: np.ndarray  # NaN where unknown
    backend: str | None = None
    extra: dict = field(default_factory=dict)
    val_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # steps with a validation
    val_loss: np.ndarray = field(default_factory=lambda: np.zeros(0))


def _get(rec: dict, key: str):
    if key in rec:
        return rec[key]
    if key.startswith("val_"):  # W&B: val/loss
        return rec.get(f"val/{key[4:]}")
    return rec.get(f"train/{key}")


def run_from_records(name: str, records: list[dict]) -> Run:
    """Build a Run from metrics records (dicts). The last record of each step wins."""
    by_step: dict[int, dict] = {}
    for rec in records:
        step, loss, dt = _get(rec, "step"), _get(rec, "loss"), _get(rec, "step_time_s")
        if step is None or loss is None or dt is None:
            continue  # other record kinds (e.g. eval lines) carry no training step
        by_step[int(step)] = rec
    if not by_step:
        raise CompareError(f"{name}: no records with step, loss and step_time_s")
    steps = np.array(sorted(by_step), dtype=np.int64)
    recs = [by_step[s] for s in steps]
    loss = np.array([float(_get(r, "loss")) for r in recs])
    dt = np.array([float(_get(r, "step_time_s")) for r in recs])

    tokens = np.full(len(recs), np.nan)
    tps_gpu = np.full(len(recs), np.nan)
    for i, r in enumerate(recs):
        if _get(r, "tokens") is not None:
            tokens[i] = float(_get(r, "tokens"))
        ws = float(_get(r, "world_size") or 1)
        if _get(r, "tokens_per_s_per_gpu") is not None:
            tps_gpu[i] = float(_get(r, "tokens_per_s_per_gpu"))
        elif _get(r, "tokens_per_s") is not None:
            tps_gpu[i] = float(_get(r, "tokens_per_s")) / ws
    if np.isnan(tokens).any():
        # No cumulative count: accumulate tokens per step (assumes no gaps before the first logged step).
        per_step = np.full(len(recs), np.nan)
        for i, r in enumerate(recs):
            if _get(r, "tokens_per_step") is not None:
                per_step[i] = float(_get(r, "tokens_per_step"))
            elif _get(r, "tokens_per_s") is not None:
                per_step[i] = float(_get(r, "tokens_per_s")) * dt[i]
        if np.isnan(per_step).any():
            raise CompareError(f"{name}: records have neither 'tokens' nor 'tokens_per_step'/'tokens_per_s'")
        # steps logged once each: tokens after step s = per-step tokens * s (constant batch), robust to gaps
        tokens = np.round(per_step) * steps if np.allclose(per_step, per_step[0], rtol=1e-3) else np.cumsum(per_step)
    backend = next((str(_get(r, "backend")) for r in recs if _get(r, "backend") is not None), None)
    val = [(int(s), float(_get(r, "val_loss"))) for s, r in zip(steps, recs) if _get(r, "val_loss") is not None]
    return Run(name, steps, loss, dt, tokens, tps_gpu, backend,
               val_steps=np.array([v[0] for v in val], dtype=np.int64), val_loss=np.array([v[1] for v in val]))


def same_tokens_per_step(a: Run, b: Run) -> bool:
    """Whether both runs saw the same tokens by each step they both logged (then steps compare like with like)."""
    common, ia, ib = np.intersect1d(a.steps, b.steps, return_indices=True)
    return bool(common.size) and bool(np.allclose(a.tokens[ia], b.tokens[ib], rtol=1e-9))


def _align(a_x: np.ndarray, a_y: np.ndarray, b_x: np.ndarray, b_y: np.ndarray):
    """(indices into a, a's values, b's values linearly interpolated at a's x) over the x range both cover."""
    keep = np.nonzero((a_x >= b_x[0]) & (a_x <= b_x[-1]))[0] if b_x.size else np.zeros(0, dtype=np.int64)
    return keep, a_y[keep], np.interp(a_x[keep], b_x, b_y)


def val_diff_stats(a: Run, b: Run) -> dict:
    """b's validation loss against a's at the steps both evaluated (same validation batches in both runs); when
    their tokens per step differ, at a's evaluations with b's curve interpolated at the same tokens."""
    if same_tokens_per_step(a, b):
        common, ia, ib = np.intersect1d(a.val_steps, b.val_steps, return_indices=True)
        la, lb = a.val_loss[ia], b.val_loss[ib]
    else:
        a_tok = a.tokens[np.searchsorted(a.steps, a.val_steps)] if a.val_steps.size else np.zeros(0)
        b_tok = b.tokens[np.searchsorted(b.steps, b.val_steps)] if b.val_steps.size else np.zeros(0)
        keep, la, lb = _align(a_tok, a.val_loss, b_tok, b.val_loss)
        common = a.val_steps[keep]
    if common.size == 0:
        return {"baseline": a.name, "run": b.name, "matching_evals": 0}
    rel = (lb - la) / np.abs(la)
    return {"baseline": a.name, "run": b.name, "matching_evals": int(common.size), "last_step": int(common[-1]),
            "final_baseline": float(la[-1]), "final_run": float(lb[-1]), "final_rel_diff": float(rel[-1]),
            "mean_rel_diff": float(np.mean(rel)), "max_abs_rel_diff": float(np.max(np.abs(rel)))}


def load_metrics_jsonl(path: Path) -> list[dict]:
    lines = Path(path).read_text().splitlines()
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            # A run killed mid-write can leave a truncated last line; anything else is corruption.
            if lineno == len(lines):
                continue
            raise CompareError(f"{path}:{lineno}: not a JSON line") from None
    return records


def load_wandb(spec: str) -> list[dict]:
    """``wandb:ENTITY/PROJECT/RUN_ID`` -> the run's logged history (needs wandb and credentials)."""
    path = spec[len("wandb:"):]
    if path.count("/") != 2:
        raise CompareError(f"bad W&B run {spec!r}: expected wandb:ENTITY/PROJECT/RUN_ID")
    try:
        import wandb
    except ImportError:
        raise CompareError("reading W&B runs needs the 'wandb' package (pip install wandb)") from None
    try:
        run = wandb.Api().run(path)
        return [dict(row) for row in run.scan_history()]
    except Exception as e:  # noqa: BLE001 - the API raises many types (auth, network, not found)
        raise CompareError(f"cannot read W&B run {path}: {type(e).__name__}: {e}") from None


def load_run(spec: str) -> Run:
    if spec.startswith("wandb:"):
        return run_from_records(spec, load_wandb(spec))
    p = Path(spec)
    f = p / "metrics.jsonl" if p.is_dir() else p
    if not f.is_file():
        raise CompareError(f"{spec}: no metrics.jsonl there")
    return run_from_records(p.name if p.is_dir() else p.parent.name, load_metrics_jsonl(f))


def _tail(n: int) -> int:
    """How many entries make up 'the last 10%' of n (at least one)."""
    return max(1, math.ceil(0.1 * n))


def _post_warmup(run: Run, warmup: int) -> np.ndarray:
    """Boolean mask of the records after the first ``warmup`` logged steps."""
    mask = np.zeros(len(run.steps), dtype=bool)
    mask[warmup:] = True
    if not mask.any():
        raise CompareError(f"{run.name}: only {len(run.steps)} steps, none left after --warmup {warmup}")
    return mask


def run_stats(run: Run, warmup: int) -> dict:
    m = _post_warmup(run, warmup)
    dt = run.step_time_s[m]
    tps = run.tokens_per_s_per_gpu[m]
    return {
        "name": run.name,
        "backend": run.backend,
        "steps": int(len(run.steps)),
        "last_step": int(run.steps[-1]),
        "tokens": float(run.tokens[-1]),
        "timed_steps": int(m.sum()),
        "step_time_median_s": float(np.median(dt)),
        "step_time_p90_s": float(np.percentile(dt, 90)),
        "tokens_per_s_per_gpu_median": None if np.isnan(tps).all() else float(np.nanmedian(tps)),
        "loss_final": float(run.loss[-1]),
        "loss_mean_last10pct": float(np.mean(run.loss[-_tail(len(run.loss)):])),
        "loss_mean": float(np.mean(run.loss)),
    }


def loss_diff_stats(a: Run, b: Run) -> dict:
    """Statistics of b's loss minus a's over the steps both logged; when their tokens per step differ, at a's steps
    with b's loss interpolated at the same tokens (``aligned_by``)."""
    aligned_by = "steps" if same_tokens_per_step(a, b) else "tokens"
    if aligned_by == "steps":
        common, ia, ib = np.intersect1d(a.steps, b.steps, return_indices=True)
        la, lb = a.loss[ia], b.loss[ib]
    else:
        keep, la, lb = _align(a.tokens, a.loss, b.tokens, b.loss)
        common = a.steps[keep]
    if len(common) == 0:
        return {"matching_steps": 0, "aligned_by": aligned_by}
    absd = np.abs(lb - la)
    reld = absd / np.abs(la)
    signed_reld = (lb - la) / np.abs(la)

    def block(sl):
        return {
            "mean_abs_diff": float(np.mean(absd[sl])),
            "max_abs_diff": float(np.max(absd[sl])),
            "mean_rel_diff": float(np.mean(reld[sl])),
            "max_rel_diff": float(np.max(reld[sl])),
            "mean_diff": float(np.mean((lb - la)[sl])),
            # mean of (b - a) / |a|: the sign says which run is lower; per-step noise averages out here, a
            # persistent offset does not (mean_rel_diff above keeps both)
            "mean_signed_rel_diff": float(np.mean(signed_reld[sl])),
            # the relative difference of the two runs' mean losses over the block
            "rel_diff_of_means": float(np.mean(lb[sl]) / np.mean(la[sl]) - 1.0),
        }

    k = _tail(len(common))
    return {
        "aligned_by": aligned_by,
        "matching_steps": int(len(common)),
        "first_step": int(common[0]),
        "last_step": int(common[-1]),
        "all": block(slice(None)),
        "last10pct": {"steps": int(k), **block(slice(len(common) - k, None))},
    }


def compare(runs: list[Run], warmup: int) -> dict:
    stats = [run_stats(r, warmup) for r in runs]
    base = stats[0]
    for s in stats:
        s["step_time_median_ratio"] = s["step_time_median_s"] / base["step_time_median_s"]
        s["step_time_p90_ratio"] = s["step_time_p90_s"] / base["step_time_p90_s"]
    diffs = [{"baseline": runs[0].name, "run": r.name, **loss_diff_stats(runs[0], r)} for r in runs[1:]]
    out = {"warmup_steps": warmup, "baseline": runs[0].name, "runs": stats, "loss_diff": diffs}
    if all(r.val_steps.size for r in runs):  # validation loss, when every run has it
        out["val_loss_diff"] = [val_diff_stats(runs[0], r) for r in runs[1:]]
    return out


def format_report(result: dict) -> str:
    def f(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    lines = [f"baseline: {result['baseline']}   (step-time stats exclude the first {result['warmup_steps']} steps)", ""]
    hdr = f"{'run':<28} {'steps':>6} {'median s':>10} {'p90 s':>10} {'med ratio':>9} {'p90 ratio':>9} {'tok/s/GPU':>11} {'final loss':>10} {'loss last10%':>12} {'loss mean':>10}"
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for s in result["runs"]:
        lines.append(
            f"{s['name'][:28]:<28} {s['steps']:>6} {s['step_time_median_s']:>10.4f} {s['step_time_p90_s']:>10.4f} "
            f"{s['step_time_median_ratio']:>9.3f} {s['step_time_p90_ratio']:>9.3f} {f(s['tokens_per_s_per_gpu_median'], '11.1f'):>11} "
            f"{s['loss_final']:>10.5f} {s['loss_mean_last10pct']:>12.5f} {s['loss_mean']:>10.5f}"
        )
    for d in result["loss_diff"]:
        lines.append("")
        if d["matching_steps"] == 0:
            lines.append(f"loss diff {d['run']} vs {d['baseline']}: no matching steps")
            continue
        if d.get("aligned_by") == "tokens":
            lines.append(f"note: {d['run']} and {d['baseline']} differ in tokens per step: the loss is compared at equal "
                         f"tokens ({d['run']} interpolated at {d['baseline']}'s steps), and step time ratios compare "
                         "steps of different sizes (compare tok/s/GPU)")
            lines.append(f"loss diff {d['run']} vs {d['baseline']} at the tokens of {d['matching_steps']} baseline steps "
                         f"({d['first_step']}..{d['last_step']}):")
        else:
            lines.append(f"loss diff {d['run']} vs {d['baseline']} over {d['matching_steps']} matching steps "
                         f"({d['first_step']}..{d['last_step']}):")
        for label, blk in (("all", d["all"]), (f"last 10% ({d['last10pct']['steps']} steps)", d["last10pct"])):
            lines.append(f"  {label:<22} mean|d| {blk['mean_abs_diff']:.3e}  max|d| {blk['max_abs_diff']:.3e}  "
                         f"mean rel {blk['mean_rel_diff']:.3e}  max rel {blk['max_rel_diff']:.3e}  mean d {blk['mean_diff']:+.3e}  "
                         f"mean signed rel {blk['mean_signed_rel_diff']:+.3e}")
    for d in result.get("val_loss_diff", []):
        lines.append("")
        if d["matching_evals"] == 0:
            lines.append(f"val loss {d['run']} vs {d['baseline']}: no common evaluation steps")
            continue
        lines.append(f"val loss {d['run']} vs {d['baseline']} over {d['matching_evals']} common evaluations: "
                     f"at step {d['last_step']} {d['final_run']:.5f} vs {d['final_baseline']:.5f} "
                     f"(rel {d['final_rel_diff']:+.3e}), mean rel {d['mean_rel_diff']:+.3e}, "
                     f"max |rel| {d['max_abs_rel_diff']:.3e}")
    return "\n".join(lines)


def plot(runs: list[Run], warmup: int, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, (ax, axd) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]},
                                  layout="constrained")
    for r in runs:
        ax.plot(r.tokens, r.loss, lw=1.2, label=r.name)
        if r.val_steps.size:  # validation loss as markers at the tokens of its steps
            vt = r.tokens[np.searchsorted(r.steps, r.val_steps)]
            ax.plot(vt, r.val_loss, "o--", ms=3, lw=0.8, label=f"{r.name} (val)")
    ax.set_ylabel("loss")
    ax.set_title("loss vs tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    base = runs[0]
    for r in runs[1:]:
        common, ia, ib = np.intersect1d(base.steps, r.steps, return_indices=True)
        if len(common):
            axd.plot(base.tokens[ia], (r.loss[ib] - base.loss[ia]) / np.abs(base.loss[ia]), lw=1.0, label=r.name)
    axd.axhline(0.0, color="k", lw=0.6)
    axd.set_ylabel(f"rel. diff vs\n{base.name[:20]}")
    axd.set_xlabel("tokens")
    axd.grid(alpha=0.3)
    loss_png = out_dir / "loss.png"
    fig.savefig(loss_png, dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
    data = [r.step_time_s[_post_warmup(r, warmup)] for r in runs]
    ax.boxplot(data, showfliers=True)
    ax.set_xticks(range(1, len(runs) + 1), [r.name[:24] for r in runs], fontsize=8, rotation=20, ha="right")
    ax.set_ylabel("step time (s)")
    ax.set_title(f"step time after {warmup} warm-up steps")
    ax.grid(alpha=0.3, axis="y")
    st_png = out_dir / "step_time.png"
    fig.savefig(st_png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [loss_png, st_png]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run dirs, metrics.jsonl files or wandb:ENTITY/PROJECT/RUN_ID (first = baseline)")
    ap.add_argument("--warmup", type=int, default=10, help="logged steps left out of step-time stats (default 10)")
    ap.add_argument("--out", type=Path, default=Path("compare"), help="directory for loss.png and step_time.png")
    ap.add_argument("--json", type=Path, default=None, help="write the numbers to this JSON file")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    if len(args.runs) < 2:
        ap.error("give at least two runs")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    try:
        runs = [load_run(s) for s in args.runs]
        result = compare(runs, args.warmup)
    except CompareError as e:
        print(f"compare_runs: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_report(result))
    if not args.no_plots:
        result["plots"] = [str(p) for p in plot(runs, args.warmup, args.out)]
        print("\nplots: " + ", ".join(result["plots"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"json: {args.json}")
    return 0
