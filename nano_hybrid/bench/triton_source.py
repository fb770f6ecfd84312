"""The Triton source each tunable Helion kernel compiles to at model shapes, with the config a run selects on an
arch, written on the CPU (binding a kernel and Helion's code generation need no GPU); ``--compare`` names the
(shape, kernel) pairs whose source or config differs from an earlier dump.

    python scripts/triton_source.py --shapes nano,tp8,m2_2p7b_c256 --out runs/triton_source/helion-1.5.0
    PYTHONPATH=site_helion_next python scripts/triton_source.py --shapes nano,tp8,m2_2p7b_c256 \\
        --out runs/triton_source/helion-1.5.1 --compare runs/triton_source/helion-1.5.0

What it is for: where a Helion upgrade or a kernel edit leaves a kernel's generated source and its normalized config
unchanged at a shape, Triton builds the same binary from it, so the GPU time of an A/B goes to the kernels whose
source changed. Shapes are ``tune_kernels.py``'s (presets, the grid's shapes, or a run's
overrides); the config is the one a run on ``--arch`` takes from the committed files (and ``--cache-dir``'s user cache
when given), as ``kernels.first_use.select_config`` chooses it without a search. The arguments are uninitialized CPU
tensors of the run's shapes. A binding without a GPU drops the device-only config keys (``tuning.DEVICE_KEYS``, TMA
descriptors): a pair whose stored config sets one of them is marked ``device_keys`` in the manifest, and its GPU
source may differ from this one. So is a config whose indexing asks for block pointers where this host's Triton has
none (removed in Triton 3.9) or for TMA descriptors without a GPU that has them: Helion generates pointer indexing
here (``indexing_as_pointer``). ``--compare`` lists both kinds as ``unlike_gpu``.

``--registers`` also compiles each source's kernel for ``--arch`` with this host's Triton as a launch would (no GPU:
Triton's argument specialization, the launch's options, its ptxas and flags) and records per pair, from that
compile's ``ptxas -v`` log, the registers per thread, the spill stores / loads and the stack frame in bytes, with the
warps, stages and maxnreg: at 255 registers and 4 warps an SM of 65,536 registers holds two CTAs. A config with a
persistent ``pid_type`` sizes its grid by the GPU's SM count, a compile-time constant of the kernel: its host code
gets ``--num-sms`` (default: 132 for sm90, the H100 SXM's and the H200's; an H100 PCIe has 114), recorded with the
figures; for an arch without a default and no ``--num-sms`` such a pair is recorded as skipped. Another Triton release
than the GPU host's gives that release's figures: put the GPU host's first on ``PYTHONPATH``.

Output under ``--out``: ``<shape>/<kernel>.py`` and ``manifest.json`` (versions, arch, shapes, per pair: the
normalized config, how it was chosen, the source's sha256, for a committed entry its search's time and GPU, with
``--registers`` its ``ptxas`` figures); with ``--compare``, ``compare.json`` (identical / differing / missing pairs)
and ``compare.diff`` (a unified diff per differing pair). Needs ``HELION_INTERPRET`` unset.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import hashlib
import importlib.util
import json
import re
import sys
import warnings
from pathlib import Path
from unittest import mock

import torch
from helion._compat import supports_block_ptr, supports_tensor_descriptor

from kernels import first_use, tuner, tuning
from nano_hybrid.bench.environment import env_info
from nano_hybrid.bench.tune_kernels import kernels_and_shapes
from nano_hybrid.errors import EXIT_BAD_INPUT


@contextlib.contextmanager
def uninitialized_factories():
    """While the cases are built, ``torch.randn`` / ``torch.rand`` return uninitialized tensors of the asked shape and
    dtype (binding needs shapes, dtypes and strides only; a Nano-sized case then costs no random draws)."""
    saved = {name: getattr(torch, name) for name in ("randn", "rand")}

    def empty(*size, generator=None, device=None, dtype=None, **kw):
        return torch.empty(*size, dtype=dtype, device=device, **kw)

    try:
        for name in saved:
            setattr(torch, name, empty)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def stored_entry(name: str, kernel, case, how: str, arch: str, rt, bound) -> dict:
    """The stored entry (its config as stored, and its search's record) that the selection took (``how``: "exact"
    from the committed file, "cache" from the user cache, "nearest" the first nearest tuned shape whose config
    fits); {} for a default."""
    if how == "exact":
        return tuning.lookup(name, case.dims, arch=arch)[2]
    if how not in ("cache", "nearest"):
        return {}
    c = tuning.choice_for(name, kernel, case.args, case.dims, case.default, arch=arch, rt=rt, bound=bound)
    if how == "cache":
        return c.cache_entry()
    for source, key, entry in c.nearest():
        if c.fits(entry["config"], source, key) is not None:
            return entry
    return {}


# SMs per GPU of an arch, for the host code of a persistent kernel (its grid and a constexpr of its loop)
ARCH_NUM_SMS = {"sm90": 132}


def launch_of(source_file: Path, host_name: str, args: tuple, num_sms: int | None = None) -> dict:
    """The Triton kernel a generated module launches and its launch: the module's host function ``host_name`` run on
    ``args`` (uninitialized CPU tensors are enough: it allocates and computes strides) with a launcher that records
    instead of launching. ``num_sms``: what the host code of a persistent kernel gets for the GPU's SM count
    (``helion.runtime.get_num_sm``, which needs the GPU otherwise). Returns the jit function, its positional arguments
    and its launch options (warps, stages, maxnreg, ...)."""
    spec = importlib.util.spec_from_file_location(f"_triton_source_{source_file.stem}", source_file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    got: dict = {}

    def record(fn, grid, *a, **kw):
        got.update(fn=fn, args=a, kw=kw)

    sms = contextlib.nullcontext() if num_sms is None else \
        mock.patch("helion.runtime.get_num_sm", lambda *a, **kw: num_sms)
    with sms:
        getattr(mod, host_name)(*args, _launcher=record)
    return dict(fn=got["fn"], args=got["args"], options=got["kw"])


def ptxas_figures(launch: dict, arch: str, maxnreg: int | None = None) -> dict:
    """Compile ``launch`` (``launch_of``) for ``arch`` ("sm90") as a launch on that GPU would: Triton's own argument
    specialization (16-byte alignment of pointers and integers, integers equal to 1), the launch's options, Triton's
    ptxas and its flags; read the ptxas -v log of that compile: registers per thread, stack frame and spill bytes.
    ``maxnreg``: the config's register cap, which Helion passes only where it sees a CUDA device (so not here). The
    compile's files go to a temporary Triton cache, not the user's."""
    import io
    import tempfile

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn, kw = launch["fn"], dict(launch["options"])
    if maxnreg is not None:
        kw.setdefault("maxnreg", maxnreg)
    target = GPUTarget("cuda", int(arch.removeprefix("sm")), 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch["args"], **kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, specialization, options)
    log = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope(), knobs.cache.scope(), tempfile.TemporaryDirectory() as tmp, \
            contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True  # Triton prints its ptxas -v log
        knobs.compilation.always_compile = True  # a cached binary would print none
        knobs.cache.dir = tmp
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    name = compiled.metadata.name
    text = log.getvalue()
    start = text.find(f"Compiling entry function '{name}'")
    regs = re.search(r"Used (\d+) registers", text[start:]) if start >= 0 else None
    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text[start:]) \
        if start >= 0 else None
    if regs is None or spill is None:
        raise RuntimeError(f"{name}: Triton's ptxas log has no register / spill line for it: {text.strip()[-500:]}")
    return dict(registers=int(regs.group(1)), stack_frame_bytes=int(spill.group(1)),
                spill_store_bytes=int(spill.group(2)), spill_load_bytes=int(spill.group(3)),
                num_warps=options.num_warps, num_stages=options.num_stages, maxnreg=options.maxnreg,
                triton=triton.__version__)


def dump(names: list[str], shape_dims: dict[str, dict], out: Path, arch: str, cache_dir: str | None,
         registers: bool = False, num_sms: int | None = None) -> dict:
    """Write each (shape, kernel)'s Triton source under ``out``; returns the manifest."""
    registry = tuner.discover_tunable_kernels()
    rt = tuning.Runtime(tuning.HelionSettings(cache_dir=cache_dir or str(out / "no-user-cache")))
    # indexing kinds a config may ask for that this host's Triton lowers as pointers (Triton >= 3.9 has no block
    # pointers; TMA descriptors need a GPU that has them)
    host_indexing = {"block_ptr": supports_block_ptr(), "tensor_descriptor": supports_tensor_descriptor()}
    pairs = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for shape, md in shape_dims.items():
            (out / shape).mkdir(parents=True, exist_ok=True)
            for name in names:
                with uninitialized_factories():
                    case = registry[name][1](dict(md), "cpu")
                kernel = tuning.with_index_dtype_for(case.kernel, case.args)  # 64-bit indices past 2^31, as a run
                bound = kernel.bind(tuple(case.args))
                cfg, how = first_use.select_config(name, kernel, case.args, case.dims, case.default, arch=arch, rt=rt,
                                                   bound=bound)
                cfg = bound.config_spec.normalized_config(cfg)
                source = bound.to_triton_code(cfg)
                (out / shape / f"{name}.py").write_text(source)
                entry = stored_entry(name, kernel, case, how, arch, rt, bound)
                stored = entry.get("config", {})
                indexing = json.dumps(cfg.config.get("indexing"))
                pairs[f"{shape}/{name}"] = pair = {
                    "kernel_dims": dict(case.dims), "how": how, "config": tuning.config_to_dict(cfg),
                    "device_keys": sorted(k for k in tuning.DEVICE_KEYS if stored.get(k)),
                    "indexing_as_pointer": [kind for kind, here in host_indexing.items()
                                            if not here and kind in indexing],
                    "sha256": sha256(source),
                }
                if how == "exact":  # the committed entry's own search: its time and GPU
                    pair["search"] = {k: entry.get(k) for k in ("time_ms", "gpu", "date")}
                persistent = str(cfg.config.get("pid_type", "flat")).startswith("persistent")
                if registers and persistent and num_sms is None:
                    pair["ptxas"] = {"skipped": f"persistent pid_type: its host code needs the GPU's SM count "
                                                f"(--num-sms; no default for {arch})"}
                elif registers:
                    with uninitialized_factories():
                        launch = launch_of(out / shape / f"{name}.py", kernel.fn.__name__, tuple(case.args),
                                           num_sms if persistent else None)
                    pair["ptxas"] = ptxas_figures(launch, arch, stored.get("maxnreg"))
                    if persistent:
                        pair["ptxas"]["num_sms"] = num_sms
    env = env_info()
    return {"what": "Triton source of each tunable Helion kernel at each shape, with the config a run on the arch "
                    "selects from the stored files (nano_hybrid/bench/triton_source.py)",
            "arch": arch, "helion": env["helion"], "torch": env["torch"], "triton": env["triton"],
            "host_indexing": host_indexing,
            "git_commit": env["git_commit"], "shapes": shape_dims, "kernels": names, "pairs": pairs,
            "notices": sorted({str(w.message) for w in caught})}


def compare(new: dict, old: dict, new_dir: Path, old_dir: Path) -> tuple[dict, str]:
    """(summary, unified diff) of two manifests and their sources."""
    same, differ, diffs = [], [], []
    for pair, entry in new["pairs"].items():
        prev = old["pairs"].get(pair)
        if prev is None:
            continue
        if entry["sha256"] == prev["sha256"] and entry["config"] == prev["config"]:
            same.append(pair)
            continue
        differ.append(pair)
        a = (old_dir / f"{pair}.py").read_text().splitlines(keepends=True)
        b = (new_dir / f"{pair}.py").read_text().splitlines(keepends=True)
        diffs.append("".join(difflib.unified_diff(a, b, f"{old_dir.name}/{pair}.py", f"{new_dir.name}/{pair}.py")))
        if entry["config"] != prev["config"]:
            diffs.append(f"# {pair}: config {json.dumps(prev['config'], sort_keys=True)} -> "
                         f"{json.dumps(entry['config'], sort_keys=True)}\n")
    summary = {"old": {k: old.get(k) for k in ("helion", "triton", "git_commit")},
               "new": {k: new.get(k) for k in ("helion", "triton", "git_commit")},
               "identical": sorted(same), "differing": sorted(differ),
               "only_new": sorted(set(new["pairs"]) - set(old["pairs"])),
               "only_old": sorted(set(old["pairs"]) - set(new["pairs"])),
               # pairs whose source on a GPU host may differ from this host's (device-only keys, indexing kinds
               # this host lowers as pointers)
               "unlike_gpu": sorted(p for p, e in new["pairs"].items()
                                    if e.get("device_keys") or e.get("indexing_as_pointer"))}
    return summary, "".join(diffs)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="a run's overrides (as for nano_hybrid.train): its mixer shape")
    ap.add_argument("--shapes", default=None, help="presets or grid shapes, as tune_kernels.py's --shapes (default nano)")
    ap.add_argument("--kernels", default=None, help="comma list of tunable kernels (default: all)")
    ap.add_argument("--arch", default="sm90", help="whose stored configs run (default sm90)")
    ap.add_argument("--cache-dir", default=None, help="also read this user cache (kernels.helion.cache_dir)")
    ap.add_argument("--out", required=True, help="output folder (made if missing)")
    ap.add_argument("--compare", default=None, help="an earlier dump's folder to compare with")
    ap.add_argument("--registers", action="store_true",
                    help="also compile each kernel for --arch (ptxas -v): registers, spills, warps, stages")
    ap.add_argument("--num-sms", type=int, default=None,
                    help="with --registers: the SM count a persistent kernel is compiled for (default: "
                         + ", ".join(f"{v} for {k}" for k, v in ARCH_NUM_SMS.items()) + ")")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    names, shape_dims = kernels_and_shapes(ap, args.kernels, args.overrides, args.shapes)
    old_dir = Path(args.compare) if args.compare else None
    if old_dir is not None and not (old_dir / "manifest.json").is_file():
        ap.error(f"--compare {old_dir}: no manifest.json there (a folder this script wrote)")
    if tuning.interpret_mode():
        print("error: triton_source.py needs HELION_INTERPRET unset (it generates the compiled kernels' source)",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.registers and not re.fullmatch(r"sm\d+", args.arch):
        ap.error(f"--registers needs an NVIDIA --arch such as sm90, got {args.arch!r}")
    if args.num_sms is not None and (not args.registers or args.num_sms < 1):
        ap.error(f"--num-sms needs --registers and a count of at least 1, got {args.num_sms}")
    num_sms = args.num_sms if args.num_sms is not None else ARCH_NUM_SMS.get(args.arch)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = dump(names, shape_dims, out, args.arch, args.cache_dir, registers=args.registers, num_sms=num_sms)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(manifest['pairs'])} (shape, kernel) pairs, helion {manifest['helion']}, arch {args.arch}: {out}")
    if args.registers:
        print(f"ptxas -v, Triton {manifest['triton']}: registers per thread / spill stores, bytes / warps / stages")
        for pair, e in manifest["pairs"].items():
            f = e["ptxas"]
            if "skipped" in f:
                print(f"  {pair:<48} skipped: {f['skipped']}")
                continue
            print(f"  {pair:<48} {f['registers']:>4} {f['spill_store_bytes']:>6} {f['num_warps']:>3} {f['num_stages']:>2}"
                  + (f"  (persistent, maxnreg {f['maxnreg']}, {f['num_sms']} SMs)" if "num_sms" in f else "")
                  + ("  (pointer indexing here)" if e["indexing_as_pointer"] else ""))
    if old_dir is not None:
        old = json.loads((old_dir / "manifest.json").read_text())
        summary, diff = compare(manifest, old, out, old_dir)
        (out / "compare.json").write_text(json.dumps(summary, indent=1) + "\n")
        (out / "compare.diff").write_text(diff)
        by_kernel: dict[str, int] = {}
        for pair in summary["differing"]:
            by_kernel[pair.split("/")[1]] = by_kernel.get(pair.split("/")[1], 0) + 1
        print(f"against {old_dir} (helion {old.get('helion')}): {len(summary['identical'])} identical, "
              f"{len(summary['differing'])} differing" + ("".join(
                  f"{', ' if i else ': '}{k} at {v} shape(s)" for i, (k, v) in enumerate(sorted(by_kernel.items())))
                  if by_kernel else "") + f"; {out / 'compare.diff'}")
        if summary["unlike_gpu"]:
            print(f"{len(summary['unlike_gpu'])} pair(s) may generate other source on a GPU host (device-only config "
                  f"keys, or block pointers / TMA descriptors this host lacks): see compare.json 'unlike_gpu'")
    return 0
