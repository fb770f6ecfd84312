"""kernels.tuning: shape keys, config files, lookup exact/nearest/fallback with one warning."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import helion
import helion.language as hl
from pathlib import Path

from kernels import first_use, tuner, tuning
from kernels.settings import HelionSettings, HelionSettingsError


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    tuning.clear_caches()
    monkeypatch.delenv("HELION_INTERPRET", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the default user cache of these tests
    yield
    tuning.clear_caches()


DEFAULT = helion.Config(block_sizes=[32], num_warps=4)


def _scale_rows_fn(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    for tm in hl.tile(x.size(0)):
        out[tm, :] = x[tm, :] * 2.0
    return out


_scale_rows = helion.kernel(_scale_rows_fn, static_shapes=True)


def _select(name, dims, default, root, arch="sm90", **kw):
    """select_config for a small compiled-mode kernel (bound on CPU; the chosen config must fit its spec)."""
    k = helion.kernel(_scale_rows_fn, static_shapes=True)
    rt = kw.pop("rt", None) or tuning.Runtime(HelionSettings(cache_dir=str(root / "cache")))
    return first_use.select_config(name, k, (torch.randn(64, 32),), dims, default, arch=arch, root=root, rt=rt, **kw)


def test_shape_key_canonical():
    assert tuning.shape_key(c=128, n=128, g=8, p=64, h=64, l=8192, b=2) == "b2_l8192_h64_p64_g8_n128_c128"
    assert tuning.shape_key(m=16384, gs=512, g=8, z=True, nbg=False) == "m16384_g8_gs512_nbg0_z1"
    assert tuning.shape_key(b=2, dtype="bf16") == "b2_dtypebf16"
    with pytest.raises(ValueError):
        tuning.shape_key(b=2.5)
    with pytest.raises(ValueError):
        tuning.shape_key()


def _blocks(cfg):
    return cfg.config["block_sizes"], cfg.config["num_warps"]


def test_record_round_trip_and_exact(tmp_path):
    dims = dict(m=16384, g=8, gs=512)
    cfg = helion.Config(block_sizes=[16], num_warps=8)
    path = tuning.record("rmsnorm_bwd", dims, cfg, 0.123, {"note": "x"}, arch="sm90", root=tmp_path)
    data = json.loads(path.read_text())
    e = data["entries"]["m16384_g8_gs512"]
    assert data["arch"] == "sm90" and data["kernel"] == "rmsnorm_bwd"
    assert e["time_ms"] == pytest.approx(0.123) and e["dims"] == dims and e["meta"] == {"note": "x"}
    assert "date" in e and "gpu" in e
    assert not list(path.parent.glob("*.tmp"))  # written atomically (a temporary file replaced)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, how = _select("rmsnorm_bwd", dims, DEFAULT, tmp_path)
    assert how == "exact" and _blocks(got) == ([16], 8) and got.config["pid_type"] == "flat"
    # updating keeps other entries
    tuning.record("rmsnorm_bwd", dict(m=8192, g=8, gs=512), DEFAULT, 0.2, arch="sm90", root=tmp_path)
    data = json.loads(path.read_text())
    assert set(data["entries"]) == {"m16384_g8_gs512", "m8192_g8_gs512"}


def test_nearest_with_one_warning(tmp_path):
    near = helion.Config(block_sizes=[8], num_warps=2)
    far = helion.Config(block_sizes=[64], num_warps=8)
    tuning.record("k", dict(m=16384, g=8, gs=512), near, 0.1, arch="sm90", root=tmp_path)
    tuning.record("k", dict(m=1024, g=8, gs=512), far, 0.1, arch="sm90", root=tmp_path)
    tuning.record("k", dict(m=32768, g=4, gs=1024, extra=1), far, 0.1, arch="sm90", root=tmp_path)  # other dim names
    with pytest.warns(UserWarning, match="nearest tuned shape m16384_g8_gs512.*once per kernel"):
        got, how = _select("k", dict(m=32768, g=4, gs=512), DEFAULT, tmp_path)
    assert how == "nearest" and _blocks(got) == ([8], 2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _select("k", dict(m=32768, g=4, gs=512), DEFAULT, tmp_path)
        assert _blocks(_select("k", dict(m=2048, g=8, gs=512), DEFAULT, tmp_path)[0]) == ([64], 8)
    assert not w, "the nearest-shape notice is given once per kernel, not per shape"
    with pytest.warns(UserWarning, match="no tuned sm90 config for k2 at m2048"):  # another kernel says so on its own
        tuning.record("k2", dict(m=16384, g=8, gs=512), near, 0.1, arch="sm90", root=tmp_path)
        _select("k2", dict(m=2048, g=8, gs=512), DEFAULT, tmp_path)


def test_nearest_requires_same_non_int_dims(tmp_path):
    tuning.record("k", dict(m=16384, dt="bf16"), DEFAULT, 0.1, arch="sm90", root=tmp_path)
    with pytest.warns(UserWarning, match="generic default"):
        got, how = _select("k", dict(m=16384, dt="fp16"), {"block_sizes": [64]}, tmp_path)
    assert how == "default" and got.config["block_sizes"] == [64]


def test_seq_flag_is_a_near_dim_not_another_kernel(tmp_path):
    """A kernel with seq_idx (seq=1) borrows the config tuned without it at its own shape (distance 1, as a factor of 2
    in one dim) before one tuned with seq_idx at a shape 16x away, and the other way round at 2x."""
    same_shape = helion.Config(block_sizes=[8], num_warps=2)
    same_seq = helion.Config(block_sizes=[64], num_warps=8)
    tuning.record("k", dict(m=16384, g=8, seq=0), same_shape, 0.1, arch="sm90", root=tmp_path)
    tuning.record("k", dict(m=1024, g=8, seq=1), same_seq, 0.1, arch="sm90", root=tmp_path)
    with pytest.warns(UserWarning, match="nearest tuned shape m16384_g8_seq0"):
        got, how = _select("k", dict(m=16384, g=8, seq=1), DEFAULT, tmp_path)
    assert how == "nearest" and _blocks(got) == ([8], 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, how = _select("k", dict(m=2048, g=8, seq=1), DEFAULT, tmp_path)
    assert how == "nearest" and _blocks(got) == ([64], 8)
    assert tuning._distance(dict(m=4, seq=1), dict(m=8, seq=0)) == pytest.approx(2.0)
    assert tuning._distance(dict(m=4, cl=1), dict(m=4, cl=0)) is None  # other flags stay different kernels


def test_arch_without_configs_says_so_once_with_the_tune_command(tmp_path):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got, how = _select("nope", dict(m=4), DEFAULT, tmp_path, arch="sm100")
        _select("nope2", dict(m=4), DEFAULT, tmp_path, arch="sm100")
    assert how == "default" and _blocks(got) == ([32], 4)
    msgs = [str(x.message) for x in w]
    arch = [m for m in msgs if "no committed Helion configs for sm100" in m]
    assert len(arch) == 1 and "scripts/tune_kernels.py" in arch[0] and "kernels.helion.autotune=true" in arch[0]
    assert len(msgs) == 1, msgs  # the arch's line covers every kernel on its generic default
    # a default that does not fit the call (a spec default instead) is a decision of its own: said once per kernel
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _select("misfit", dict(m=4), {"block_sizes": [32, 32, 32]}, tmp_path, arch="sm100")
    msgs = [str(x.message) for x in w]
    assert msgs and all("misfit" in m for m in msgs) and "Helion spec default" in msgs[-1], msgs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _select("nope", dict(m=4), DEFAULT, tmp_path, arch="sm100")


def test_cpu_and_interpret_use_default(tmp_path, monkeypatch):
    tuning.record("k", dict(m=4), helion.Config(block_sizes=[4]), 0.1, arch="sm90", root=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _select("k", dict(m=4), DEFAULT, tmp_path, arch="cpu") == (DEFAULT, "default")
        monkeypatch.setenv("HELION_INTERPRET", "1")
        k = helion.kernel(_scale_rows_fn, static_shapes=True)  # ref mode is fixed at decoration
        got = first_use.select_config("k", k, (torch.randn(4, 4),), dict(m=4), DEFAULT, arch="sm90", root=tmp_path)
        assert got == (DEFAULT, "default")


def test_malformed_file_fails_clearly(tmp_path):
    p = tmp_path / "sm90" / "bad.json"
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps({"oops": 1}))
    with pytest.raises(ValueError, match="malformed"):
        _select("bad", dict(m=1), DEFAULT, tmp_path)


def test_a_config_that_does_not_fit_is_skipped_with_one_warning(tmp_path):
    """An exact entry with more block sizes than the bound kernel has (Helion's InvalidConfig) is skipped, named
    with its tuned shape; the nearest entry that fits runs; the warning is given once per kernel and shape."""
    bad = dict(block_sizes=[16, 16], num_warps=4)
    tuning.record("k", dict(m=64), bad, 0.1, arch="sm90", root=tmp_path)
    tuning.record("k", dict(m=128), dict(block_sizes=[8], num_warps=2), 0.1, arch="sm90", root=tmp_path)
    with pytest.warns(UserWarning, match=r"committed config of k tuned at m64 does not fit .* shape m64 "
                                         r"\(InvalidConfig: Too many values for config\['block_sizes'\]"):
        got, how = _select("k", dict(m=64), DEFAULT, tmp_path)
    assert how == "nearest" and _blocks(got) == ([8], 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _select("k", dict(m=64), DEFAULT, tmp_path)
    # nothing fits, not even the generic default: the spec's own default (valid for every shape) runs
    tuning.record("k3", dict(m=64), bad, 0.1, arch="sm90", root=tmp_path)
    with pytest.warns(UserWarning, match="Helion spec default"):
        got, how = _select("k3", dict(m=64), dict(bad, block_sizes=[8, 8]), tmp_path)
    assert how == "spec-default"
    k = helion.kernel(_scale_rows_fn, static_shapes=True)
    k.bind((torch.randn(64, 32),)).config_spec.normalized_config(got)  # fits


def _fake_tune(calls, cfg=helion.Config(block_sizes=[4], num_warps=1)):
    def tune_call(name, kernel, args, **kw):
        calls.append((name, kw["budget_s"], [c.config.get("block_sizes") for c in kw["start"]]))
        return cfg, 0.05, {"how": "fake search"}
    return tune_call


def test_first_use_tuning_stores_in_the_user_cache_and_later_runs_reuse_it(tmp_path, monkeypatch):
    """kernels.helion.autotune: a shape without an exact entry is searched once (a fake search here: no GPU), the
    winner written to <cache_dir>/<arch>/<kernel>.json; a later run (fresh process state) and another rank read it
    without searching; with autotune off the cache entry is still used before any nearest shape."""
    from kernels import tuner

    calls = []
    monkeypatch.setattr(tuner, "tune_call", _fake_tune(calls))
    tuning.record("k", dict(m=128), dict(block_sizes=[8], num_warps=2), 0.1, arch="sm90", root=tmp_path)
    cache = tmp_path / "ucache"
    rt = tuning.Runtime(HelionSettings(autotune=True, autotune_budget_s=7, cache_dir=str(cache)))
    with pytest.warns(UserWarning, match=r"tuned k at m64 .*stored in .*ucache/sm90/k.json"):
        got, how = _select("k", dict(m=64), DEFAULT, tmp_path, rt=rt)
    assert how == "tuned" and _blocks(got) == ([4], 1)
    assert calls == [("k", 7.0, [[8]])]  # the budget, and the nearest shape's config (it fits) tried first
    entry = json.loads((cache / "sm90" / "k.json").read_text())["entries"]["m64"]
    assert entry["config"]["block_sizes"] == [4] and entry["meta"] == {"how": "fake search"}
    tuning.clear_caches()  # a later run
    got, how = _select("k", dict(m=64), DEFAULT, tmp_path, rt=tuning.Runtime(rt.settings))
    assert how == "cache" and _blocks(got) == ([4], 1) and len(calls) == 1
    off = tuning.Runtime(HelionSettings(cache_dir=str(cache)))
    assert _select("k", dict(m=64), DEFAULT, tmp_path, rt=off)[1] == "cache"
    # another rank that finds the entry written while it waited for the lock reads it instead of searching
    tuning.clear_caches()
    monkeypatch.setattr(tuning, "_entries", _entries_after_lock(tuning._entries, cache))
    assert _select("k", dict(m=96), DEFAULT, tmp_path, rt=tuning.Runtime(rt.settings))[1] == "tuned"
    assert len(calls) == 1


def _entries_after_lock(real, cache):
    """_entries, except that the user cache gains an m96 entry once the tuning lock is taken (another rank wrote
    it meanwhile)."""
    state = {"n": 0}

    def entries(name, arch, root):
        e = real(name, arch, root)
        if Path(root) == cache:
            state["n"] += 1
            if state["n"] >= 2:  # the second read is the one under the lock
                e = dict(e, m96={"dims": {"m": 96}, "config": {"block_sizes": [2], "num_warps": 1}})
        return e

    return entries


def test_settings_keys_are_typed_and_validated():
    for bad, msg in ((dict(autotune="yes"), "kernels.helion.autotune='yes' must be true or false"),
                     (dict(autotune_budget_s=0),
                      "kernels.helion.autotune_budget_s=0 must be a finite number of seconds > 0"),
                     (dict(autotune_budget_s=float("inf")), "autotune_budget_s=inf must be a finite number"),
                     (dict(autotune_budget_s=float("nan")), "autotune_budget_s=nan must be a finite number"),
                     (dict(autotune_budget_s="60"), "autotune_budget_s='60' must be a finite number"),
                     (dict(cache_dir=3), "kernels.helion.cache_dir=3 must be a path"),
                     (dict(autotune_jobs=0), "kernels.helion.autotune_jobs=0 must be a whole number >= 1"),
                     (dict(autotune_jobs=2.5), "autotune_jobs=2.5 must be a whole number"),
                     (dict(autotun=True), "unknown kernels.helion key.*autotun")):
        with pytest.raises(HelionSettingsError, match=msg) as e:
            HelionSettings.from_mapping(bad)
        assert "\n" not in str(e.value)
    s = HelionSettings.from_mapping(dict(autotune=True, autotune_budget_s=30, cache_dir="~/x"))
    assert s.autotune_budget_s == 30.0 and tuning.user_cache_root(s.cache_dir) == Path("~/x").expanduser()
    assert HelionSettings.from_mapping(dict(cache_dir=None)).cache_dir == ""


def test_default_user_cache_is_outside_the_repository(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tuning.user_cache_root("") == tmp_path / ".cache" / "nano_hybrid" / "helion"
    assert tuning.CONFIG_ROOT.parent not in tuning.user_cache_root("").parents


def test_candidate_configs_from_config_space():
    _scale_rows = helion.kernel(_scale_rows_fn, static_shapes=True)  # not in interpret mode (env cleared)
    assert not tuning.kernel_in_ref_mode(_scale_rows)
    x = torch.randn(64, 32)
    cands = tuner.candidate_configs(_scale_rows, (x,), seeds=tuner.grid_seeds(block_sizes=[[4], [8]], num_warps=[2, 4]), n_random=5)
    jsons = [c.to_json() for c in cands]
    assert len(jsons) == len(set(jsons))
    assert cands[0] == _scale_rows.bind((x,)).config_spec.default_config()
    assert any(c.config.get("block_sizes") == [8] and c.config.get("num_warps") == 2 for c in cands)
    assert len(cands) >= 6


def test_run_with_config_interpret(monkeypatch):
    monkeypatch.setenv("HELION_INTERPRET", "1")
    k = helion.kernel(_scale_rows_fn, static_shapes=True)  # Helion fixes ref mode at decoration
    assert tuning.kernel_in_ref_mode(k)
    x = torch.randn(10, 7)
    torch.testing.assert_close(tuning.run_with_config(k, (x,), DEFAULT), x * 2)


def test_outputs_close():
    a = (torch.ones(3), torch.zeros(2))
    assert tuner.outputs_close(a, (torch.ones(3), torch.zeros(2)), 1e-3, 0)[0]
    assert not tuner.outputs_close(a, (torch.ones(3) * 1.1, torch.zeros(2)), 1e-3, 0)[0]
    assert not tuner.outputs_close((torch.tensor([float("nan")]),), (torch.zeros(1),), 1, 1)[0]


def test_search_requires_gpu():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    with pytest.raises(RuntimeError, match="CUDA"):
        tuner.search(_scale_rows, (torch.randn(4, 4),), [], budget_s=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_search_on_gpu_picks_a_correct_config():
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    cands = tuner.candidate_configs(_scale_rows, (x,), seeds=tuner.grid_seeds(block_sizes=[[1], [4], [16]]), n_random=4)
    best, results = tuner.search(_scale_rows, (x,), cands, budget_s=60, rep=10)
    assert any(r["status"] == "ok" for r in results)
    torch.testing.assert_close(tuning.run_with_config(_scale_rows, (x,), best), x * 2)


# Shape keys the wrappers compute at the Nano shape (b 2, l 8192, h 64, p 64, g 8, n 128, c 128, w 4; gated
# norm over d_inner 4096 in groups of 512, z=None, norm_before_gate=False, bf16).
_NANO_SSD = dict(b=2, l=8192, h=64, p=64, g=8, n=128, c=128)
NANO_COMMITTED = {
    "rmsnorm_bwd": dict(m=16384, g=8, gs=512, z=False, nbg=False, dt="bfloat16"),
    "rmsnorm_fwd": dict(m=16384, g=8, gs=512, z=False, nbg=False, dt="bfloat16"),
    "rmsnorm_bwd_z": dict(m=16384, g=8, gs=512, z=True, nbg=False, dt="bfloat16"),
    "rmsnorm_fwd_z": dict(m=16384, g=8, gs=512, z=True, nbg=False, dt="bfloat16"),
    "ssd_bwd_dstates": _NANO_SSD,
    "ssd_bmm_chunk": dict(b=2, l=8192, g=8, n=128, c=128),
    "ssd_bwd_dx": _NANO_SSD,
    "ssd_bwd_dz_dstates": _NANO_SSD,
    "ssd_bwd_dc_dcb": _NANO_SSD,
    "ssd_bwd_db": _NANO_SSD,
    "ssd_chunk_cumsum": dict(b=2, l=8192, h=64, c=128),
    "ssd_chunk_scan": _NANO_SSD,
    "ssd_chunk_scan_cb16": _NANO_SSD,
    "ssd_chunk_state_passing": _NANO_SSD,
    "conv1d_fwd": dict(b=2, l=8192, d=6144, w=4, cl=1, seq=0, act=1, dt="bfloat16"),
    "conv1d_bwd": dict(b=2, l=8192, d=6144, w=4, cl=1, seq=0, act=1, dt="bfloat16"),
    "ssd_bwd_state_passing": dict(_NANO_SSD, blk=512),
    "ssd_bwd_dt": _NANO_SSD,
    "ssd_chunk_state": _NANO_SSD,
    "ssd_state_passing": dict(b=2, h=64, d=8192, nc=64),
}


def test_every_tunable_kernel_has_exactly_one_sm90_file():
    """One config file per kernel of the current design, named as the kernel (and its "kernel" field), no other."""
    files = {p.stem for p in (tuning.CONFIG_ROOT / "sm90").glob("*.json")}
    assert files == set(tuner.discover_tunable_kernels()) == set(NANO_COMMITTED)
    for name in files:
        assert json.loads((tuning.CONFIG_ROOT / "sm90" / f"{name}.json").read_text())["kernel"] == name


def test_committed_sm90_configs_resolve_at_nano_shape():
    """Every committed kernels/configs/sm90 file has an exact entry at the Nano shape key the wrapper
    computes (the exact entry select_config starts from, before the fit check that needs the bound kernel)."""
    files = sorted(p.stem for p in (tuning.CONFIG_ROOT / "sm90").glob("*.json"))
    assert set(NANO_COMMITTED) <= set(files), f"missing committed sm90 configs: {set(NANO_COMMITTED) - set(files)}"
    for name, dims in NANO_COMMITTED.items():
        entry = json.loads((tuning.CONFIG_ROOT / "sm90" / f"{name}.json").read_text())["entries"][tuning.shape_key(**dims)]
        how, key, got = tuning.lookup(name, dims, arch="sm90")
        assert how == "exact" and got is entry or got == entry, name
        assert helion.Config.from_dict(entry["config"]) != DEFAULT


@pytest.mark.parametrize("name", ["ssd_bwd_dz_dstates", "ssd_bwd_dx", "ssd_bwd_db", "rmsnorm_bwd"])
def test_committed_configs_fit_current_kernels(name):
    """The committed sm90 config of a kernel whose signature changed since the search still fits the
    kernel's config space (same block sizes / number of loads and stores) and generates Triton code.
    ``host_tensor_descriptors`` is dropped here: the CPU config space lacks it (TMA-capable GPUs only)."""
    entry = next(iter(json.loads((tuning.CONFIG_ROOT / "sm90" / f"{name}.json").read_text())["entries"].values()))
    cfg = dict(entry["config"])
    cfg.pop("host_tensor_descriptors", None)
    if name == "rmsnorm_bwd":
        from kernels.rmsnorm_gated_helion import TUNABLE_KERNELS

        case = TUNABLE_KERNELS[name](dict(b=1, l=256, h=8, p=64, g=2, n=16), "cpu")
        kern, args = case.kernel, case.args
    else:
        from kernels import ssd_helion_bwd as sb

        args, _ = sb._example_args(name, dict(b=1, l=256, h=8, p=64, g=2, n=128, c=128), "cpu")
        kern = sb._KERNELS[name]
    kern = helion.kernel(kern.fn, static_shapes=True)
    code = kern.bind(args).to_triton_code(helion.Config.from_dict(cfg))
    assert "@triton.jit" in code and code.count("def _helion_") == 1


class _FakeBound:
    def __init__(self, log):
        self.log = log

    def compile_config(self, cfg, allow_print=False):
        self.log.append(("compile", cfg.to_json()))
        return lambda *a: ("ran", a[0].shape)


class _FakeKernel:
    """Stands in for a compiled (non-interpret) helion kernel: bind().compile_config() -> callable."""

    def __init__(self):
        from helion.runtime.ref_mode import RefMode

        self.settings = type("S", (), {"ref_mode": RefMode.OFF})()
        self.log = []

    def bind(self, args):
        return _FakeBound(self.log)


def test_tuned_call_fast_path_skips_config_lookup(monkeypatch):
    k = _FakeKernel()
    calls = []
    real = first_use.select_config
    monkeypatch.setattr(first_use, "select_config",
                        lambda *a, **kw: calls.append(a[0]) or real(*a, **{**kw, "arch": "cpu"}))
    x = torch.zeros(4, 8)
    for _ in range(3):
        assert first_use.tuned_call("fake", k, (x, 3), {"m": 4}, DEFAULT) == ("ran", (4, 8))
    assert calls == ["fake"] and len(k.log) == 1  # one lookup, one compile, three launches
    # a new signature (shape, stride or scalar) looks up and compiles again
    first_use.tuned_call("fake", k, (torch.zeros(4, 8).t(), 3), {"m": 4}, DEFAULT)
    first_use.tuned_call("fake", k, (x, 4), {"m": 4}, DEFAULT)
    assert len(calls) == 3
    # clear_caches (and recording a new config) forget the fast path
    tuning.clear_caches()
    first_use.tuned_call("fake", k, (x, 3), {"m": 4}, DEFAULT)
    assert len(calls) == 4


def _fits_smem(monkeypatch, tmp_path, max_block: int):
    """Compiled-mode ``_scale_rows`` bound on CPU with arch sm90 and the committed configs under ``tmp_path``; its
    ``compile_config`` gives a callable that raises Triton's ``OutOfResources`` at the first launch when the config's
    row block exceeds ``max_block`` (as a GPU with less shared memory than the tuning GPU does), else runs the math.
    Returns the kernel and the list of (block, launched) records."""
    from triton.runtime.errors import OutOfResources

    k = helion.kernel(_scale_rows_fn, static_shapes=True)
    bound_type = type(k.bind((torch.randn(64, 32),)))
    log = []

    def compile_config(self, cfg, allow_print=False):
        block = cfg.config["block_sizes"][0]

        def run(x):
            if block > max_block:
                log.append((block, False))
                raise OutOfResources(block * 2048, max_block * 2048, "shared memory")
            log.append((block, True))
            return x * 2.0
        return run

    monkeypatch.setattr(bound_type, "compile_config", compile_config)
    monkeypatch.setattr(tuning, "current_arch", lambda: "sm90")
    monkeypatch.setattr(tuning, "CONFIG_ROOT", tmp_path)
    return k, log


def test_a_config_that_does_not_launch_on_this_gpu_gives_way_to_the_next_candidate(tmp_path, monkeypatch):
    """The exact committed config passes Helion's spec check but its first launch fails for shared memory: the
    nearest tuned shape's config runs instead, with one warning naming the kernel, the shape, the failed config and
    Triton's reason; later calls take the fast path (no compile, no warning)."""
    k, log = _fits_smem(monkeypatch, tmp_path, max_block=16)
    tuning.record("k", dict(m=64), dict(block_sizes=[64], num_warps=4), 0.1, arch="sm90", root=tmp_path)
    tuning.record("k", dict(m=128), dict(block_sizes=[8], num_warps=2), 0.1, arch="sm90", root=tmp_path)
    x = torch.randn(64, 32)
    with pytest.warns(UserWarning, match=r"k at m64: the committed config \{.*'block_sizes': \[64\].*\} "
                                         r"\(OutOfResources: out of resource: shared memory.*\) does not run on this "
                                         r"GPU; using the nearest tuned shape m128"):
        out = first_use.tuned_call("k", k, (x,), dict(m=64), DEFAULT)
    torch.testing.assert_close(out, x * 2.0)
    assert log == [(64, False), (8, True)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(first_use.tuned_call("k", k, (x,), dict(m=64), DEFAULT), x * 2.0)
    assert log == [(64, False), (8, True), (8, True)]


def test_a_config_that_does_not_compile_gives_way_to_the_next_candidate(tmp_path, monkeypatch):
    """A Triton compile failure of the chosen config (here at ``compile_config``) is handled as a launch misfit."""
    k, log = _fits_smem(monkeypatch, tmp_path, max_block=16)
    bound_type = type(k.bind((torch.randn(64, 32),)))
    runs = bound_type.compile_config
    compile_error = type("CompilationError", (Exception,), {})

    def compile_config(self, cfg, allow_print=False):
        if cfg.config["block_sizes"][0] > 16:
            raise compile_error("at 12:4: too many registers")
        return runs(self, cfg, allow_print)

    monkeypatch.setattr(bound_type, "compile_config", compile_config)
    tuning.record("k", dict(m=64), dict(block_sizes=[64], num_warps=4), 0.1, arch="sm90", root=tmp_path)
    tuning.record("k", dict(m=128), dict(block_sizes=[8], num_warps=2), 0.1, arch="sm90", root=tmp_path)
    x = torch.randn(64, 32)
    with pytest.warns(UserWarning, match=r"\(CompilationError: at 12:4: too many registers\) does not run on this GPU; "
                                         r"using the nearest tuned shape m128"):
        torch.testing.assert_close(first_use.tuned_call("k", k, (x,), dict(m=64), DEFAULT), x * 2.0)
    assert log == [(8, True)]


def test_a_kernel_that_launches_with_no_config_is_one_error_naming_it(tmp_path, monkeypatch):
    """Every candidate of the chain (exact, generic default, Helion's spec default) fails to launch: one
    ``UnsupportedShapeError`` naming the kernel, the shape and each config's reason, after trying each once."""
    from kernels.shapes import UnsupportedShapeError

    k, log = _fits_smem(monkeypatch, tmp_path, max_block=0)
    tuning.record("k", dict(m=64), dict(block_sizes=[64], num_warps=4), 0.1, arch="sm90", root=tmp_path)
    with pytest.raises(UnsupportedShapeError, match=r"helion backend: k at shape m64 does not run on this GPU with "
                                                    r"any config: the committed config .*generic default.*Helion spec "
                                                    r"default.*kernels/shapes.py") as e:
        first_use.tuned_call("k", k, (torch.randn(64, 32),), dict(m=64), DEFAULT)
    assert e.value.args[0].count("OutOfResources") == len(log) == 3 and not any(ok for _, ok in log)


@pytest.mark.parametrize("err", [RuntimeError("boom in the host code"), torch.OutOfMemoryError("CUDA out of memory"),
                                 RuntimeError("CUDA error: an illegal memory access was encountered")],
                         ids=["other", "oom", "illegal-access"])
def test_errors_that_are_not_a_config_misfit_propagate(tmp_path, monkeypatch, err):
    """A launch error a config does not cause (host code, out of memory, a context-breaking CUDA error) is raised as
    it is; no other config is tried."""
    k, log = _fits_smem(monkeypatch, tmp_path, max_block=16)

    def failing(self, cfg, allow_print=False):
        def run(x):
            log.append(cfg.config["block_sizes"][0])
            raise err
        return run

    monkeypatch.setattr(type(k.bind((torch.randn(64, 32),))), "compile_config", failing)
    with pytest.raises(type(err), match=str(err)[:10]):
        first_use.tuned_call("k", k, (torch.randn(64, 32),), dict(m=64), DEFAULT)
    assert len(log) == 1


def test_search_takes_the_first_candidate_that_launches_as_its_reference(tmp_path, monkeypatch):
    """First-use and offline tuning on a GPU where the kernel's default config does not launch (less shared memory
    than it needs): the search's reference is the first candidate that launches, the failed one is reported and not
    tried again, and the winner is a config that runs."""
    k, log = _fits_smem(monkeypatch, tmp_path, max_block=16)
    monkeypatch.setattr(tuner.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tuner.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(tuner, "time_fn", lambda fn, rep: (fn(), {8: 0.2, 16: 0.1}[log[-1][0]])[1])
    x = torch.randn(64, 32)
    cands = [helion.Config(block_sizes=[64], num_warps=4), helion.Config(block_sizes=[8], num_warps=4),
             helion.Config(block_sizes=[16], num_warps=4)]
    best, results = tuner.search(k, (x,), cands, budget_s=60, reference=cands[0])
    assert best.config["block_sizes"] == [16]
    assert [(r["config"]["block_sizes"], r["status"]) for r in results] == [([64], "run_error"), ([8], "ok"),
                                                                            ([16], "ok")]
    assert "OutOfResources" in results[0]["error"] and [b for b, _ in log].count(64) == 1
    monkeypatch.setattr(tuner, "time_fn", lambda fn, rep: 0.1)
    with pytest.raises(RuntimeError, match="no config launches on this GPU"):
        tuner.search(k, (x,), cands[:1], budget_s=60, reference=cands[0])



def test_search_times_and_returns_each_candidate_as_it_compiles_here(tmp_path, monkeypatch):
    """Candidates seeded from other shapes (a nearest-shape config, an older kernel's file) can carry per-access
    lists of another length: the search fits each to this specialisation before compiling (the config it times is the
    config it returns, and the tuner stores), drops a second candidate that fits to the same config, and reports one
    that cannot fit as a compile error."""
    monkeypatch.delenv("HELION_INTERPRET", raising=False)  # the kernel as it binds on a GPU (per-access lists)
    k, log = _fits_smem(monkeypatch, tmp_path, max_block=64)
    monkeypatch.setattr(tuner.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tuner.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(tuner, "time_fn", lambda fn, rep: (fn(), {8: 0.3, 16: 0.1, 32: 0.2}[log[-1][0]])[1])
    x = torch.randn(64, 32)
    bound = k.bind((x,))
    n_access = len(bound.config_spec.default_config().config["indexing"])
    default_indexing = bound.config_spec.default_config().config["indexing"]
    cands = [helion.Config(block_sizes=[8], num_warps=4, indexing=["block_ptr"] * (n_access + 3)),  # uniform: resized
             helion.Config(block_sizes=[16], num_warps=4, indexing=["pointer", "block_ptr"] * 3),  # mixed: the default
             helion.Config(block_sizes=[16], num_warps=4, indexing=["block_ptr"] * 7 + ["pointer"]),  # the same, fitted
             helion.Config(block_sizes=[32, 32], num_warps=4)]  # one block size too many: does not fit
    best, results = tuner.search(k, (x,), cands, budget_s=60, reference=cands[0])
    assert best.config["block_sizes"] == [16] and best.config["indexing"] == default_indexing
    bound.config_spec.normalized_config(best)  # fits as returned
    ok = [r for r in results if r["status"] == "ok"]
    assert [(r["config"]["block_sizes"], r["config"]["indexing"]) for r in ok] == [
        ([8], ["block_ptr"] * n_access), ([16], default_indexing)]
    assert [[g["indexing"] for g in r["given"]] for r in ok] == [[cands[0].config["indexing"]],
                                                                 [cands[1].config["indexing"], cands[2].config["indexing"]]]
    bad = [r for r in results if r["status"] == "compile_error"]
    assert len(bad) == 1 and bad[0]["config"]["block_sizes"] == [32, 32] and "does not fit" in bad[0]["error"]
    # the reference runs first also where a later candidate fits to the same config (first-use tuning passes the
    # nearest shape's config first and the spec default among the rest)
    default = bound.config_spec.default_config()
    for reference, cs in ((cands[0], [cands[1], cands[0]]), (None, [cands[1], default])):
        log.clear()
        _, results = tuner.search(k, (x,), cs, budget_s=60, reference=reference)
        ran = [r for r in results if r["status"] == "ok"]
        want = (reference or default).config["block_sizes"]
        assert log[0][0] == want[0] and ran[0]["config"]["block_sizes"] == want and len(ran) == 2


def test_views_past_32_bit_offsets_run_a_64_bit_index_twin(tmp_path, monkeypatch):
    """A strided view with fewer elements than the 32-bit limit can still reach past it in its storage (a slice of
    zxbcdt in Megatron's (l, b, d) memory at a long sequence): the kernel runs as its twin with 64-bit indices (made
    once per kernel, same function and configs), chosen from the arguments at the first call of a signature. The
    limit is lowered here so that small tensors cross it."""
    monkeypatch.setattr(tuning, "INT32_INDEX_LIMIT", 1000)
    lbd = torch.zeros(40, 2, 16)  # (l, b, d) memory: 1280 elements
    z = lbd.transpose(0, 1)[:, :, 8:]  # (b, l, 8) view: 640 elements, the last at offset 1279
    assert z.numel() < 1000 and tuning.needs_int64_index([torch.zeros(3), z])
    assert not tuning.needs_int64_index([lbd[:10].transpose(0, 1)]) and tuning.needs_int64_index([[torch.zeros(1001)]])
    k = helion.kernel(_scale_rows_fn, static_shapes=True)
    twin = tuning.with_index_dtype_for(k, (z,))
    assert twin is not k and twin.settings.index_dtype == torch.int64 and twin.fn is k.fn
    assert tuning.with_index_dtype_for(k, (z,)) is twin and tuning.with_index_dtype_for(k, (torch.zeros(4),)) is k
    assert tuning.with_index_dtype_for(twin, (z,)) is twin  # a kernel that fixes its index dtype keeps it
    # tuned_call binds and compiles the twin for such a call, the kernel itself otherwise
    k, log = _fits_smem(monkeypatch, tmp_path, max_block=64)
    bound_type = type(k.bind((torch.randn(64, 32),)))
    seen = []
    runs = bound_type.compile_config
    monkeypatch.setattr(bound_type, "compile_config",
                        lambda self, cfg, allow_print=False: seen.append(self.kernel.settings.index_dtype)
                        or runs(self, cfg, allow_print))
    wide = torch.zeros(64, 32)[:, :15]  # 960 elements, the last at offset 2030 of its storage
    torch.testing.assert_close(first_use.tuned_call("k", k, (wide,), dict(m=64), DEFAULT), wide * 2.0)
    first_use.tuned_call("k", k, (torch.zeros(16, 32),), dict(m=16), DEFAULT)
    assert seen == [torch.int64, None]


def test_launch_misfit_follows_helions_autotuner_classification():
    from triton.runtime.errors import OutOfResources

    assert "shared memory" in tuning.launch_misfit(OutOfResources(300000, 232448, "shared memory"))
    assert tuning.launch_misfit(RuntimeError("Triton Error [CUDA]: too many resources requested for launch"))
    assert tuning.launch_misfit(type("PTXASError", (RuntimeError,), {})("ptxas fatal")).startswith("PTXASError")
    assert tuning.launch_misfit(helion.exc.InvalidConfig("no such combination")).startswith("InvalidConfig")
    for err in (ValueError("bad argument"), torch.OutOfMemoryError("CUDA out of memory"),
                RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"),
                RuntimeError("Triton Error [CUDA]: out of memory")):
        assert tuning.launch_misfit(err) is None, err


def test_arg_signature_distinguishes_layouts():
    a = torch.zeros(4, 8)
    assert tuning._arg_signature((a,)) == tuning._arg_signature((torch.ones(4, 8),))
    assert tuning._arg_signature((a,)) != tuning._arg_signature((a.t().contiguous().t(),))
    assert tuning._arg_signature((a,)) != tuning._arg_signature((a.double(),))
    assert tuning._arg_signature((a, None)) != tuning._arg_signature((a, 0))
    assert tuning._arg_signature((a, 1)) != tuning._arg_signature((a, True))
    # the same shape and strides at another storage offset (whether 64-bit indices are needed can differ)
    b = torch.zeros(5, 8)
    assert tuning._arg_signature((b[:4],)) == tuning._arg_signature((a,)) != tuning._arg_signature((b[1:],))


def test_time_limit_interrupts_a_slow_candidate():
    import subprocess
    import time

    t0 = time.monotonic()
    with pytest.raises(tuner.CandidateTimeout):
        with tuner._time_limit(0.5):
            subprocess.run(["sleep", "5"], check=False)
    assert time.monotonic() - t0 < 3
    with tuner._time_limit(None):  # no limit: a no-op
        pass


def test_full_config_makes_every_key_explicit():
    from kernels import ssd_helion_bwd as B

    args, _ = B._example_args("ssd_bwd_state_passing", dict(b=1, l=128, h=2, p=8, g=1, n=8, c=64), "cpu")
    kernel = B._KERNELS["ssd_bwd_state_passing"]
    partial = B._DEFAULTS["ssd_bwd_state_passing"]
    full = tuning.full_config(kernel, args, partial)
    d, p = tuning.config_to_dict(full), tuning.config_to_dict(partial)
    assert {k: d[k] for k in p} == p  # what was given is kept
    assert {"indexing", "pid_type", "load_eviction_policies"} <= set(d) - set(p)  # the rest is explicit


def test_dump_code_writes_config_and_triton_source(tmp_path, monkeypatch):
    monkeypatch.delenv("HELION_INTERPRET", raising=False)  # a kernel made now compiles (codegen needs no GPU)

    @helion.kernel(static_shapes=True)
    def _scale2(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        for t in hl.tile(x.size(0)):
            out[t] = x[t] * 2.0
        return out

    args = (torch.randn(64),)
    bound = _scale2.bind(args)
    cfg = helion.Config(block_sizes=[32], num_warps=2)
    tuning._dump_code(tmp_path, _scale2, bound, cfg, args)
    (f,) = tmp_path.glob("*.py")
    text = f.read_text()
    assert text.startswith("# config ") and "'block_sizes': [32]" in text.splitlines()[0]
    assert "@triton.jit" in text and "num_warps=2" in text


def test_generic_configs_are_compiled_as_flat_grids():
    """A config without pid_type gets "flat" (Helion would otherwise pick persistent_blocked in a
    torch.distributed process); an explicit pid_type is kept."""
    got = tuning.with_flat_pid(helion.Config(block_sizes=[64], num_warps=4))
    assert got.config["pid_type"] == "flat" and got.config["block_sizes"] == [64] and got.config["num_warps"] == 4
    keep = helion.Config(block_sizes=[64], pid_type="persistent_interleaved")
    assert tuning.with_flat_pid(keep).config["pid_type"] == "persistent_interleaved"


_FIT_SCRIPT = r"""
import json, torch, helion
from kernels import ssd_helion as S, tuning
entry = json.load(open("kernels/configs/sm90/ssd_chunk_state.json"))["entries"]["b2_l8192_h64_p64_g8_n128_c128"]
cfg = dict(entry["config"]); cfg.pop("host_tensor_descriptors", None)  # a GPU-only key
args, _ = S._kernel_args("ssd_chunk_state", dict(b=1, l=256, h=4, p=16, g=2, n=16, c=64), "cpu")
a = list(args); a[-1] = torch.zeros(1, 256, dtype=torch.int32)  # with seq_idx: more loads than tuned for
bound = S.get_kernel("ssd_chunk_state").bind(tuple(a))
try:
    bound.to_triton_code(helion.Config(**cfg)); raise SystemExit("the committed config unexpectedly fits")
except SystemExit:
    raise
except Exception as e:
    assert "exceeds indexing config length" in str(e), e
import warnings
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    fitted = tuning.fit_lists(bound, helion.Config(**cfg))
assert not w, [str(x.message) for x in w]  # uniform lists are resized: nothing the tuning chose is lost
want = bound.config_spec.default_config().config
for k in ("indexing", "load_eviction_policies"):
    assert len(set(cfg[k])) == 1 and len(want[k]) > len(cfg[k])
    assert fitted.config[k] == [cfg[k][0]] * len(want[k]), (k, fitted.config[k])
assert "@triton.jit" in bound.to_triton_code(fitted)
mixed = dict(cfg, load_eviction_policies=["first", "last"] + [""] * (len(cfg["load_eviction_policies"]) - 2))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    refit = tuning.fit_lists(bound, helion.Config(**mixed))
assert refit.config["load_eviction_policies"] == list(want["load_eviction_policies"])  # the kernel's defaults
assert len(w) == 1 and "load_eviction_policies" in str(w[0].message), [str(x.message) for x in w]
plain = S.get_kernel("ssd_chunk_state").bind(tuple(args))  # the tuned specialisation keeps its lists
assert tuning.fit_lists(plain, helion.Config(**cfg)).config["indexing"] == cfg["indexing"]
print("OK")
"""


def test_committed_config_fits_other_specialisations_of_its_shape():
    """The committed ssd_chunk_state config (tuned without seq_idx) compiles with seq_idx once its
    per-access lists are fitted (Helion code generation, no GPU; outside interpret mode: subprocess): lists with one
    setting for every access are resized silently, a list of mixed settings falls back to the kernel's defaults with
    one warning."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "HELION_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _FIT_SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-2000:] + r.stderr[-3000:]


def test_neighbour_configs_change_one_knob_of_the_committed_config():
    base = {"block_sizes": [64], "num_warps": 8, "num_stages": 1, "indexing": ["pointer"] * 3,
            "load_eviction_policies": ["", ""]}
    near = tuner.neighbour_configs(base)
    changed = [sorted(k for k in d if d[k] != base.get(k)) for d in near]
    assert all(len(c) == 1 for c in changed), changed
    assert {"indexing": "tensor_descriptor"}.items() <= near[0].items()
    assert {"num_warps": 4}.items() <= next(d for d in near if d["num_warps"] != 8).items()
    assert all(d["num_stages"] >= 1 and 1 <= d["num_warps"] <= 16 for d in near)
    assert any(d["load_eviction_policies"] == ["last", "last"] for d in near)
    assert base not in near and len({json.dumps(d, sort_keys=True) for d in near}) == len(near)


def test_block_sizes_are_clamped_to_the_dimension_they_tile(monkeypatch):
    """A Nano config (row block 128 over the chunk) at a chunk of 64: the block is clamped to 64, so the
    compiled kernel has no masked lanes past the chunk end (their exp(-dA_cumsum) overflowed to inf and
    gave NaN gradients on the H200); at the Nano shape the committed config is kept as it is."""
    from kernels import ssd_helion_bwd as bwd

    monkeypatch.delenv("HELION_INTERPRET", raising=False)  # interpret-mode binds have no block-size specs
    dx = helion.kernel(bwd.ssd_bwd_dc_dcb.fn, static_shapes=True)  # a fresh kernel: no bind cached in ref mode
    small = dict(b=1, l=64, h=2, p=32, g=1, n=32, c=64)
    nano = dict(b=2, l=256, h=4, p=64, g=1, n=128, c=128)
    cfg = helion.Config(block_sizes=[128], num_warps=8, num_stages=1)
    args, _ = bwd._example_args("ssd_bwd_dc_dcb", small, "cpu")
    tuning.clear_caches()  # the warning is given once per process
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fit = tuning.fit_block_sizes(dx.bind(tuple(args)), cfg)
    assert fit.config["block_sizes"] == [64] and fit.config["num_warps"] == 8
    assert any("exceed" in str(x.message) for x in w)
    args, _ = bwd._example_args("ssd_bwd_dc_dcb", nano, "cpu")
    assert tuning.fit_block_sizes(dx.bind(tuple(args)), cfg) is cfg
    # a config without block sizes, or with fewer than the kernel has, is left alone
    bare = helion.Config(num_warps=4)
    assert tuning.fit_block_sizes(dx.bind(tuple(args)), bare) is bare


def test_fast_launcher_reuses_the_binary_only_for_the_same_launch_key(monkeypatch):
    """FastLauncher: the first call goes through Helion's launcher and keeps the CompiledKernel it returns;
    calls with the same launch key (each tensor's address modulo 16, exact other values) call that
    binary's launcher with JITFunction.run's arguments; another alignment, scalar value, JIT function or
    an extra launcher keyword goes through Helion's launcher again."""
    import types

    import helion.runtime

    slow, runs = [], []

    class FakeCompiled:
        function, packed_metadata = "fn", "meta"
        src = types.SimpleNamespace(fn=types.SimpleNamespace(arg_names=["x", "y", "n", "eps"]))

        def run(self, *a):
            runs.append(a)

        def launch_metadata(self, grid, stream, *args):
            return ("metadata", grid)

    compiled_kernel = FakeCompiled()

    def fake_default(jit, grid, *args, num_warps, num_stages, **kw):
        slow.append((jit, grid, args, kw))
        return compiled_kernel

    monkeypatch.setattr(helion.runtime, "default_launcher", fake_default)
    monkeypatch.setattr(tuning, "_current_stream", lambda: 7)
    monkeypatch.setattr(tuning, "_launch_hooks", lambda: (None, None))
    jit = object()
    buf = torch.zeros(64)
    x, y = buf[:16], buf[16:32]  # both 16-byte aligned (offset 64 bytes)
    fl = tuning.FastLauncher()
    assert fl(jit, (4,), x, y, 3, 1e-5, num_warps=4, num_stages=1) is compiled_kernel
    assert len(slow) == 1 and not runs
    fl(jit, (4, 2), x, y, 3, 1e-5, num_warps=4, num_stages=1)
    assert len(slow) == 1 and runs == [(4, 2, 1, 7, "fn", "meta", None, None, None, x, y, 3, 1e-5)]
    fl(jit, (4,), buf[1:17], y, 3, 1e-5, num_warps=4, num_stages=1)  # 4-byte offset: not 16-byte aligned
    fl(jit, (4,), x, y, 4, 1e-5, num_warps=4, num_stages=1)  # another int
    fl(object(), (4,), x, y, 4, 1e-5, num_warps=4, num_stages=1)  # another JIT function
    fl(jit, (4,), x, y, 4, 1e-5, num_warps=4, num_stages=1, launch_cooperative_grid=True)
    assert len(slow) == 5 and len(runs) == 1 and (fl.n_fast, fl.n_slow) == (1, 5)
    # with a launch-enter hook set, the binary gets Triton's launch metadata and the hooks
    monkeypatch.setattr(tuning, "_launch_hooks", lambda: ("enter", "exit"))
    for _ in range(2):  # the keyword call above dropped the kept binary: Helion's launcher first, then the binary
        fl(jit, (4,), x, y, 4, 1e-5, num_warps=4, num_stages=1)
    assert runs[-1][6:9] == (("metadata", (4,)), "enter", "exit") and (fl.n_fast, fl.n_slow) == (2, 6)
    # a kernel whose binary takes other arguments than passed (defaults) never takes the fast path
    compiled_kernel.src = types.SimpleNamespace(fn=types.SimpleNamespace(arg_names=["x", "y", "n", "eps", "extra"]))
    fl2 = tuning.FastLauncher()
    for _ in range(3):
        fl2(jit, (4,), x, y, 3, 1e-5, num_warps=4, num_stages=1)
    assert fl2.n_fast == 0 and fl2.n_slow == 3


def test_fast_launch_is_on_by_default():
    assert tuning.runtime().settings.fast_launch and HelionSettings().fast_launch


def test_fast_launch_switch_wraps_compiled_kernels(monkeypatch):
    calls = []

    class FakeBound:
        config_spec = None

        def compile_config(self, cfg, allow_print=False):
            def fn(*a, _launcher=None):
                calls.append(_launcher)
            return fn

    class FakeKernel:
        def bind(self, args):
            return FakeBound()

    tuning.clear_caches()
    assert not tuning.launches_on_cuda((torch.zeros(2), 3))  # CPU tensors never take Triton's CUDA launcher
    monkeypatch.setattr(tuning, "launches_on_cuda", lambda args: True)
    slow, fast = tuning.runtime_for(HelionSettings(fast_launch=False)), tuning.runtime_for(HelionSettings())
    tuning.compiled(FakeKernel(), (torch.zeros(2),), helion.Config(num_warps=4), rt=slow)()
    with tuning.use(HelionSettings()):  # the active runtime's setting applies
        tuning.compiled(FakeKernel(), (torch.zeros(2),), helion.Config(num_warps=4))()
    assert calls[0] is None and isinstance(calls[1], tuning.FastLauncher)
    assert len(slow.compiled) == 1 and len(fast.compiled) == 1  # each runtime keeps its own compiled kernels
    # the launch key leaves dtypes and devices to the argument signature: each gets its own compiled kernel and launcher
    k, cfg = FakeKernel(), helion.Config(num_warps=4)
    f32 = tuning.compiled(k, (torch.zeros(2),), cfg, rt=fast)
    f64 = tuning.compiled(k, (torch.zeros(2, dtype=torch.float64),), cfg, rt=fast)
    meta = tuning.compiled(k, (torch.zeros(2, device="meta"),), cfg, rt=fast)
    assert tuning.compiled(k, (torch.ones(2),), cfg, rt=fast) is f32
    launchers = [f.keywords["_launcher"] for f in (f32, f64, meta)]
    assert len({id(f) for f in (f32, f64, meta)}) == 3 and len({id(fl) for fl in launchers}) == 3
    tuning.clear_caches()


def test_timer_name_from_env(monkeypatch):
    tu = tuner

    monkeypatch.delenv("NANO_TUNE_TIMER", raising=False)
    assert tu.timer_name() == "events"
    monkeypatch.setenv("NANO_TUNE_TIMER", "cudagraph")
    assert tu.timer_name() == "cudagraph"
    monkeypatch.setenv("NANO_TUNE_TIMER", "wallclock")
    with pytest.raises(ValueError, match="unknown timer"):
        tu.timer_name()


# ----------------------------------------------------------------------------------------------- recipe shapes
def helion_kernel_dims(b: int, l: int, h: int, p: int, g: int, n: int, c: int, w: int = 4) -> dict[str, dict]:
    """{kernel: shape-key dims} of every Helion kernel a bf16 training step runs for a Mamba mixer with these dims
    (b, l: micro-batch and sequence length per rank; h, g: heads and groups per tensor-parallel rank), as the
    wrappers compute them (no seq_idx)."""
    from kernels.ssd_helion_bwd import _state_split

    L = -(-l // c) * c
    ssd = dict(b=b, l=L, h=h, p=p, g=g, n=n, c=c)
    conv = dict(b=b, l=l, d=h * p + 2 * g * n, w=w, cl=1, seq=0, act=1, dt="bfloat16")
    norm = dict(m=b * l, g=g, gs=h * p // g, z=False, nbg=False, dt="bfloat16")
    dims = {"conv1d_fwd": conv, "conv1d_bwd": conv, "rmsnorm_fwd": norm, "rmsnorm_bwd": norm,
            "ssd_chunk_cumsum": dict(b=b, l=l, h=h, c=c), "ssd_bmm_chunk": dict(b=b, l=L, g=g, n=n, c=c),
            "ssd_bwd_state_passing": dict(ssd, blk=_state_split(p * n))}
    for k in ("ssd_chunk_state_passing", "ssd_chunk_scan_cb16", "ssd_bwd_dz_dstates", "ssd_bwd_dx", "ssd_bwd_dc_dcb",
              "ssd_bwd_db", "ssd_bwd_dt"):
        dims[k] = ssd
    return dims


def recipe_mixer_shapes() -> dict[str, tuple]:
    """{recipe: (b, l, h, p, g, n, c, w)} of the mixer each GPU recipe (train.device=cuda) runs, per rank; a recipe
    that tunes on first use (kernels.helion.autotune=true) needs no committed configs and is left out."""
    from nano_hybrid.config import compose, list_recipes
    from nano_hybrid.model.config import mixer_dims

    out = {}
    for name in list_recipes():
        cfg = compose([f"recipe={name}"])
        if str(cfg.train.device) != "cuda" or bool(cfg.kernels.helion.autotune):
            continue
        out[name] = tuple(mixer_dims(cfg)[k] for k in ("b", "l", "h", "p", "g", "n", "c", "w"))
    return out


def test_kernel_dims_match_the_committed_nano_keys():
    """helion_kernel_dims at the Nano bench shape gives the keys the committed configs are tuned at (the wrappers'
    keys, listed in NANO_COMMITTED), for every kernel of a bf16 step."""
    got = helion_kernel_dims(2, 8192, 64, 64, 8, 128, 128)
    assert set(got) <= set(NANO_COMMITTED)
    for k, d in got.items():
        assert tuning.shape_key(**d) == tuning.shape_key(**NANO_COMMITTED[k]), k


# A recipe with a new shape needs its configs first (on its GPU): python scripts/tune_kernels.py --shapes <preset>
def test_recipe_shapes_are_tuned():
    """Every (kernel, shape) a GPU recipe runs has an exact sm90 entry: a new recipe shape without configs fails."""
    shapes = recipe_mixer_shapes()
    assert "nano30b_slice_h200" in shapes and shapes["nano30b_slice_h200"][:2] == (1, 8192)
    missing = [f"{recipe}: {kernel} at {tuning.shape_key(**dims)}"
               for recipe, md in sorted(shapes.items())
               for kernel, dims in sorted(helion_kernel_dims(*md).items())
               if tuning.lookup(kernel, dims, arch="sm90")[0] != "exact"]
    assert not missing, "no tuned sm90 config for:\n" + "\n".join(missing)
    # the Nano shape every benchmark measures is tuned for every kernel
    nano = tuner.SHAPE_PRESETS["nano"]
    md = tuple(nano[k] for k in ("b", "l", "h", "p", "g", "n", "c", "w"))
    assert all(tuning.lookup(k, d, arch="sm90")[0] == "exact" for k, d in helion_kernel_dims(*md).items())


def test_shape_presets_cover_the_recipe_shapes():
    """scripts/tune_kernels.py tunes by preset name: every GPU recipe's mixer shape is a preset."""
    presets = {(d["b"], d["l"], d["h"], d["p"], d["g"], d["n"], d["c"], d["w"]) for d in tuner.SHAPE_PRESETS.values()}
    assert set(recipe_mixer_shapes().values()) <= presets, set(recipe_mixer_shapes().values()) - presets


def test_tuner_copies_arguments_with_their_strides_and_passes_broadcast_views():
    """First-use tuning runs on copies of the call's tensors; an expanded view (elements sharing memory, as the
    mixer's broadcast D and dt_bias arguments can be) cannot be copied with its strides and is passed as it is."""
    from kernels.tuner import _copy_arg

    base = torch.randn(4, 1)
    expanded = base.expand(4, 8)
    assert _copy_arg(expanded) is expanded
    strided = torch.randn(4, 8)[:, ::2]
    copy = _copy_arg(strided)
    assert copy is not strided and copy.data_ptr() != strided.data_ptr()
    assert copy.stride() == strided.stride() and torch.equal(copy, strided)
    assert _copy_arg(3) == 3 and _copy_arg(None) is None


def test_tune_kernels_missing_names_the_kernels_without_an_exact_config(tmp_path, monkeypatch):
    """``tune_kernels.py --missing``: with committed files that hold every kernel at the nano_proxy shape but five
    SSD backward kernels, those five are what is missing there, in the kernels' order; a user-cache root with an
    entry for one of them takes it off the list; with the Nano shape beside it (nothing committed), every kernel is
    missing there, after the proxy's pairs."""
    from nano_hybrid.kernel_search import missing_kernels, missing_pairs

    registry = tuner.discover_tunable_kernels()
    proxy, nano = dict(tuner.SHAPE_PRESETS["nano_proxy"]), dict(tuner.SHAPE_PRESETS["nano"])
    removed = ["ssd_bwd_db", "ssd_bwd_dc_dcb", "ssd_bwd_dt", "ssd_bwd_dx", "ssd_bwd_state_passing"]

    def write(root, names):
        for name in names:
            dims = registry[name][1].dims(dict(proxy))
            tuning.record(name, dims, dict(num_warps=4), 0.1, arch="sm90", root=root)

    write(tmp_path / "committed", [n for n in sorted(registry) if n not in removed])
    monkeypatch.setattr(tuning, "CONFIG_ROOT", tmp_path / "committed")
    tuning.clear_caches()
    shapes = {"proxy": proxy}
    assert missing_kernels(registry, sorted(registry), shapes, None, arch="sm90") == removed
    write(tmp_path / "cache", ["ssd_bwd_dx"])
    assert missing_kernels(registry, sorted(registry), shapes, tmp_path / "cache", arch="sm90") == [
        n for n in removed if n != "ssd_bwd_dx"]
    assert missing_kernels(registry, ["conv1d_fwd", "ssd_bwd_dx"], shapes, Path("/nonexistent-root"),
                           arch="sm90") == ["ssd_bwd_dx"]
    shapes["nano"] = nano
    assert missing_pairs(registry, sorted(registry), shapes, None, arch="sm90") == [
        *((n, "proxy") for n in removed), *((n, "nano") for n in sorted(registry))]


@pytest.mark.parametrize("md", [
    dict(b=1, l=64, h=4, p=16, g=2, n=16, c=32, w=4),  # whole chunks
    dict(b=2, l=70, h=3, p=8, g=1, n=8, c=32, w=3),  # a partial last chunk, 1 group, conv width 3
    dict(b=1, l=5, h=2, p=8, g=2, n=16, c=16, w=4),  # shorter than one chunk
], ids=["whole", "partial", "short"])
def test_tunable_kernel_dims_equal_the_dims_of_its_built_case(md, monkeypatch):
    """``TunableKernel.dims`` (what ``missing_pairs`` reads, without building anything) is the kernel dims of the case
    the search builds, for every tunable kernel: a pair found missing is the pair the search tunes and stores."""
    monkeypatch.setenv("HELION_INTERPRET", "1")  # the cases are built on the CPU
    for name, (_, tk) in sorted(tuner.discover_tunable_kernels().items()):
        assert tk.dims(dict(md)) == tk(dict(md), "cpu").dims, name


def test_missing_pairs_builds_no_case(monkeypatch):
    """Finding the pairs without a config of the whole grid builds no search case (a case allocates its inputs, and
    an SSD forward case runs the kernels before it on the GPU)."""
    from nano_hybrid.bench.mixer import GRID
    from nano_hybrid.kernel_search import missing_pairs

    registry = {name: (mod, tuner.TunableKernel(lambda *a: pytest.fail("a case was built"), tk.dims))
                for name, (mod, tk) in tuner.discover_tunable_kernels().items()}
    shapes = {k: dict(b=s.batch, l=s.seqlen, h=s.nheads, p=s.headdim, g=s.ngroups, n=s.d_state, c=s.chunk_size,
                      w=s.d_conv) for k, (s, docs) in GRID.items() if docs == 1}
    got = missing_pairs(registry, sorted(registry), shapes, None, arch="sm90")
    want, entries = [], set()
    for shape, md in shapes.items():
        for name in sorted(registry):
            dims = registry[name][1].dims(dict(md))
            # one pair per config entry: a kernel whose dims two shapes share (rmsnorm_bwd at chunk 128 and 256) once
            if tuning.lookup(name, dims, arch="sm90")[0] != "exact" and (name, tuning.shape_key(**dims)) not in entries:
                entries.add((name, tuning.shape_key(**dims)))
                want.append((name, shape))
    assert got == want
    assert ("ssd_bwd_dx", "nano_b2_l8192") not in got


def test_a_config_file_that_cannot_be_used_is_one_error_naming_it(tmp_path, monkeypatch):
    """Config files are checked as they are read: not JSON, no entries, an entry without dims and config are each a
    ConfigFileError naming the file, with "delete it" for a user-cache file and "restore it from git" for a
    committed one; ``check_config_files`` reads every kernel file of the roots (not the first-use failure records)
    and a lookup of a bad file raises the same error."""
    arch = tmp_path / "cache" / "sm90"
    arch.mkdir(parents=True)
    good = {"kernel": "conv1d_fwd", "entries": {"k": {"dims": {"b": 1}, "config": {"num_warps": 4}}}}
    (arch / "conv1d_fwd.json").write_text(json.dumps(good))
    (arch / "conv1d_fwd.failed.json").write_text(json.dumps({"failures": {}}))
    assert tuning.check_config_files([tmp_path / "cache", tmp_path / "absent"]) == 1
    for text, what in (("{not json", "JSONDecodeError"), ("[]", "no 'entries' object"),
                       (json.dumps({"entries": {"k": {"dims": {}}}}), "entry 'k' has no 'dims' and 'config'")):
        (arch / "rmsnorm_fwd.json").write_text(text)
        with pytest.raises(tuning.ConfigFileError, match="delete it") as e:
            tuning.check_config_files([tmp_path / "cache"])
        assert str(arch / "rmsnorm_fwd.json") in str(e.value) and what in str(e.value)
        assert "\n" not in str(e.value)
    tuning.clear_caches()
    with pytest.raises(tuning.ConfigFileError, match="rmsnorm_fwd.json"):
        tuning.lookup("rmsnorm_fwd", {"m": 8}, arch="sm90", root=tmp_path / "cache")
    tuning.clear_caches()
    monkeypatch.setattr(tuning, "CONFIG_ROOT", (tmp_path / "cache").resolve())  # the same file, as a committed one
    with pytest.raises(tuning.ConfigFileError, match="restore it from git"):
        tuning.read_config_file(arch / "rmsnorm_fwd.json")


def test_dtype_markers_and_read_only_zeros_are_made_once_per_key():
    """tuning.dtype_marker / zeros_input: one tensor per (shape,) dtype and device for the process (later calls get
    the same tensor); another dtype or shape gets its own; clear_caches forgets them."""
    tuning.clear_caches()
    m = tuning.dtype_marker(torch.bfloat16, torch.device("cpu"))
    assert m.numel() == 0 and m.dtype == torch.bfloat16
    assert tuning.dtype_marker(torch.bfloat16, "cpu") is m
    assert tuning.dtype_marker(torch.float32, "cpu") is not m
    z = tuning.zeros_input((2, 3), torch.float32, "cpu")
    assert torch.equal(z, torch.zeros(2, 3)) and tuning.zeros_input([2, 3], torch.float32, torch.device("cpu")) is z
    assert tuning.zeros_input((3, 2), torch.float32, "cpu").shape == (3, 2)
    tuning.clear_caches()
    assert tuning.dtype_marker(torch.bfloat16, "cpu") is not m
    assert tuning.zeros_input((2, 3), torch.float32, "cpu") is not z
