"""Statistics of timed samples (percentiles, summaries, bootstrap ratio CIs), the ABBA alternation
schedule of arms, and call timing (CUDA events on a GPU, a synchronized host clock on the CPU)."""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from typing import Callable, Sequence


def _check_samples(xs: Sequence[float], what: str = "samples") -> list[float]:
    xs = [float(x) for x in xs]
    if not xs:
        raise ValueError(f"no {what}: need at least one value")
    if any(math.isnan(x) for x in xs):
        raise ValueError(f"{what} contain NaN")
    return xs


def percentile(xs: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    s = sorted(_check_samples(xs))
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    frac = pos - lo
    return s[lo] + (s[hi] - s[lo]) * frac


def median(xs: Sequence[float]) -> float:
    return percentile(xs, 50.0)


def mean(xs: Sequence[float]) -> float:
    xs = _check_samples(xs)
    return sum(xs) / len(xs)


def summarize(xs: Sequence[float]) -> dict:
    """median / p10 / p90 / mean / min / max / n of a list of times."""
    xs = _check_samples(xs)
    return {
        "n": len(xs),
        "median": median(xs),
        "p10": percentile(xs, 10.0),
        "p90": percentile(xs, 90.0),
        "mean": mean(xs),
        "min": min(xs),
        "max": max(xs),
    }


def bootstrap_ratio_ci(
    a: Sequence[float],
    b: Sequence[float],
    *,
    stat: Callable[[Sequence[float]], float] = median,
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float, float]:
    """stat(a) / stat(b) and its (1 - alpha) percentile-bootstrap interval, resampling a and b independently.

    With a = baseline times and b = candidate times this is the candidate's speedup.
    Returns (point, lo, hi).
    """
    a = _check_samples(a, "baseline samples")
    b = _check_samples(b, "candidate samples")
    if n_boot < 100:
        raise ValueError(f"n_boot must be >= 100 for a meaningful interval, got {n_boot}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    sb = stat(b)
    if sb <= 0:
        raise ValueError("candidate statistic must be positive to form a ratio")
    point = stat(a) / sb
    rng = random.Random(seed)
    ratios = []
    for _ in range(n_boot):
        ra = [a[rng.randrange(len(a))] for _ in range(len(a))]
        rb = [b[rng.randrange(len(b))] for _ in range(len(b))]
        ratios.append(stat(ra) / stat(rb))
    return point, percentile(ratios, 100.0 * alpha / 2), percentile(ratios, 100.0 * (1 - alpha / 2))


def ratio_summary(baseline: Sequence[float], candidate: Sequence[float], **kw) -> dict:
    """{'speedup', 'ci_lo', 'ci_hi', 'ci_level'}: stat(baseline)/stat(candidate) with a bootstrap CI (``stat``: the
    median unless given, e.g. ``stat=mean``)."""
    alpha = kw.get("alpha", 0.05)
    point, lo, hi = bootstrap_ratio_ci(baseline, candidate, **kw)
    return {"speedup": point, "ci_lo": lo, "ci_hi": hi, "ci_level": 1.0 - alpha}


def arm_labels(backends: Sequence[str]) -> list[str]:
    """Unique labels for arms; a backend listed twice (A-vs-A control) becomes 'name', 'name#2'."""
    seen: dict[str, int] = defaultdict(int)
    out = []
    for b in backends:
        seen[b] += 1
        out.append(b if seen[b] == 1 else f"{b}#{seen[b]}")
    return out


def alternating_order(n_arms: int, rounds: int) -> list[list[int]]:
    """Order of arms per round: forward on even rounds, reversed on odd ones (ABBA...), so no arm
    always runs first after a switch."""
    if n_arms < 1 or rounds < 1:
        raise ValueError(f"need n_arms >= 1 and rounds >= 1, got {n_arms}, {rounds}")
    base = list(range(n_arms))
    return [base if r % 2 == 0 else base[::-1] for r in range(rounds)]


def sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], object], iters: int, device) -> list[float]:
    """Per-call times in milliseconds: CUDA events on a GPU, synchronized perf_counter on the CPU."""
    import torch

    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    out = []
    if str(device).startswith("cuda"):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        torch.cuda.synchronize(device)
        for i in range(iters):
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize(device)
        out = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def time_arms(fns: dict[str, Callable[[], object]], *, warmup: int, rounds: int, iters: int,
              device) -> dict[str, list[float]]:
    """Per-call times (ms) of each arm of ``fns`` (name -> zero-argument call): ``warmup`` untimed calls each, then
    ``rounds`` alternating rounds (``alternating_order``) of ``iters`` timed calls per arm."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for order in alternating_order(len(names), rounds):
        for i in order:
            times[names[i]] += time_calls(fns[names[i]], iters, device)
    return times
