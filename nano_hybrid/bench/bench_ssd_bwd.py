"""Benchmark: the fused split-conv1d-scan op + gated RMSNorm, forward+backward, helion vs mamba_ssm.

Runs ``scripts/bench_kernels.py`` (one process per shape; side by side in that process: ABBA
alternation over rounds, A-vs-A control, medians with bootstrap CIs, torch.profiler per-kernel
table for both backends, correctness of output and all gradients of helion against mamba_ssm) at
the Nano shape, TP=2 (h=32, g=4) and seqlen 4096 x batch 4, without retuning for the latter two.
The fp32-reference correctness check at the Nano shape is the GPU pytest
(tests/test_ssd_helion_bwd.py / tests/test_mamba_split_helion.py, marked gpu).

    python scripts/bench_ssd_bwd.py [--shapes nano,tp2,l4096b4] [--rounds 6]

Writes ``kernels_mamba_ssm_vs_helion_<shape>.json/.md`` per shape and ``ssd_bwd_summary.json`` to $OUT
(baseline 5.44 ms for split fwd+bwd + norm fwd+bwd at nano on H200; target >= 1.6x).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

from nano_hybrid.bench import bench_kernels, environment, reporting
from nano_hybrid.errors import EXIT_BAD_INPUT


def main(argv=None) -> int:
    from kernels.registry import BackendUnavailableError, UnknownBackendError, get_backend

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="nano,tp2,l4096b4")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    try:
        unknown = [s for s in a.shapes.split(",") if s not in bench_kernels.SHAPES]
        if unknown:
            raise ValueError(f"--shapes: unknown {unknown}; known: {', '.join(sorted(bench_kernels.SHAPES))}")
        reporting.check_args(a)
        for name in ("mamba_ssm", "helion"):
            get_backend(name)
    except (ValueError, UnknownBackendError, BackendUnavailableError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    out = Path(a.out) if a.out else reporting.default_out_dir()
    summary = {"env": environment.env_info(), "baseline_ms_nano_h200": 5.44, "target_speedup": 1.6, "shapes": {}}
    rc = 0
    for shape in a.shapes.split(","):
        try:
            args = bench_kernels.parse_args(["--backend", "mamba_ssm", "--compare", "helion", "--shape", shape,
                                             "--rounds", str(a.rounds), "--iters", str(a.iters), "--out", str(out)])
            res = bench_kernels.run(args)
            reporting.write_results(out, bench_kernels.output_stem(args), res, bench_kernels.markdown(res))
            print(bench_kernels.markdown(res))
            summary["shapes"][shape] = {k: res.get(k) for k in ("correctness", "ratios", "times_ms") if k in res}
            if not res["correctness"]["passed"]:
                rc = 1
        except Exception:  # noqa: BLE001 - one shape failing must not hide the others
            summary["shapes"][shape] = {"error": traceback.format_exc()}
            print(traceback.format_exc(), file=sys.stderr)
            rc = 1
    out.mkdir(parents=True, exist_ok=True)
    (out / "ssd_bwd_summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return rc
