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


SETTINGS = {
    "subprocess_off": {"HELION_AUTOTUNE_BENCHMARK_SUBPROCESS": "0", "HELION_AUTOTUNE_PRECOMPILE": "0"},
    "subprocess_off_precompile_fork": {"HELION_AUTOTUNE_BENCHMARK_SUBPROCESS": "0"},
    "subprocess_on": {"HELION_AUTOTUNE_BENCHMARK_SUBPROCESS": "1"},
}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("settings", nargs="*", metavar="SETTING",
                    help=f"the autotuner settings to try, one attempt each: {', '.join(SETTINGS)} (default "
                         "subprocess_off)")
    ap.add_argument("--budget", type=int, default=int(os.environ.get("PROBE_BUDGET", "45")),
                    help="autotune_budget_seconds of each attempt (default 45, or $PROBE_BUDGET)")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/bench/h200"), help="output folder (default $OUT)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    bad = [n for n in args.settings if n not in SETTINGS]
    if bad:
        ap.error(f"unknown settings {bad}; known: {', '.join(SETTINGS)}")
    if args.budget <= 0:
        ap.error("--budget must be > 0")
    if not torch.cuda.is_available():
        print("error: scripts/probe_helion_autotune.py needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    x = torch.randn(16384, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    for name in args.settings or ["subprocess_off"]:
        for k, v in SETTINGS[name].items():
            os.environ[k] = v

        rms = helion.kernel(_rms, autotune_effort="quick", autotune_budget_seconds=args.budget)
        t0 = time.time()
        rec = {"setting": name, "env": SETTINGS[name]}
        try:
            cfg = rms.autotune((x, w))
            rec.update(ok=True, config=dict(cfg), seconds=time.time() - t0)
        except Exception as e:  # noqa: BLE001 - we record every failure mode
            rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000], tb=traceback.format_exc()[-3000:],
                       seconds=time.time() - t0)
        print(json.dumps({k: v for k, v in rec.items() if k != "tb"}), flush=True)
        with open(os.path.join(args.out, "helion_autotune_probe.jsonl"), "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
    return 0


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    m, n = x.size()
    out = torch.empty_like(x)
    for tm in hl.tile(m):
        row = x[tm, :].to(torch.float32)
        r = torch.rsqrt(torch.mean(row * row, dim=-1, keepdim=True) + 1e-5)
        out[tm, :] = (row * r * w[None, :].to(torch.float32)).to(out.dtype)
    return out
