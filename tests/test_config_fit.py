"""Config selection on model shapes the committed configs were not tuned for: every Helion kernel at every shape of
a grid of Mamba-2 layouts gets a config that fits the kernel bound at that shape (Helion's own normalization, on
CPU: binding needs no GPU; the arguments are uninitialized CPU tensors), and the grid contains shapes whose nearest committed
config does not fit (what raised InvalidConfig at the first step before the fit check)."""

from __future__ import annotations

import multiprocessing
import os
import warnings
from concurrent.futures import ProcessPoolExecutor

import torch

import helion
from kernels import first_use, tuner, tuning

# (name, model dims per tensor-parallel rank, seq_idx)
_NANO = dict(p=64, n=128, c=128, w=4)
GRID = [
    *[(f"nano_tp{tp}_8x2048", dict(b=8, l=2048, h=64 // tp, g=8 // tp, **_NANO), False) for tp in (1, 2, 4, 8)],
    ("nano_1x8192", dict(b=1, l=8192, h=64, g=8, **_NANO), False),
    ("nano_4x4096_seq_idx", dict(b=4, l=4096, h=64, g=8, **_NANO), True),
    ("nano_2x2000_partial_chunk", dict(b=2, l=2000, h=64, g=8, **_NANO), False),
    ("mamba2_2.7b_c128", dict(b=1, l=8192, h=80, p=64, g=1, n=128, c=128, w=4), False),
    ("mamba2_2.7b_c256", dict(b=1, l=8192, h=80, p=64, g=1, n=128, c=256, w=4), True),
    ("mamba2_small_c256", dict(b=4, l=2048, h=24, p=64, g=1, n=128, c=256, w=4), False),
    ("nemotron_h_8b", dict(b=2, l=8192, h=128, p=64, g=8, n=128, c=128, w=4), False),
]

# kernels with a seq_idx argument, and its position: (seq_idx position, seq_end position or None)
_SEQ_ARGS = {"ssd_chunk_state": (4, None), "ssd_chunk_state_passing": (5, 6)}


def _empty_factories():
    """torch.randn / torch.rand make uninitialized CPU tensors (the builders' shapes, no random data): binding needs
    shapes, dtypes and strides only. (Meta tensors bind too, but Inductor's lowering of some kernels refuses them.)
    Patched in the worker process only, which ends after its checks."""
    for name in ("randn", "rand"):
        def make(*size, generator=None, device=None, dtype=None, **kw):
            return torch.empty(*size, dtype=dtype, **kw)

        setattr(torch, name, make)


def _compiled_mode_kernel(kernel):
    """The kernel as it runs on a GPU (not in interpret mode, which the test processes use for every other test)."""
    interpret = os.environ.pop("HELION_INTERPRET", None)
    try:
        return helion.kernel(kernel.fn, static_shapes=True, ignore_warnings=list(kernel.settings.ignore_warnings))
    finally:
        if interpret is not None:
            os.environ["HELION_INTERPRET"] = interpret


def _with_seq_idx(name, args, md):
    pos, end = _SEQ_ARGS[name]
    a = list(args)
    b, L, c = md["b"], -(-md["l"] // md["c"]) * md["c"], md["c"]
    a[pos] = torch.zeros(b, L, dtype=torch.int32, device="cpu")
    if end is not None:
        a[end] = torch.zeros(b, L // c + 1, dtype=torch.int32, device="cpu")
    return tuple(a)


def _check_kernels(names: list[str]) -> dict:
    """The checks for the kernels ``names`` at every grid shape (run in a spawned worker process): how each config
    was chosen, the committed configs that do not fit, the number of checks and the misfit warnings."""
    registry = tuner.discover_tunable_kernels()
    _empty_factories()
    tuning.clear_caches()
    rt = tuning.Runtime(tuning.HelionSettings(cache_dir="/nonexistent/nano_hybrid_test_cache"))
    compiled: dict[str, object] = {}
    hows, old_misfits, checked = {}, [], 0
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for label, md, seq in GRID:
            for name in names:
                case = registry[name][1](dict(md), "cpu")
                args = _with_seq_idx(name, case.args, md) if seq and name in _SEQ_ARGS else case.args
                if name not in compiled:
                    compiled[name] = _compiled_mode_kernel(case.kernel)
                kernel = compiled[name]
                bound = kernel.bind(tuple(args))
                cfg, how = first_use.select_config(name, kernel, args, case.dims, case.default, arch="sm90", rt=rt,
                                                   bound=bound)
                bound.config_spec.normalized_config(cfg)  # raises InvalidConfig if the choice does not fit
                checked += 1
                hows.setdefault(how, []).append(f"{label}:{name}")
                # what ran before the fit check: the exact or nearest committed config, fitted as compiled() fits it
                _, key, entry = tuning.lookup(name, case.dims, arch="sm90")
                if entry is not None:
                    old = dict(entry["config"])
                    old.pop("host_tensor_descriptors", None)  # a GPU-only key, dropped on this CPU binding
                    old = tuning.fit_block_sizes(bound, tuning.fit_access_lists(bound, tuning.with_flat_pid(
                        helion.Config(**old))))
                    try:
                        bound.config_spec.normalized_config(old)
                    except helion.exc.InvalidConfig:
                        old_misfits.append(f"{label}:{name} (config of {key})")
    return {"hows": hows, "old_misfits": old_misfits, "checked": checked, "warnings": [str(x.message) for x in w]}


def test_every_kernel_gets_a_fitting_config_on_the_shape_grid():
    names = sorted(tuner.discover_tunable_kernels())
    # the kernels in two spawned worker processes (alternate kernels each), side by side
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = list(pool.map(_check_kernels, [names[0::2], names[1::2]]))
    hows: dict[str, list[str]] = {}
    for part in parts:
        for how, where in part["hows"].items():
            hows.setdefault(how, []).extend(where)
    old_misfits = [m for part in parts for m in part["old_misfits"]]
    checked = sum(part["checked"] for part in parts)
    assert checked == len(GRID) * len(names)
    assert old_misfits, "no grid shape needs a fallback: the grid no longer tests the fit check"
    misfit_msgs = [m for part in parts for m in part["warnings"] if "does not fit the kernel at this call's shape" in m]
    assert misfit_msgs and all("tuned at" in m for m in misfit_msgs)
    # one warning per (kernel, shape, source): no duplicates
    assert len(misfit_msgs) == len(set(misfit_msgs))
    assert set(hows) <= {"exact", "nearest", "default", "spec-default"}
