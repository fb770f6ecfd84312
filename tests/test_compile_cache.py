"""kernels.compile_cache through kernels.first_use.tuned_call: a later process loads a call's chosen config and
Helion's generated module without binding the kernel, says the choice's notices again, and never loads an entry that
is corrupt or was made from other inputs.

The calls are rmsnorm_fwd's with the kernel in compiled mode, bound on CPU tensors, the arch forced to sm90 (so the
committed sm90 configs are chosen from) and a launcher that records each launch instead of running it (a CPU tensor
cannot be launched). A fresh process is modelled by ``tuning.clear_caches()``: it forgets the loaded files, the
compiled kernels, the launch caches and the warnings said."""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings

import pytest
import torch

import helion
from kernels import compile_cache, first_use, tuning
from kernels import rmsnorm_gated_helion as R
from kernels.settings import HelionSettings

M, G, D = 64, 2, 16  # no committed sm90 entry: the nearest tuned shape's config runs, with its notice
DIMS = R._norm_dims(M, G, D, False, False, torch.bfloat16)


@pytest.fixture()
def launches(monkeypatch, tmp_path):
    monkeypatch.delenv("HELION_INTERPRET", raising=False)
    monkeypatch.delenv("NANO_HELION_DUMP_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(tuning, "current_arch", lambda: "sm90")
    got = []

    def record(triton_kernel, grid, *args, num_warps, num_stages, **kw):
        got.append((triton_kernel.fn.__name__, tuple(grid), num_warps, num_stages,
                    tuple(a if not isinstance(a, torch.Tensor) else tuple(a.shape) for a in args)))

    monkeypatch.setattr(tuning, "with_launcher", lambda fn, args, rt: functools.partial(fn, _launcher=record))
    tuning.clear_caches()
    yield got
    tuning.clear_caches()


def _kernel():
    return helion.kernel(R.rmsnorm_gated_fwd_kernel.fn, static_shapes=True,
                         ignore_warnings=list(R.rmsnorm_gated_fwd_kernel.settings.ignore_warnings))


def _args(m=M):
    x = torch.randn(m, G, D, dtype=torch.bfloat16)
    return (x, torch.ones(G, D, dtype=torch.bfloat16), x, 1e-5, False, False)


def _call(kernel, settings=None, m=M):
    """tuned_call as a fresh process makes it; the messages of its warnings."""
    tuning.clear_caches()
    with warnings.catch_warnings(record=True) as w, tuning.use(settings or HelionSettings()):
        warnings.simplefilter("always")
        first_use.tuned_call("rmsnorm_fwd", kernel, _args(m), R._norm_dims(m, G, D, False, False, torch.bfloat16),
                             R.RMSNORM_FWD_DEFAULT)
    return [str(x.message) for x in w]


def _entries(tmp_path):
    return sorted((tmp_path / "xdg" / "nano_hybrid" / "helion" / "compiled" / compile_cache.package_digest()[:16]
                   / "sm90" / "rmsnorm_fwd").glob("*.json"))


def test_a_later_process_loads_the_choice_and_the_code_without_binding(launches, tmp_path, monkeypatch):
    kernel = _kernel()
    first = _call(kernel)
    entry, = _entries(tmp_path)
    data = json.loads(entry.read_text())
    assert data["how"] == "nearest" and data["fn_name"] == "rmsnorm_gated_fwd_kernel"
    # the stored source is what Helion generates for the chosen config at this binding
    bound = kernel.bind(_args())
    cfg = tuning.fit_config(bound, data["config"])
    assert data["source"] == bound.to_triton_code(bound.config_spec.normalized_config(cfg))
    assert tuning.runtime_for(HelionSettings()).first_calls == {"bound": 1}
    nearest = [m for m in first if "no tuned sm90 config for rmsnorm_fwd" in m]
    assert len(nearest) == 1 and "using the nearest tuned shape" in nearest[0]

    launched_first = list(launches)
    launches.clear()
    with monkeypatch.context() as mp:
        mp.setattr(kernel, "bind", lambda *a, **k: pytest.fail("the kernel was bound"))
        again = _call(kernel)
        assert tuning.runtime_for(HelionSettings()).first_calls == {"loaded": 1}
        assert launches == launched_first  # same Triton kernel, grid, warps, stages and arguments
        assert [m for m in again if "nano_hybrid kernels" in m] == [m for m in first if "nano_hybrid kernels" in m]
        assert _entries(tmp_path) == [entry]
        # the loaded callable is the runtime's compiled kernel for that config, as a compilation in-process makes it
        rt = tuning.runtime_for(HelionSettings())
        fn, = rt.compiled.values()
        assert tuning.compiled(kernel, _args(), data["config"], rt=rt) is fn


def test_other_inputs_make_another_key(launches, tmp_path, monkeypatch):
    kernel = _kernel()
    _call(kernel)
    assert len(_entries(tmp_path)) == 1
    _call(kernel, m=2 * M)  # another shape
    assert len(_entries(tmp_path)) == 2
    # a user-cache entry for the shape: the choice is made again (binding) and is now the cache's config
    tuning.record("rmsnorm_fwd", DIMS, {"block_sizes": [8], "num_warps": 1}, 0.01, arch="sm90",
                  root=tuning.user_cache_root())
    _call(kernel)
    entries = _entries(tmp_path)
    assert len(entries) == 3
    hows = sorted(json.loads(p.read_text())["how"] for p in entries)
    assert hows == ["cache", "nearest", "nearest"]

    rt = tuning.runtime_for(HelionSettings())
    args = _args()
    key = compile_cache.entry_key("rmsnorm_fwd", kernel, args, DIMS, R.RMSNORM_FWD_DEFAULT, rt, "sm90")
    assert key == compile_cache.entry_key("rmsnorm_fwd", kernel, _args(), DIMS, R.RMSNORM_FWD_DEFAULT, rt, "sm90")
    strided = (args[0].transpose(0, 1).contiguous().transpose(0, 1),) + args[1:]
    others = [
        compile_cache.entry_key("rmsnorm_fwd", kernel, strided, DIMS, R.RMSNORM_FWD_DEFAULT, rt, "sm90"),
        compile_cache.entry_key("rmsnorm_fwd", kernel, args[:3] + (1e-6,) + args[4:], DIMS, R.RMSNORM_FWD_DEFAULT,
                                rt, "sm90"),
        compile_cache.entry_key("rmsnorm_fwd", kernel, args, DIMS, R.RMSNORM_BWD_DEFAULT, rt, "sm90"),
        compile_cache.entry_key("rmsnorm_fwd", kernel, args, DIMS, R.RMSNORM_FWD_DEFAULT, rt, "sm100"),
        compile_cache.entry_key("rmsnorm_fwd", kernel, args, DIMS, R.RMSNORM_FWD_DEFAULT,
                                tuning.runtime_for(HelionSettings(autotune=True)), "sm90"),
        # the kernel's 64-bit index twin (what tuning.with_index_dtype_for runs past 2^31 elements)
        compile_cache.entry_key("rmsnorm_fwd", type(kernel)(kernel.fn, configs=kernel.configs,
                                                           settings=dataclasses.replace(kernel.settings,
                                                                                        index_dtype=torch.int64)),
                                args, DIMS, R.RMSNORM_FWD_DEFAULT, rt, "sm90"),
    ]
    monkeypatch.setenv("HELION_FORCE_AUTOTUNE", "0")
    others.append(compile_cache.entry_key("rmsnorm_fwd", kernel, args, DIMS, R.RMSNORM_FWD_DEFAULT, rt, "sm90"))
    monkeypatch.delenv("HELION_FORCE_AUTOTUNE")
    monkeypatch.setattr(compile_cache, "package_digest", lambda: "another kernels package")
    others.append(compile_cache.entry_key("rmsnorm_fwd", kernel, args, DIMS, R.RMSNORM_FWD_DEFAULT, rt, "sm90"))
    assert len({key, *others}) == len(others) + 1


def test_with_autotune_only_exact_choices_are_stored(launches, tmp_path, monkeypatch):
    # no search here: the first-use search would run in a child process; its outcome is not what is tested
    monkeypatch.setattr(first_use, "tune_first_use", lambda *a, **k: None)
    kernel = _kernel()
    _call(kernel, HelionSettings(autotune=True))
    assert _entries(tmp_path) == []  # the nearest config: a later run must search again
    tuning.record("rmsnorm_fwd", DIMS, {"block_sizes": [8], "num_warps": 1}, 0.01, arch="sm90",
                  root=tuning.user_cache_root())
    _call(kernel, HelionSettings(autotune=True))
    entry, = _entries(tmp_path)
    assert json.loads(entry.read_text())["how"] == "cache"


@pytest.mark.parametrize("damage", ["truncated", "source", "config"])
def test_a_damaged_entry_is_not_loaded_and_is_rewritten(launches, tmp_path, damage):
    kernel = _kernel()
    _call(kernel)
    entry, = _entries(tmp_path)
    good = entry.read_text()
    if damage == "truncated":
        entry.write_text(good[: len(good) // 2])
    elif damage == "source":
        data = json.loads(good)
        data["source"] = data["source"].replace("num_warps=", "num_warps=2 * ", 1)
        entry.write_text(json.dumps(data))
    else:
        data = json.loads(good)
        data["config"]["num_warps"] = 2 * data["config"]["num_warps"]
        entry.write_text(json.dumps(data))
    launches.clear()
    msgs = _call(kernel)
    said = [m for m in msgs if "compile cache entry" in m]
    assert len(said) == 1 and str(entry) in said[0] and "not used" in said[0] and "\n" not in said[0]
    assert ("not an entry" in said[0]) if damage == "truncated" else ("does not match its sha256" in said[0])
    assert len(launches) == 1
    assert entry.read_text() == good


def test_off_and_under_the_dump_dir_nothing_is_stored(launches, tmp_path, monkeypatch):
    kernel = _kernel()
    _call(kernel, HelionSettings(compile_cache=False))
    assert _entries(tmp_path) == []
    monkeypatch.setenv("NANO_HELION_DUMP_DIR", str(tmp_path / "dump"))
    _call(kernel)
    assert _entries(tmp_path) == [] and list((tmp_path / "dump").glob("rmsnorm_gated_fwd_kernel_*.py"))


def test_a_cache_that_cannot_be_written_is_one_warning_and_the_call_runs(launches, tmp_path):
    """A compile cache folder that cannot be made (here a regular file in its place; a read-only or full disk alike):
    the call runs, one warning names the entry and the ways out, and a second call at another shape says nothing
    more."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "compiled").write_text("")
    kernel = _kernel()
    settings = HelionSettings(cache_dir=str(cache))
    msgs = _call(kernel, settings)
    said = [m for m in msgs if "compile cache" in m]
    assert len(said) == 1 and "cannot write the compile cache entry" in said[0]
    assert str(cache / "compiled" / compile_cache.package_digest()[:16] / "sm90" / "rmsnorm_fwd") in said[0]
    assert "kernels.helion.compile_cache=false" in said[0] and "\n" not in said[0]
    assert len(launches) == 1
    with warnings.catch_warnings(record=True) as w, tuning.use(settings):
        warnings.simplefilter("always")
        first_use.tuned_call("rmsnorm_fwd", kernel, _args(2 * M),
                             R._norm_dims(2 * M, G, D, False, False, torch.bfloat16), R.RMSNORM_FWD_DEFAULT)
    assert not [x for x in w if "compile cache" in str(x.message)] and len(launches) == 2


def test_the_key_is_that_of_the_files_the_choice_read(launches, tmp_path):
    """A user-cache file written by another process after this one loaded it: this process chooses from its loaded
    copy and stores the entry under that copy's key, so a later process, which reads the new file, chooses again
    (from the new entry) instead of loading a choice the file no longer gives."""
    kernel = _kernel()
    tuning.clear_caches()
    with tuning.use(HelionSettings()):
        first_use.tuned_call("rmsnorm_fwd", kernel, _args(), DIMS, R.RMSNORM_FWD_DEFAULT)  # loads the user cache
        m2 = 2 * M
        dims2 = R._norm_dims(m2, G, D, False, False, torch.bfloat16)
        path = tuning.config_path("rmsnorm_fwd", "sm90", tuning.user_cache_root())
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"kernel": "rmsnorm_fwd", "arch": "sm90", "entries": {tuning.shape_key(**dims2): {
            "dims": dims2, "config": {"block_sizes": [8], "num_warps": 1}, "time_ms": 0.01}}}))
        first_use.tuned_call("rmsnorm_fwd", kernel, _args(m2), dims2, R.RMSNORM_FWD_DEFAULT)  # the old copy: nearest
    assert sorted(json.loads(p.read_text())["how"] for p in _entries(tmp_path)) == ["nearest", "nearest"]
    _call(kernel, m=m2)  # a fresh process reads the new file
    hows = sorted(json.loads(p.read_text())["how"] for p in _entries(tmp_path))
    assert hows == ["cache", "nearest", "nearest"]


def test_an_entry_whose_config_does_not_launch_is_deleted_and_the_config_chosen_again(launches, tmp_path,
                                                                                      monkeypatch):
    """A stored config that this GPU refuses at its first launch (here Triton's OutOfResources for its warp count):
    one warning names the entry, it is deleted, the call runs the next candidate, and a later process stores
    nothing for the config that does not launch."""
    from triton.runtime.errors import OutOfResources

    kernel = _kernel()
    _call(kernel)
    entry, = _entries(tmp_path)
    bad_warps = json.loads(entry.read_text())["config"]["num_warps"]
    record = tuning.with_launcher

    def refusing(fn, args, rt):
        launch = record(fn, args, rt)
        inner = launch.keywords["_launcher"]

        def launcher(triton_kernel, grid, *a, num_warps, num_stages, **kw):
            if num_warps == bad_warps:
                raise OutOfResources(300000, 232448, "shared memory")
            return inner(triton_kernel, grid, *a, num_warps=num_warps, num_stages=num_stages, **kw)
        return functools.partial(launch.func, _launcher=launcher)

    monkeypatch.setattr(tuning, "with_launcher", refusing)
    launches.clear()
    msgs = _call(kernel)
    said = [m for m in msgs if "compile cache entry" in m]
    assert len(said) == 1 and str(entry) in said[0] and "entry deleted" in said[0] and "OutOfResources" in said[0]
    assert any("does not run on this GPU; using" in m for m in msgs)  # the launch-misfit fallback's own warning
    assert len(launches) == 1 and launches[0][2] != bad_warps
    assert not entry.exists() and _entries(tmp_path) == []


def test_sources_edited_after_import_are_not_stored(launches, tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "_sources_digest", lambda: "sources edited since import")
    msgs = _call(_kernel())
    assert _entries(tmp_path) == [] and len(launches) == 1
    assert any("sources changed after this process imported them" in m for m in msgs)


def test_a_callable_that_is_not_generated_code_is_said_and_not_stored(tmp_path):
    """store writes only a module-level function of a generated Triton module; anything else (a function whose
    module cannot be read back as Helion's output) is one warning naming it, and no file."""
    tuning.clear_caches()

    def launch(*args):
        return args

    path = tmp_path / "entry.json"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert compile_cache.store(path, launch, helion.Config(num_warps=4), "exact", ()) is False
    said = [str(x.message) for x in w if "compile cache does not store" in str(x.message)]
    assert len(said) == 1 and "launch" in said[0] and not path.exists()
    tuning.clear_caches()
