"""Host seconds of a Helion kernel call's first-call work before its launch, without and with the compile cache.

A kernel's first call with an argument signature binds the kernel, chooses its config and generates and loads its
Triton module (``kernels.first_use.prepare_call``); with ``kernels.helion.compile_cache`` a later process loads the
choice and the module from the per-user cache instead (``kernels.compile_cache``). This script times both for every
tunable kernel at model shapes, each in a fresh interpreter (one child process per shape and mode, so nothing is
reused in-process): ``cold``, with an empty cache directory (binding, choosing, generating; the entry is then stored)
and ``cached``, a second process that loads the entries ``cold`` stored.

    python scripts/bench_compile_cache.py --shapes nano_tp8,nano_b2_l8192 --out runs/bench/compile_cache

Runs on a GPU or on the CPU (``--arch`` names whose stored configs are chosen from; default sm90). Nothing is
launched: Triton's own compile (or its cache's load) at the first launch is not in these figures. Arguments are
uninitialized tensors of the shapes (``--device``, default cuda when there is one). Shapes are
``tune_kernels.py``'s (presets, grid shapes, or a run's overrides). Writes ``compile_cache.json`` under ``--out``: per
shape and mode the seconds per kernel and their sum, the config source per kernel (``how``), versions, arch and
device (rewritten after each shape); prints one line per shape.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("cold", "cached")
REPO = Path(__file__).resolve().parents[2]


def child(shape: str, dims: dict, names: list[str], arch: str, device: str, cache_dir: str) -> dict:
    """One mode at one shape in this process: seconds of ``prepare_call`` + compile per kernel."""
    import torch

    from kernels import first_use, tuner, tuning
    from kernels.settings import HelionSettings
    from nano_hybrid.bench.triton_source import uninitialized_factories

    registry = tuner.discover_tunable_kernels()
    rt = tuning.Runtime(HelionSettings(cache_dir=cache_dir))
    out = {}
    for name in names:
        with uninitialized_factories():
            case = registry[name][1](dict(dims), device)
        kernel = tuning.with_index_dtype_for(case.kernel, case.args)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        p = first_use.prepare_call(name, kernel, case.args, case.dims, case.default, rt=rt, arch=arch)
        p.compile(kernel, case.args)
        took = time.perf_counter() - t0
        from_cache = p.entry is not None
        p.done()  # stores a choice made now (nothing is launched here)
        out[name] = {"s": round(took, 4), "how": p.how, "from_cache": from_cache}
    return {"shape": shape, "kernels": out, "sum_s": round(sum(v["s"] for v in out.values()), 3)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="a run's overrides (as for nano_hybrid.train): its mixer shape")
    ap.add_argument("--shapes", default=None,
                    help="presets or grid shapes, as tune_kernels.py's --shapes (default nano)")
    ap.add_argument("--kernels", default=None, help="comma list of tunable kernels (default: all)")
    ap.add_argument("--arch", default=None, help="whose stored configs are chosen from (default: this GPU's, sm90 on "
                                                  "a host without one)")
    ap.add_argument("--device", default=None, help="where the arguments live (default: cuda when there is one)")
    ap.add_argument("--out", default="runs/bench/compile_cache", help="output folder (made if missing)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # JSON: one mode at one shape
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.child is not None:
        spec = json.loads(args.child)
        print(json.dumps(child(**spec)))
        return 0
    import torch

    from kernels import tuning
    from nano_hybrid.bench.environment import env_info
    from nano_hybrid.bench.tune_kernels import kernels_and_shapes

    if tuning.interpret_mode():
        ap.error("HELION_INTERPRET is set: the compile cache serves compiled kernels only; unset it")
    names, shape_dims = kernels_and_shapes(ap, args.kernels, args.overrides, args.shapes)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not re.fullmatch(r"cuda:\d+", device):
        ap.error(f"--device {device!r}: cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {device}: this host has no CUDA GPU")
    arch = args.arch or (tuning.current_arch() if torch.cuda.is_available() else "sm90")
    if not re.fullmatch(r"sm\d{2,3}", arch):
        ap.error(f"--arch {arch!r}: a GPU arch such as sm90 or sm100 (kernels/configs/<arch>/)")
    results: dict[str, dict] = {}
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        ap.error(f"--out {out} is a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)
    report = {"what": "host seconds of each kernel's first-call work before its launch (bind, config choice, code "
                      "generation and module load; from the compile cache in the cached mode), one fresh process per "
                      "shape and mode (nano_hybrid/bench/bench_compile_cache.py)",
              "arch": arch, "device": device, "env": env_info(), "shapes": shape_dims, "kernels": names,
              "results": results}
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + path if path else "")}  # the children import this tree
    with tempfile.TemporaryDirectory(prefix="compile_cache_bench_") as cache_dir:
        for shape, dims in shape_dims.items():
            results[shape] = {}
            for mode in MODES:
                spec = dict(shape=shape, dims=dims, names=names, arch=arch, device=device,
                            cache_dir=str(Path(cache_dir) / shape))
                cmd = [sys.executable, "-m", "nano_hybrid.bench.bench_compile_cache", "--child", json.dumps(spec)]
                r = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if r.returncode != 0:
                    print(r.stderr[-4000:], file=sys.stderr)
                    raise SystemExit(f"bench_compile_cache: the {mode} child at {shape} failed (rc {r.returncode})")
                results[shape][mode] = json.loads(r.stdout.strip().splitlines()[-1])
            cold, cached = results[shape]["cold"], results[shape]["cached"]
            if not all(v["from_cache"] for v in cached["kernels"].values()):
                raise SystemExit(f"bench_compile_cache: at {shape} the second process did not load every kernel "
                                 "from the cache")
            print(f"{shape:24s} {len(names)} kernels: cold {cold['sum_s']:7.2f} s, cached {cached['sum_s']:6.2f} s "
                  f"({cold['sum_s'] / max(cached['sum_s'], 1e-9):.0f}x)", flush=True)
            report["results"] = results  # written after each shape: a later shape that fails keeps the earlier ones
            (out / "compile_cache.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out / 'compile_cache.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
