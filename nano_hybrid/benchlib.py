"""Shared helpers for the benchmark scripts (bench_kernels.py, bench_layers.py, ab_step_time.py).

Measurement method (same in every script):
- warm up first (Triton/Helion compilation and autotuning stay out of the numbers);
- time on the device with CUDA events (or a synchronized host clock), many repeats, report medians;
- when two implementations are compared, alternate them over rounds in one process, so drift and
  thermal state hit both equally, and run an A-vs-A control (the same arm twice): a difference
  between arms smaller than the control's spread is noise;
- ratios come with a bootstrap confidence interval.

Only stdlib + torch at import time (``bench_main`` imports kernels/nano_hybrid when called);
importing this module never touches CUDA.
"""

from __future__ import annotations

import bisect
import contextlib
import datetime as _dt
import json
import math
import os
import platform
import random
import re
import shutil
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
SCHEMA_VERSION = 1


# ----------------------------------------------------------------------------------------------
# statistics
# ----------------------------------------------------------------------------------------------
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


def summarize(xs: Sequence[float]) -> dict:
    """median / p10 / p90 / mean / min / max / n of a list of times."""
    xs = _check_samples(xs)
    return {
        "n": len(xs),
        "median": median(xs),
        "p10": percentile(xs, 10.0),
        "p90": percentile(xs, 90.0),
        "mean": sum(xs) / len(xs),
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
    """{'speedup', 'ci_lo', 'ci_hi', 'ci_level'}: median(baseline)/median(candidate) with a bootstrap CI."""
    alpha = kw.get("alpha", 0.05)
    point, lo, hi = bootstrap_ratio_ci(baseline, candidate, **kw)
    return {"speedup": point, "ci_lo": lo, "ci_hi": hi, "ci_level": 1.0 - alpha}


# ----------------------------------------------------------------------------------------------
# alternation schedule
# ----------------------------------------------------------------------------------------------
def parse_args_with_overrides(parser, argv=None):
    """``parser``'s options, and every other argument as a Hydra override (``a.overrides``); an unknown
    ``-option`` is an error (a typo must not become an override). ``a.arms``: ``--backends`` split at commas."""
    a, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        parser.error(f"unknown option(s) {bad}; Hydra overrides look like key=value")
    a.overrides = overrides
    if isinstance(getattr(a, "backends", None), str):
        a.arms = [b.strip() for b in a.backends.split(",") if b.strip()]
    return a


def detach_from_run_state(cfg) -> None:
    """No W&B run, no checkpoint loaded, none saved: a measurement must neither read nor touch a real run's state."""
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.logger.wandb.mode = "disabled"
        cfg.checkpoint.load = "none"
        cfg.checkpoint.interval = 0
        cfg.checkpoint.save_on_exit = False


@contextlib.contextmanager
def scratch_run_dir(cfg, prefix: str):
    """A temporary ``cfg.run_dir`` (setup() writes config.yaml there) for the ``with`` block, removed afterwards;
    a run_dir the user set is kept as it is."""
    from omegaconf import open_dict

    own = cfg.run_dir is None
    if own:
        with open_dict(cfg):
            cfg.run_dir = tempfile.mkdtemp(prefix=prefix)
    try:
        yield cfg.run_dir
    finally:
        if own:
            shutil.rmtree(cfg.run_dir, ignore_errors=True)


def unwrap_model(model):
    """The MambaModel inside megatron DDP (and Float16Module on bf16)."""
    m = model
    while hasattr(m, "module"):
        m = m.module
    return m


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


# ----------------------------------------------------------------------------------------------
# environment / output
# ----------------------------------------------------------------------------------------------
def _pkg_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def gpu_slug(name: str | None) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100', None -> 'cpu'."""
    if not name:
        return "cpu"
    n = name.lower().replace("nvidia", "").strip()
    m = re.search(r"\b([a-z]+\d+[a-z]*)\b", n)
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", n).strip("-") or "gpu"


def env_info() -> dict:
    import torch

    info = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _pkg_version("triton"),
        "helion": _pkg_version("helion"),
        "mamba_ssm": _pkg_version("mamba-ssm") or _pkg_version("mamba_ssm"),
        "causal_conv1d": _pkg_version("causal-conv1d") or _pkg_version("causal_conv1d"),
        "megatron_core": _pkg_version("megatron-core") or _pkg_version("megatron_core"),
        "git_commit": _git_commit(),
        "gpu": None,
        "gpu_count": 0,
        "sm_count": None,
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_count=torch.cuda.device_count(), sm_count=p.multi_processor_count,
                    gpu_mem_gib=round(p.total_memory / 2**30, 1), capability=f"sm_{p.major}{p.minor}")
    return info


def _git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def default_out_dir() -> Path:
    """$OUT if set, else runs/bench/<gpu> (h200 on an H200)."""
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return REPO_ROOT / "runs" / "bench" / gpu_slug(name)


def write_results(out_dir: Path | str, stem: str, data: dict, markdown: str) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"schema_version": SCHEMA_VERSION, **data}
    jp = out_dir / f"{stem}.json"
    mp = out_dir / f"{stem}.md"
    jp.write_text(json.dumps(data, indent=2, sort_keys=False, default=_json_default) + "\n")
    mp.write_text(markdown.rstrip() + "\n")
    return jp, mp


def bench_main(argv, parse_args: Callable, run: Callable, stem: Callable, markdown: Callable[[dict], str],
               exit_code: Callable[[dict], int] = lambda res: 0) -> int:
    """The benchmark scripts' ``main``: parse ``argv``, ``res = run(args)`` (a bad config, data path or
    kernel backend is one line on stderr and exit code 2; ``None``, e.g. on a rank other than 0, writes
    nothing), then write ``<stem(res, args)>.json`` / ``.md`` under ``--out`` (default
    ``default_out_dir()``), print the markdown and return ``exit_code(res)``."""
    import sys
    import warnings

    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    from kernels.registry import BackendUnavailableError, UnknownBackendError
    from nano_hybrid.config import ConfigError
    from nano_hybrid.data import DataConfigError

    a = parse_args(argv)
    try:
        res = run(a)
    except (ConfigError, DataConfigError, UnknownBackendError, BackendUnavailableError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if res is None:
        return 0
    out = Path(a.out) if a.out else default_out_dir()
    md = markdown(res)
    jp, mp = write_results(out, stem(res, a), res, md)
    print(md)
    print(f"\nwrote {jp} and {mp}")
    return exit_code(res)


def arms_stem(prefix: str, res: dict, tag: str | None, *parts: str) -> str:
    """``<prefix>_<model>_<arm>_vs_<arm>[_<parts>][_<N>gpu][_<tag>]``: the benchmark output file stem."""
    s = "_".join([prefix, str(res["config"]["model"]), "_vs_".join(res["arms"]).replace("#", ""), *parts])
    if res["world_size"] > 1:
        s += f"_{res['world_size']}gpu"
    return s + (f"_{tag}" if tag else "")


def _json_default(o):
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON-serializable: {type(o).__name__}")


def md_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    def fmt(x):
        if isinstance(x, float):
            return f"{x:.3f}" if abs(x) < 100 else f"{x:.1f}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def env_markdown(env: dict) -> str:
    keys = ["gpu", "sm_count", "torch", "cuda", "triton", "helion", "mamba_ssm", "causal_conv1d",
            "megatron_core", "git_commit", "date_utc"]
    return ", ".join(f"{k} {env.get(k)}" for k in keys if env.get(k) is not None)


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------
# profiler trace -> per-kernel table
# ----------------------------------------------------------------------------------------------
DEVICE_EVENT_CATS = ("kernel", "gpu_memset", "gpu_memcpy")

# The kernels the mamba_ssm path launches for one Mamba-2 mixer fwd+bwd (split-conv1d-scan + gated
# RMSNorm), with calls per iteration: /work/shared/baselines/h200-mamba-ssm-nano30b.md.
MAMBA_SSM_EXPECTED_KERNELS = {
    "_layer_norm_bwd_kernel": 1,
    "_chunk_scan_chunk_state_bwd_dx_kernel": 1,
    "_chunk_scan_fwd_kernel": 1,
    "_chunk_state_fwd_kernel": 2,
    "causal_conv1d_channellast_bwd_kernel": 1,
    "causal_conv1d_channellast_fwd_kernel": 2,
    "_chunk_scan_bwd_ddAcs_stable_kernel": 1,
    "_state_passing_fwd_kernel": 2,
    "_chunk_scan_bwd_dz_kernel": 1,
    "_state_passing_bwd_kernel": 1,
    "_chunk_state_bwd_db_kernel": 1,
    "_chunk_scan_bwd_dc_kernel": 1,
    "_chunk_scan_bwd_dstates_kernel": 1,
    "_chunk_scan_bwd_dcb_kernel": 1,
    "_bmm_chunk_bwd_kernel": 2,
    "_layer_norm_fwd_1pass_kernel": 1,
    "_bmm_chunk_fwd_kernel": 2,
    "_chunk_cumsum_fwd_kernel": 2,
    "_chunk_cumsum_bwd_kernel": 1,
}

# Gated RMSNorm of the Mamba-2 mixer: mamba_ssm's layernorm_gated kernels, our Helion kernels
# (Helion names its Triton kernels "_helion_<function>"). torch/megatron's plain RMSNorm is NOT matched.
_NORM_PAT = re.compile(r"(^_layer_norm_fwd_1pass_kernel$|^_layer_norm_bwd_kernel$|rmsnorm_gated)")
# The split-conv1d-scan op: mamba_ssm's SSD Triton kernels, causal-conv1d CUDA kernels, and the Helion ports.
_SSD_PAT = re.compile(r"(_chunk_(scan|state|cumsum)|_state_passing|_bmm_chunk|causal_conv1d|^_helion_.*ssd)")


def short_kernel_name(name: str) -> str:
    """'void causal_conv1d_channellast_fwd_kernel<Ktraits<...>>(Params)' -> 'causal_conv1d_channellast_fwd_kernel'."""
    n = name.strip()
    if n.startswith("void "):
        n = n[5:]
    n = n.replace("(anonymous namespace)::", "")
    n = n.split("(", 1)[0]
    n = n.split("<", 1)[0]
    return n.strip() or name


def classify_kernel(name: str) -> str:
    """'norm' (gated RMSNorm), 'ssd' (split-conv1d-scan: SSD chunk kernels + causal conv1d), or 'other'."""
    if _NORM_PAT.search(name):
        return "norm"
    if _SSD_PAT.search(name):
        return "ssd"
    return "other"


def load_trace_events(trace_path: Path | str) -> list[dict]:
    with open(trace_path) as f:
        tr = json.load(f)
    events = tr["traceEvents"] if isinstance(tr, dict) else tr
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_EVENT_CATS]


def kernel_table(device_events: Sequence[dict], iters: int) -> dict:
    """Aggregate device events (chrome-trace dicts with name/dur in us) per short kernel name.

    Returns {'total_us_per_iter', 'rows': [{kernel, us_per_iter, share, calls_per_iter, category}],
    'by_category': {cat: us_per_iter}} sorted by time, descending.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    tot: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in device_events:
        k = short_kernel_name(e["name"])
        tot[k] += float(e.get("dur", 0.0))
        calls[k] += 1
    total = sum(tot.values())
    rows = []
    for k in sorted(tot, key=lambda k: -tot[k]):
        rows.append({
            "kernel": k,
            "us_per_iter": tot[k] / iters,
            "share": tot[k] / total if total > 0 else 0.0,
            "calls_per_iter": calls[k] / iters,
            "category": classify_kernel(k),
        })
    by_cat: dict[str, float] = defaultdict(float)
    for r in rows:
        by_cat[r["category"]] += r["us_per_iter"]
    out = {"total_us_per_iter": total / iters, "rows": rows, "by_category": dict(by_cat)}
    out.update(device_busy(device_events, iters))
    return out


def device_busy(device_events: Sequence[dict], iters: int) -> dict:
    """Span (first kernel start to last kernel end) and busy time (union of kernel intervals, any
    stream) per iteration, in us; span - busy is time the device sat idle between kernels (launch
    gaps, host-bound stretches, synchronisations). Empty dict when events carry no timestamps."""
    iv = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in device_events if "ts" in e)
    if not iv:
        return {}
    busy, cur_s, cur_e = 0.0, iv[0][0], iv[0][1]
    for s, e in iv[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, e in iv) - iv[0][0]
    return {"span_us_per_iter": span / iters, "busy_us_per_iter": busy / iters,
            "idle_us_per_iter": (span - busy) / iters}


def device_gaps(device_events: Sequence[dict], top: int = 8, min_us: float = 20.0) -> list[dict]:
    """The ``top`` longest stretches (>= min_us) in which no device event ran on any stream, each with the
    (short) names of the kernels that ended before and started after it, longest first."""
    ev = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), short_kernel_name(e["name"]))
                for e in device_events if "ts" in e)
    gaps = []
    end, last = (ev[0][1], ev[0][2]) if ev else (0.0, "")
    for s, e, name in ev[1:]:
        if s - end >= min_us:
            gaps.append({"us": s - end, "after": last, "before": name})
        if e > end:
            end, last = e, name
    return sorted(gaps, key=lambda g: -g["us"])[:top]


def _stalling_runtime_call(name: str) -> bool:
    return ("Synchronize" in name or name.startswith(("cudaMalloc", "cudaFree", "cudaHostAlloc"))
            or name == "cudaMemcpy")


def runtime_sync_calls(trace_events: Sequence[dict], iters: int) -> dict:
    """Host-side CUDA runtime calls that can stall the host or the device (``*Synchronize``, cudaMalloc /
    cudaFree / cudaHostAlloc, the blocking cudaMemcpy) in a chrome trace (all its events, not only the
    device ones): {name: {'calls_per_iter', 'us_per_iter'}}."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    out: dict[str, dict] = {}
    for e in trace_events:
        name = str(e.get("name", ""))
        if e.get("ph") != "X" or e.get("cat") != "cuda_runtime" or not _stalling_runtime_call(name):
            continue
        r = out.setdefault(name, {"calls_per_iter": 0.0, "us_per_iter": 0.0})
        r["calls_per_iter"] += 1 / iters
        r["us_per_iter"] += float(e.get("dur", 0.0)) / iters
    return out


class SmiSampler:
    """Sample the GPU's SM clock, power, temperature and clock-event (throttle) reasons with ``nvidia-smi -lms``
    while the ``with`` block runs; ``summary()`` afterwards. Reads only (METHOD.md: never set clocks).
    Without nvidia-smi, ``summary()`` says so and nothing else changes."""

    FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")
    REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")

    def __init__(self, gpu_index: int | str = 0, interval_ms: int = 100):
        self.gpu, self.interval_ms = str(gpu_index), int(interval_ms)
        self.proc, self.lines, self.error, self.fields = None, [], None, None

    def _query(self, fields, extra=()):
        import subprocess

        return subprocess.run(["nvidia-smi", "-i", self.gpu, f"--query-gpu={','.join(fields)}",
                               "--format=csv,noheader,nounits", *extra], capture_output=True, text=True, timeout=20,
                              check=False)

    def __enter__(self):
        import subprocess
        import tempfile

        try:
            for reason in (*self.REASONS, None):
                fields = (*self.FIELDS, reason) if reason else self.FIELDS
                if self._query(fields).returncode == 0:
                    self.fields = fields
                    break
        except (OSError, subprocess.SubprocessError) as e:
            self.error = f"{type(e).__name__}: {e}"
            return self
        if self.fields is None:
            self.error = "nvidia-smi refused every field set"
            return self
        self._out = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(["nvidia-smi", "-i", self.gpu, f"--query-gpu={','.join(self.fields)}",
                                      "--format=csv,noheader,nounits", f"-lms={self.interval_ms}"],
                                     stdout=self._out, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        import subprocess

        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self._out.seek(0)
            self.lines = [ln.strip() for ln in self._out.read().splitlines() if ln.strip()]
            self._out.close()
        return False

    def summary(self) -> dict:
        if self.error or self.fields is None:
            return {"error": self.error or "not run"}
        return smi_summary(self.lines, self.fields)


def smi_summary(lines: Sequence[str], fields: Sequence[str]) -> dict:
    """min / median / max of each numeric field over nvidia-smi csv lines, and each non-numeric value's count."""
    cols: dict[str, list] = {f: [] for f in fields}
    for ln in lines:
        parts = [p.strip() for p in ln.split(",")]
        if len(parts) != len(fields):
            continue
        for f, v in zip(fields, parts):
            cols[f].append(v)
    out: dict = {"samples": len(cols[fields[0]]) if fields else 0}
    for f, vals in cols.items():
        try:
            x = sorted(float(v) for v in vals)
            out[f] = {"min": x[0], "median": x[len(x) // 2], "max": x[-1]} if x else None
        except ValueError:
            counts: dict[str, int] = defaultdict(int)
            for v in vals:
                counts[v] += 1
            out[f] = dict(counts)
    return out


def check_expected_kernels(table: dict, expected: dict[str, int] = MAMBA_SSM_EXPECTED_KERNELS) -> dict:
    """Compare a kernel table with the expected kernel list (names and calls per iteration)."""
    got = {r["kernel"]: r["calls_per_iter"] for r in table["rows"]}
    missing = sorted(k for k in expected if k not in got)
    wrong_calls = {k: {"expected": v, "got": got[k]} for k, v in expected.items()
                   if k in got and abs(got[k] - v) > 1e-9}
    extra = sorted(k for k in got if k not in expected)
    return {"matches": not missing and not wrong_calls, "missing": missing,
            "wrong_calls": wrong_calls, "extra_kernels": extra}


def cross_stream_overlap(device_events: Sequence[dict], iters: int, categories: Sequence[str] = ("ssd", "norm")) -> dict:
    """Per kernel of the given categories (classify_kernel): device time, and the part of it during
    which a device event on ANOTHER stream was running too (a kernel sharing the GPU runs slower).

    Returns {kernel: {'us_per_iter', 'overlapped_us_per_iter', 'streams'}} for the matching kernels.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    ev = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("args", {}).get("stream", e.get("tid")),
           short_kernel_name(e["name"])) for e in device_events if "ts" in e]
    by_stream: dict = defaultdict(list)
    for s0, s1, st, _ in ev:
        by_stream[st].append((s0, s1))
    for v in by_stream.values():
        v.sort()
    out: dict[str, dict] = {}
    for s0, s1, st, name in ev:
        if classify_kernel(name) not in categories:
            continue
        ov = 0.0
        for ost, spans in by_stream.items():
            if ost == st:
                continue
            # spans on one stream do not overlap each other: start from the last one beginning before s0
            i = max(bisect.bisect_left(spans, (s0, float("-inf"))) - 1, 0)
            for a0, a1 in spans[i:]:
                if a0 >= s1:
                    break
                lo, hi = max(s0, a0), min(s1, a1)
                if hi > lo:
                    ov += hi - lo
        r = out.setdefault(name, {"us_per_iter": 0.0, "overlapped_us_per_iter": 0.0, "streams": set()})
        r["us_per_iter"] += (s1 - s0) / iters
        r["overlapped_us_per_iter"] += min(ov, s1 - s0) / iters
        r["streams"].add(str(st))
    for r in out.values():
        r["streams"] = sorted(r["streams"])
    return out


def profile_device_table(fn: Callable[[], object], iters: int, trace_path: Path | str | None = None,
                         overlap_categories: Sequence[str] | None = None) -> dict:
    """Run fn iters times under torch.profiler (CUDA) and return kernel_table() of the device events.

    The chrome trace is written to trace_path when given (else to a temporary file, then removed).
    """
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        raise RuntimeError("the per-kernel device-time table needs a CUDA GPU")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    def table(events):
        t = kernel_table(events, iters)
        if overlap_categories is not None:
            t["cross_stream_overlap"] = cross_stream_overlap(events, iters, overlap_categories)
            t["streams"] = sorted({str(e.get("args", {}).get("stream", e.get("tid"))) for e in events})
        return t

    if trace_path is None:
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / "trace.json"
            prof.export_chrome_trace(str(p))
            return table(load_trace_events(p))
    trace_path = Path(trace_path)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_path))
    return table(load_trace_events(trace_path))
