"""Groups of runs per arm (seeds of one configuration): seed bands, and the final validation-loss difference of two
arms with a 95% interval from the seed spread (scripts/compare_seeds.py is the command line).

Inputs are run directories with ``metrics.jsonl`` (the last record of each step wins, as after a resume from an
older checkpoint; a truncated last line is ignored) and, when present, ``config.yaml`` (the run's ``seed``).
Every run of every arm must have the same ``tokens_per_step``: the curves are compared step by step, which is
token by token only then; runs that differ are refused with one line.

Method:
- final validation loss: each run's ``val_loss`` at the last evaluation step that all runs of all arms reached
  (runs stopped at different steps are compared where all of them are);
- per arm: mean, sample standard deviation (n - 1), min and max over its runs (the seed-to-seed spread);
- difference ``arm - baseline`` of the mean final validation losses, with the 95% Welch t interval over seeds:
  ``d +- t(0.975, nu) sqrt(s_a^2/n_a + s_b^2/n_b)``, ``nu`` by Welch-Satterthwaite (arms may differ in spread and
  size; each needs >= 2 runs). The relative difference and interval divide by the baseline arm's mean. When the
  two arms ran the same seeds (same initial weights and data order in both), the paired t interval over the
  per-seed differences (``t(0.975, n - 1)``) is reported beside it;
- a reference relative difference (e.g. an earlier single-seed result) is "inside" when it lies in the relative
  Welch interval;
- bands per step: training loss smoothed by a trailing mean over ``smooth`` logged steps (fewer at the start),
  then per arm the mean and min/max over runs, and the difference of the arm means with its per-step Welch 95%
  band; validation loss likewise at the evaluation steps common to all runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


class StudyError(ValueError):
    """Bad input to the study comparison (missing runs, mismatched tokens per step, too few runs)."""


@dataclass
class RunCurve:
    name: str
    steps: np.ndarray
    loss: np.ndarray
    val_steps: np.ndarray
    val_loss: np.ndarray
    tokens_per_step: tuple[int, ...]  # the distinct values the run logged
    seed: int | None = None
    extra: dict = field(default_factory=dict)


def load_run(path: str | Path) -> RunCurve:
    p = Path(path)
    f = p / "metrics.jsonl" if p.is_dir() else p
    run_dir = p if p.is_dir() else p.parent
    if not f.is_file():
        raise StudyError(f"{path}: no metrics.jsonl there")
    lines = f.read_text().splitlines()
    by_step: dict[int, dict] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines):  # a run killed mid-write
                continue
            raise StudyError(f"{f}:{lineno}: not a JSON line") from None
        if isinstance(rec, dict) and rec.get("step") is not None:
            by_step[int(rec["step"])] = rec
    train = [(s, r) for s, r in sorted(by_step.items()) if r.get("loss") is not None]
    if not train:
        raise StudyError(f"{f}: no records with step and loss")
    val = [(s, float(r["val_loss"])) for s, r in sorted(by_step.items()) if r.get("val_loss") is not None]
    tps = tuple(sorted({int(r["tokens_per_step"]) for _, r in train if r.get("tokens_per_step") is not None}))
    if not tps:
        raise StudyError(f"{f}: records carry no tokens_per_step")
    seed = None
    cfg = run_dir / "config.yaml"
    if cfg.is_file():
        from omegaconf import OmegaConf

        seed = OmegaConf.load(cfg).get("seed")
    return RunCurve(run_dir.name, np.array([s for s, _ in train], dtype=np.int64),
                    np.array([float(r["loss"]) for _, r in train]),
                    np.array([s for s, _ in val], dtype=np.int64), np.array([v for _, v in val]), tps,
                    None if seed is None else int(seed))


# ------------------------------------------------------------------------------ Student t
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbeta = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbeta) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbeta) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` (real, > 0) degrees of freedom (bisection on the CDF)."""
    if not 0 < p < 1 or not df > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def welch_interval(base: np.ndarray, arm: np.ndarray, level: float = 0.95) -> dict:
    """mean(arm) - mean(base) with its Welch t interval; both need >= 2 values."""
    a, b = np.asarray(base, float), np.asarray(arm, float)
    if a.size < 2 or b.size < 2:
        raise StudyError(f"a Welch interval needs >= 2 runs per arm, got {a.size} and {b.size}")
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    diff = float(b.mean() - a.mean())
    se = math.sqrt(va + vb)
    if se == 0.0:
        return {"diff": diff, "se": 0.0, "df": None, "t": None, "low": diff, "high": diff}
    df = (va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1))
    t = t_quantile(0.5 + level / 2.0, df)
    return {"diff": diff, "se": se, "df": df, "t": t, "low": diff - t * se, "high": diff + t * se}


def paired_interval(diffs: np.ndarray, level: float = 0.95) -> dict:
    d = np.asarray(diffs, float)
    if d.size < 2:
        raise StudyError(f"a paired interval needs >= 2 pairs, got {d.size}")
    se = float(d.std(ddof=1) / math.sqrt(d.size))
    t = t_quantile(0.5 + level / 2.0, d.size - 1)
    m = float(d.mean())
    return {"diff": m, "se": se, "df": d.size - 1, "t": t, "low": m - t * se, "high": m + t * se, "pairs": int(d.size)}


# ------------------------------------------------------------------------------ study
def smooth_trailing(x: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` values (fewer at the start)."""
    if window <= 1:
        return np.asarray(x, float)
    c = np.concatenate([[0.0], np.cumsum(np.asarray(x, float))])
    idx = np.arange(1, len(x) + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def _common(arrays: list[np.ndarray]) -> np.ndarray:
    out = arrays[0]
    for a in arrays[1:]:
        out = np.intersect1d(out, a)
    return out


def _at(steps: np.ndarray, values: np.ndarray, want: np.ndarray) -> np.ndarray:
    return values[np.searchsorted(steps, want)]


def _band(mat: np.ndarray) -> dict:
    """Per column of runs x points: mean, min, max, std (n - 1)."""
    return {"mean": mat.mean(0).tolist(), "min": mat.min(0).tolist(), "max": mat.max(0).tolist(),
            "std": (mat.std(0, ddof=1) if mat.shape[0] > 1 else np.zeros(mat.shape[1])).tolist()}


def _diff_band(base: np.ndarray, arm: np.ndarray) -> dict:
    diff, half = [], []
    for j in range(base.shape[1]):
        w = welch_interval(base[:, j], arm[:, j])
        diff.append(w["diff"])
        half.append(w["high"] - w["diff"])
    return {"diff": diff, "half_width_95": half}


def check_tokens_per_step(arms: dict[str, list[RunCurve]]) -> int:
    seen = {(arm, r.name): r.tokens_per_step for arm, runs in arms.items() for r in runs}
    values = set(seen.values())
    if len(values) != 1 or len(next(iter(values))) != 1:
        listing = ", ".join(f"{arm}/{name}={'/'.join(map(str, v))}" for (arm, name), v in seen.items())
        raise StudyError(f"runs differ in tokens per step (compared step by step, they must match): {listing}")
    return next(iter(values))[0]


def compare_arms(arms: dict[str, list[RunCurve]], baseline: str, *, smooth: int = 50,
                 reference_rel: float | None = None, level: float = 0.95) -> dict:
    if baseline not in arms:
        raise StudyError(f"baseline arm {baseline!r} is not among the arms {list(arms)}")
    if len(arms) < 2:
        raise StudyError("give at least two arms")
    for name, runs in arms.items():
        if len(runs) < 2:
            raise StudyError(f"arm {name} has {len(runs)} run(s); the interval from the seed spread needs >= 2")
    tps = check_tokens_per_step(arms)
    all_runs = [r for runs in arms.values() for r in runs]
    val_common = _common([r.val_steps for r in all_runs])
    if val_common.size == 0:
        raise StudyError("no validation step is common to all runs (train.eval_interval, same for every run)")
    final_step = int(val_common[-1])
    train_common = _common([r.steps for r in all_runs])
    result = {
        "method": ("final validation loss at the last evaluation step all runs reached; difference of arm means with "
                   f"the {level:.0%} Welch t interval over seeds (Welch-Satterthwaite df), relative = / baseline mean; "
                   "paired t interval over per-seed differences when both arms ran the same seeds; training loss "
                   f"smoothed by a trailing mean over {smooth} logged steps"),
        "tokens_per_step": tps, "baseline": baseline, "final_val_step": final_step,
        "final_val_tokens": final_step * tps, "smooth": smooth, "level": level,
        "runs": {a: [{"name": r.name, "seed": r.seed, "last_step": int(r.steps[-1]),
                      "last_val_step": int(r.val_steps[-1]) if r.val_steps.size else None} for r in runs]
                 for a, runs in arms.items()},
        "arms": {}, "diffs": {}, "bands": {"val_steps": val_common.tolist(), "train_steps": train_common.tolist(),
                                          "val": {}, "train": {}, "val_diff": {}, "train_diff": {}},
    }
    finals, val_mats, train_mats = {}, {}, {}
    for a, runs in arms.items():
        finals[a] = np.array([float(_at(r.val_steps, r.val_loss, np.array([final_step]))[0]) for r in runs])
        f = finals[a]
        result["arms"][a] = {"runs": len(runs), "final_val_loss": f.tolist(), "mean": float(f.mean()),
                             "std": float(f.std(ddof=1)), "min": float(f.min()), "max": float(f.max()),
                             "seeds": [r.seed for r in runs]}
        val_mats[a] = np.stack([_at(r.val_steps, r.val_loss, val_common) for r in runs])
        train_mats[a] = np.stack([_at(r.steps, smooth_trailing(r.loss, smooth), train_common) for r in runs])
        result["bands"]["val"][a] = _band(val_mats[a])
        result["bands"]["train"][a] = _band(train_mats[a])
    base_mean = result["arms"][baseline]["mean"]
    for a in arms:
        if a == baseline:
            continue
        w = welch_interval(finals[baseline], finals[a], level)
        d = {"welch": w, "rel_diff": w["diff"] / base_mean, "rel_low": w["low"] / base_mean,
             "rel_high": w["high"] / base_mean}
        seeds_b = [r.seed for r in arms[baseline]]
        seeds_a = [r.seed for r in arms[a]]
        if None not in seeds_a and None not in seeds_b and sorted(seeds_a) == sorted(seeds_b) \
                and len(set(seeds_a)) == len(seeds_a):
            order_b = {s: i for i, s in enumerate(seeds_b)}
            per_seed = np.array([finals[a][i] - finals[baseline][order_b[s]] for i, s in enumerate(seeds_a)])
            p = paired_interval(per_seed, level)
            d["paired"] = {**p, "rel_low": p["low"] / base_mean, "rel_high": p["high"] / base_mean,
                           "per_seed_diff": per_seed.tolist()}
        if reference_rel is not None:
            d["reference_rel"] = reference_rel
            d["reference_inside"] = bool(d["rel_low"] <= reference_rel <= d["rel_high"])
        result["diffs"][a] = d
        result["bands"]["val_diff"][a] = _diff_band(val_mats[baseline], val_mats[a])
        result["bands"]["train_diff"][a] = _diff_band(train_mats[baseline], train_mats[a])
    return result


def format_markdown(result: dict) -> str:
    b = result["baseline"]
    lines = [f"Final validation loss at step {result['final_val_step']} ({result['final_val_tokens']:,} tokens per "
             f"run, {result['tokens_per_step']:,} tokens per step). Method: {result['method']}.", "",
             "| arm | runs | seeds | mean | std (seed spread) | min | max |", "|---|---|---|---|---|---|---|"]
    for a, s in result["arms"].items():
        seeds = ",".join("?" if x is None else str(x) for x in s["seeds"])
        lines.append(f"| {a} | {s['runs']} | {seeds} | {s['mean']:.5f} | {s['std']:.5f} | {s['min']:.5f} | {s['max']:.5f} |")
    lines += ["", f"| arm - {b} | diff | rel. diff | 95% Welch interval (rel.) | df | paired 95% interval (rel.) "
                  "| reference inside |", "|---|---|---|---|---|---|---|"]
    for a, d in result["diffs"].items():
        w = d["welch"]
        df = "n/a" if w["df"] is None else f"{w['df']:.1f}"
        paired = (f"[{d['paired']['rel_low']:+.3%}, {d['paired']['rel_high']:+.3%}]" if "paired" in d else "n/a")
        ref = ("n/a" if "reference_rel" not in d else
               f"{d['reference_rel']:+.3%}: {'yes' if d['reference_inside'] else 'no'}")
        lines.append(f"| {a} | {w['diff']:+.5f} | {d['rel_diff']:+.3%} | [{w['low']:+.5f}, {w['high']:+.5f}] "
                     f"([{d['rel_low']:+.3%}, {d['rel_high']:+.3%}]) | {df} | {paired} | {ref} |")
    lines += ["", "| arm | run | seed | last step | last val step |", "|---|---|---|---|---|"]
    for a, runs in result["runs"].items():
        for r in runs:
            lines.append(f"| {a} | {r['name']} | {r['seed']} | {r['last_step']} | {r['last_val_step']} |")
    return "\n".join(lines) + "\n"


def plot_study(result: dict, out_dir: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bands, base = result["bands"], result["baseline"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), sharex="col", constrained_layout=True)
    ts, vs = np.array(bands["train_steps"]), np.array(bands["val_steps"])
    for (row, kind, steps, label) in ((0, "train", ts, f"training loss (trailing mean of {result['smooth']})"),
                                      (0, "val", vs, "validation loss")):
        ax = axes[row, 0 if kind == "train" else 1]
        for a, band in bands[kind].items():
            line, = ax.plot(steps, band["mean"], lw=1.2, label=f"{a} (mean of {result['arms'][a]['runs']})")
            ax.fill_between(steps, band["min"], band["max"], color=line.get_color(), alpha=0.25, lw=0)
        ax.set_title(f"{label}: mean, band = min..max over seeds")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    base_mean = {k: np.array(bands[k][base]["mean"]) for k in ("train", "val")}
    for col, kind, steps in ((0, "train", ts), (1, "val", vs)):
        ax = axes[1, col]
        for a, db in bands[f"{kind}_diff"].items():
            diff, half = np.array(db["diff"]), np.array(db["half_width_95"])
            rel, relh = 100 * diff / base_mean[kind], 100 * half / base_mean[kind]
            line, = ax.plot(steps, rel, lw=1.2, label=f"{a} - {base}")
            ax.fill_between(steps, rel - relh, rel + relh, color=line.get_color(), alpha=0.25, lw=0)
        ax.axhline(0.0, color="k", lw=0.6)
        for a, d in result["diffs"].items():
            if "reference_rel" in d:
                ax.axhline(100 * d["reference_rel"], color="tab:red", lw=0.8, ls="--", label="reference")
                break
        ax.set_title(f"{'training' if kind == 'train' else 'validation'} loss difference of arm means, "
                     "band = 95% Welch interval")
        ax.set_ylabel(f"(arm - {base}) / {base}, %")
        ax.set_xlabel(f"step ({result['tokens_per_step']:,} tokens per step)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    path = out_dir / "seed_bands.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
