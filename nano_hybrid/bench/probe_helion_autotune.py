"""Probe: does Helion 1.5.0's own autotuner work on this GPU host, and under which settings?

Runs a row-RMSNorm Helion kernel through `kernel.autotune(...)` (effort quick, small budget) in a
process with a main guard, once per setting given on the command line, and writes one JSON line per
attempt to $OUT/helion_autotune_probe.jsonl (setting, ok, seconds, best config or the error).

    python scripts/probe_helion_autotune.py subprocess_off subprocess_on
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import helion
import helion.language as hl
import torch


def main(argv: list[str] | None = None) -> None:
    settings = {
        "subprocess_off": {"HELION_AUTOTUNE_BENCHMARK_SUBPROCESS": "0", "HELION_AUTOTUNE_PRECOMPILE": "0"},
        "subprocess_off_precompile_fork": {"HELION_AUTOTUNE_BENCHMARK_SUBPROCESS": "0"},
        "subprocess_on": {"HELION_AUTOTUNE_BENCHMARK_SUBPROCESS": "1"},
    }
    out_dir = os.environ.get("OUT", "runs/bench/h200")
    os.makedirs(out_dir, exist_ok=True)
    x = torch.randn(16384, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    for name in (sys.argv[1:] if argv is None else argv) or ["subprocess_off"]:
        for k, v in settings[name].items():
            os.environ[k] = v

        rms = helion.kernel(_rms, autotune_effort="quick",
                            autotune_budget_seconds=int(os.environ.get("PROBE_BUDGET", "45")))
        t0 = time.time()
        rec = {"setting": name, "env": settings[name]}
        try:
            cfg = rms.autotune((x, w))
            rec.update(ok=True, config=dict(cfg), seconds=time.time() - t0)
        except Exception as e:  # noqa: BLE001 - we record every failure mode
            rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000], tb=traceback.format_exc()[-3000:],
                       seconds=time.time() - t0)
        print(json.dumps({k: v for k, v in rec.items() if k != "tb"}), flush=True)
        with open(os.path.join(out_dir, "helion_autotune_probe.jsonl"), "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    m, n = x.size()
    out = torch.empty_like(x)
    for tm in hl.tile(m):
        row = x[tm, :].to(torch.float32)
        r = torch.rsqrt(torch.mean(row * row, dim=-1, keepdim=True) + 1e-5)
        out[tm, :] = (row * r * w[None, :].to(torch.float32)).to(out.dtype)
    return out
