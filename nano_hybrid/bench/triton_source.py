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

Output under ``--out``: ``<shape>/<kernel>.py`` and ``manifest.json`` (versions, arch, shapes, per pair: the
normalized config, how it was chosen, the source's sha256); with ``--compare``, ``compare.json`` (identical /
differing / missing pairs) and ``compare.diff`` (a unified diff per differing pair). Needs ``HELION_INTERPRET`` unset.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import hashlib
import json
import sys
import warnings
from pathlib import Path

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


def stored_config(name: str, kernel, case, how: str, arch: str, rt, bound) -> dict:
    """The stored config, as stored, that the selection took (``how``: "exact" from the committed file, "cache"
    from the user cache, "nearest" the first nearest tuned shape whose config fits); {} for a default."""
    if how == "exact":
        return tuning.lookup(name, case.dims, arch=arch)[2]["config"]
    if how not in ("cache", "nearest"):
        return {}
    c = tuning.choice_for(name, kernel, case.args, case.dims, case.default, arch=arch, rt=rt, bound=bound)
    if how == "cache":
        return c.cache_entry()["config"]
    for source, key, entry in c.nearest():
        if c.fits(entry["config"], source, key) is not None:
            return entry["config"]
    return {}


def dump(names: list[str], shape_dims: dict[str, dict], out: Path, arch: str, cache_dir: str | None) -> dict:
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
                stored = stored_config(name, kernel, case, how, arch, rt, bound)
                indexing = json.dumps(cfg.config.get("indexing"))
                pairs[f"{shape}/{name}"] = {
                    "kernel_dims": dict(case.dims), "how": how, "config": tuning.config_to_dict(cfg),
                    "device_keys": sorted(k for k in tuning.DEVICE_KEYS if stored.get(k)),
                    "indexing_as_pointer": [kind for kind, here in host_indexing.items()
                                            if not here and kind in indexing],
                    "sha256": sha256(source),
                }
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = dump(names, shape_dims, out, args.arch, args.cache_dir)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(manifest['pairs'])} (shape, kernel) pairs, helion {manifest['helion']}, arch {args.arch}: {out}")
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
