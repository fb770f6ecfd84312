"""torch.profiler traces -> per-kernel device-time tables (by kernel and category: Mamba-2 SSD op, gated
norm, other), device busy time and idle gaps, runtime sync calls, cross-stream overlap, nvidia-smi sampling."""

from __future__ import annotations

import bisect
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence


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
