"""Config selection on model shapes the committed configs were not tuned for: every Helion kernel at every shape of
a grid of Mamba-2 layouts gets a config that fits the kernel bound at that shape (Helion's own normalization, on
CPU: binding needs no GPU; the arguments are uninitialized CPU tensors). The grid contains shapes whose nearest
committed config Helion refuses as stored (lists of another specialisation: e.g. 80 heads per group take no static
range where 8 do), and fitted, every kernel at every grid shape runs a tuned config."""

from __future__ import annotations

import multiprocessing
import os
import warnings
from concurrent.futures import ProcessPoolExecutor

import pytest
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

# kernels with a seq_idx argument, and its position: (seq_idx position, seq_end position or None); the conv1d kernels'
# dims name it (seq=1): their configs tuned without seq_idx are the nearest shapes (kernels.tuning.SOFT_FLAGS)
_SEQ_ARGS = {"ssd_chunk_state": (4, None), "ssd_chunk_state_passing": (5, 6), "conv1d_fwd": (3, None),
             "conv1d_bwd": (4, None)}


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
    was chosen, the committed configs that do not fit as stored, the number of checks and the misfit warnings."""
    registry = tuner.discover_tunable_kernels()
    _empty_factories()
    tuning.clear_caches()
    rt = tuning.Runtime(tuning.HelionSettings(cache_dir="/nonexistent/nano_hybrid_test_cache"))
    compiled: dict[str, object] = {}
    hows, unfitted, stale, checked = {}, [], [], 0
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for label, md, seq in GRID:
            for name in names:
                case = registry[name][1](dict(md), "cpu")
                args = _with_seq_idx(name, case.args, md) if seq and name in _SEQ_ARGS else case.args
                dims = {**case.dims, "seq": 1} if seq and "seq" in case.dims else case.dims
                if name not in compiled:
                    compiled[name] = _compiled_mode_kernel(case.kernel)
                kernel = compiled[name]
                bound = kernel.bind(tuple(args))
                cfg, how = first_use.select_config(name, kernel, args, dims, case.default, arch="sm90", rt=rt,
                                                   bound=bound)
                bound.config_spec.normalized_config(cfg)  # raises InvalidConfig if the choice does not fit
                checked += 1
                hows.setdefault(how, []).append(f"{label}:{name}")
                # the exact or nearest committed config as stored, without the fitting of its lists and block sizes
                exact, key, entry = tuning.lookup(name, dims, arch="sm90")
                if entry is not None:
                    stored = tuning.with_flat_pid(helion.Config(**{
                        k: v for k, v in entry["config"].items() if k != "host_tensor_descriptors"}))  # a GPU-only key
                    try:
                        bound.config_spec.normalized_config(stored)
                    except helion.exc.InvalidConfig:
                        unfitted.append(f"{label}:{name} (config of {key})")
                    # a config tuned at this very shape (and arguments) has the lists of this specialisation as stored
                    if exact == "exact" and not seq and tuning.fit_lists(bound, stored) is not stored:
                        stale.append(f"{label}:{name}")
    return {"hows": hows, "unfitted": unfitted, "stale": stale, "checked": checked,
            "warnings": [str(x.message) for x in w]}


def test_every_kernel_gets_a_fitting_config_on_the_shape_grid():
    names = sorted(tuner.discover_tunable_kernels())
    # the kernels in two spawned worker processes (alternate kernels each), side by side
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = list(pool.map(_check_kernels, [names[0::2], names[1::2]]))
    hows: dict[str, list[str]] = {}
    for part in parts:
        for how, where in part["hows"].items():
            hows.setdefault(how, []).extend(where)
    unfitted = [m for part in parts for m in part["unfitted"]]
    checked = sum(part["checked"] for part in parts)
    assert checked == len(GRID) * len(names)
    assert unfitted, "every grid shape's committed config fits as stored: the grid no longer tests the fitting"
    # an entry tuned at a grid shape fits the kernel there as stored: a kernel whose loads, stores or loops changed
    # since leaves entries whose lists the calls must resize (or, for mixed settings, replace by defaults); tune
    # them again (scripts/tune_kernels.py --kernels K --shapes S)
    stale = [m for part in parts for m in part["stale"]]
    assert not stale, f"committed configs with lists of another specialisation: {stale}"
    # fitted, a tuned config fits every kernel at every grid shape: none falls to a default
    assert set(hows) <= {"exact", "nearest"}, {how: where for how, where in hows.items() if "default" in how}
    misfit_msgs = [m for part in parts for m in part["warnings"] if "does not fit the kernel at this call's shape" in m]
    # a tuned config that does not fit is said once per (kernel, shape, source), naming the shape it was tuned at
    assert all("tuned at" in m for m in misfit_msgs) and len(misfit_msgs) == len(set(misfit_msgs))


# Mamba2-2.7B per layer: 80 heads in 1 group (a short sequence: binding depends on the shape only)
_MAMBA2_27B = dict(b=1, l=256, h=80, p=64, g=1, n=128)


def _bound(name, dims):
    from kernels import ssd_helion_bwd as bwd

    args, _ = bwd._example_args(name, dims, "cpu")
    return _compiled_mode_kernel(bwd._KERNELS[name]).bind(tuple(args))


def _committed(name, key="b1_l8192_h64_p64_g8_n128_c128"):
    import json

    entry = json.loads(tuning.config_path(name, "sm90").read_text())["entries"][key]
    return {k: v for k, v in entry["config"].items() if k != "host_tensor_descriptors"}  # a GPU-only key


@pytest.mark.parametrize("c", [128, 256])
@pytest.mark.parametrize("name", ["ssd_bwd_db", "ssd_bwd_dc_dcb"])
def test_nano_config_fits_the_per_loop_lists_of_80_heads_per_group(name, c):
    """The head loop ``hl.grid(h // g)`` of the SSD dB / dC kernels is a static-range candidate at 8 heads per group
    (Helion: a compile-time loop of at most 8 iterations) and not at 80: the Nano config's ``static_ranges`` list has
    one entry too many at the Mamba2-2.7B shape. Fitted, it is accepted with every tuned setting kept."""
    bound = _bound(name, dict(_MAMBA2_27B, c=c))
    cfg = _committed(name)
    assert cfg["static_ranges"] == [False]
    with pytest.raises(helion.exc.InvalidConfig, match="static_ranges"):
        bound.config_spec.normalized_config(cfg)
    tuning.clear_caches()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fitted = tuning.fit_config(bound, cfg)  # raises ConfigMisfit if it does not fit
    assert not [str(x.message) for x in w if "static_ranges" in str(x.message)]
    bound.config_spec.normalized_config(fitted)
    assert fitted.config["static_ranges"] == []
    kept = ("block_sizes", "num_warps", "num_stages", "loop_orders", "l2_groupings", "range_unroll_factors",
            "range_num_stages", "range_multi_buffers", "range_flattens")
    assert {k: fitted.config[k] for k in kept} == {k: cfg[k] for k in kept}
    # lists of mixed settings take this specialisation's defaults, said in one warning
    with pytest.warns(UserWarning, match="range_num_stages, static_ranges list") as w:
        mixed = tuning.fit_lists(bound, helion.Config(**dict(fitted.config, static_ranges=[True, False],
                                                             range_num_stages=[0, 3, 0, 0])))
    assert len(w) == 1 and mixed.config["static_ranges"] == []
    assert mixed.config["range_num_stages"] == bound.config_spec.default_config().config["range_num_stages"]


@pytest.mark.parametrize("name", ["ssd_bwd_db", "ssd_bwd_dc_dcb"])
def test_fitting_configs_come_out_unchanged(name):
    """A config whose lists fit the specialisation is returned as it is (the same object, the same JSON after
    fit_config), so the tuned shapes run what was tuned; at 8 heads per group an empty ``static_ranges`` (a config
    tuned at 80) takes the default entry."""
    nano = _bound(name, dict(b=1, l=256, h=8, p=64, g=1, n=128, c=128))
    for bound in (nano, _bound(name, dict(_MAMBA2_27B, c=128))):
        fitted = tuning.fit_config(bound, _committed(name))
        assert tuning.fit_lists(bound, fitted) is fitted
        assert tuning.fit_config(bound, fitted).to_json() == fitted.to_json()
        default = bound.config_spec.default_config()
        assert tuning.fit_lists(bound, default) is default
    assert fitted.config["static_ranges"] == []  # fitted at 80 heads per group
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        refit = tuning.fit_config(nano, fitted)
    assert refit.config["static_ranges"] == [False]
    nano.config_spec.normalized_config(refit)


def _check_int64_twins(names: list[str]) -> dict:
    """Per kernel (in a spawned worker), with one argument a view whose last element lies past 2^31 in its storage
    (meta tensors: no memory): Helion's code generation of the kernel itself and of the twin with 64-bit indices that
    ``tuning.compiled`` uses, each with its stored config. Returns {name: (32-bit result, twin result)}, and where the
    twin does not lower on meta tensors, its result at a small shape on CPU tensors as a third item."""
    registry = tuner.discover_tunable_kernels()
    _empty_factories()
    tuning.clear_caches()
    md = dict(b=2, l=256, h=8, g=2, p=64, n=128, c=128, w=4)

    def codegen(kernel, name, args, case):
        try:
            bound = kernel.bind(tuple(args))
            cfg, _ = tuning.stored_config(name, kernel, args, case.dims, case.default, arch="sm90", bound=bound)
            bound.to_triton_code(bound.config_spec.normalized_config(cfg))
            return "ok"
        except Exception as e:  # noqa: BLE001 - the result names it
            return type(e).__name__

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            case = registry[name][1](dict(md), "cpu")
            kernel = _compiled_mode_kernel(case.kernel)
            meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in case.args]
            i = next(j for j, a in enumerate(meta) if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[0] >= 2)
            stride = list(meta[i].stride())
            stride[0] = 2**31 // (meta[i].shape[0] - 1) + 1024
            meta[i] = torch.empty_strided(meta[i].shape, stride, dtype=meta[i].dtype, device="meta")
            twin = tuning.with_index_dtype_for(kernel, meta)
            assert twin is not kernel and twin.settings.index_dtype == torch.int64
            res = (codegen(kernel, name, meta, case), codegen(twin, name, meta, case))
            # where meta tensors do not lower, the twin's code at the small shape (CPU tensors) instead
            out[name] = res if res[1] == "ok" else (*res, codegen(twin, name, case.args, case))
    return out


def test_every_kernel_has_a_64_bit_index_twin_for_views_past_int32_offsets():
    """A (b, l, d) view of zxbcdt's (l, b, d) memory at a long sequence (Nano widths: past 208k tokens per micro-batch)
    has fewer elements than 2^31 but offsets past it; Helion picks 64-bit indices by element count only and then
    refuses to generate the kernel. At such a view Helion refuses every kernel and generates its 64-bit twin.
    ``ssd_bwd_dt`` does not lower on meta tensors (an Inductor limitation, as for the grid above): its twin is
    generated at a small shape instead, and its view case runs on the GPU
    (tests/test_mamba_split_helion.py::test_views_past_int32_offsets_match_the_reference)."""
    names = sorted(tuner.discover_tunable_kernels())
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        got = pool.submit(_check_int64_twins, names).result()
    want = {n: ("IndexOffsetOutOfRangeForInt32", "ok") for n in names if n != "ssd_bwd_dt"}
    want["ssd_bwd_dt"] = ("InductorLoweringError", "InductorLoweringError", "ok")
    assert got == want
