"""kernels.first_use: the first-use search in a child process (killed when it overruns its budget plus margin), the
one warning and the fallback config when it gives none, the failure record of a run, and the module layering.

The calls are rmsnorm_fwd's, with the kernel as it runs on a GPU (compiled mode, bound on CPU tensors) and the arch
forced to sm90; ``first_use.isolates`` is made true, so CPU tensors are searched in a child as CUDA ones are. The
child's search is the real ``tuner.tune_call`` (which needs a GPU: it fails here) or, through
tests/first_use_child.py, a test search that returns a config or hangs."""

from __future__ import annotations

import ast
import json
import os
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import helion
from kernels import first_use, tuning
from kernels import rmsnorm_gated_helion as R
from kernels.settings import HelionSettings

TESTS = Path(__file__).resolve().parent
M, G, D = 64, 2, 16
KEY = tuning.shape_key(**R._norm_dims(M, G, D, False, False, torch.bfloat16))
NEAR = {"block_sizes": [2], "num_warps": 2}  # the committed config of the nearest tuned shape (m128)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    tuning.clear_caches()
    monkeypatch.delenv("HELION_INTERPRET", raising=False)  # the kernels of these tests are compiled-mode ones
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(first_use, "isolates", lambda args: True)
    tuning.record("rmsnorm_fwd", R._norm_dims(2 * M, G, D, False, False, torch.bfloat16), NEAR, 0.1, arch="sm90",
                  root=tmp_path / "committed")
    yield
    tuning.clear_caches()


def _select(tmp_path, budget_s):
    """rmsnorm_fwd's config at (64, 2, 16) with autotune on, as a fresh process chooses it."""
    tuning.clear_caches()
    kernel = helion.kernel(R.rmsnorm_gated_fwd_kernel.fn, static_shapes=True,
                           ignore_warnings=list(R.rmsnorm_gated_fwd_kernel.settings.ignore_warnings))
    x = torch.randn(M, G, D, dtype=torch.bfloat16)
    args = (x, torch.ones(G, D, dtype=torch.bfloat16), x, 1e-5, False, False)
    rt = tuning.Runtime(HelionSettings(autotune=True, autotune_budget_s=budget_s, cache_dir=str(tmp_path / "cache")))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cfg, how = first_use.select_config("rmsnorm_fwd", kernel, args, R._norm_dims(M, G, D, False, False, torch.bfloat16),
                                           R.RMSNORM_FWD_DEFAULT, arch="sm90", root=tmp_path / "committed", rt=rt)
    return cfg, how, [str(m.message) for m in w]


def _test_child(monkeypatch, search: str):
    monkeypatch.setenv("NANO_HYBRID_TEST_FIRST_USE_SEARCH", search)
    monkeypatch.setattr(first_use, "child_command", lambda p: [sys.executable, str(TESTS / "first_use_child.py"), str(p)])


def _no_child(monkeypatch):
    monkeypatch.setattr(first_use, "child_command", lambda p: pytest.fail("a child process was started"))


def _failures(tmp_path) -> dict:
    return json.loads((tmp_path / "cache" / "sm90" / "rmsnorm_fwd.failed.json").read_text())["failures"]


def _first_use_warnings(msgs):
    return [m for m in msgs if "first-use tuning of rmsnorm_fwd" in m]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a killed process not yet reaped by its new parent is a zombie


def test_the_child_records_its_winner_and_the_parent_uses_it(tmp_path, monkeypatch):
    _test_child(monkeypatch, "ok")
    cfg, how, msgs = _select(tmp_path, budget_s=60)
    assert how == "tuned" and cfg.config["num_warps"] == 1, msgs
    assert any(f"tuned rmsnorm_fwd at {KEY}" in m and "stored in" in m for m in msgs)
    assert not _first_use_warnings(msgs)
    entry = json.loads((tmp_path / "cache" / "sm90" / "rmsnorm_fwd.json").read_text())["entries"][KEY]
    assert entry["config"]["num_warps"] == 1
    assert entry["meta"] == {"how": "test search", "budget_s": 60.0, "process": "child"}
    assert not list((tmp_path / "cache" / "sm90" / "first_use").iterdir())  # payload, log and result removed
    _no_child(monkeypatch)  # a later process reads the entry
    cfg, how, _ = _select(tmp_path, budget_s=60)
    assert how == "cache" and cfg.config["num_warps"] == 1


def test_an_overrunning_child_is_killed_and_the_run_goes_on_with_the_nearest_config(tmp_path, monkeypatch):
    budget, margin = 5.0, 40.0  # the margin covers this machine's child start (imports, the registry case: ~15 s)
    monkeypatch.setattr(first_use, "SEARCH_MARGIN_S", margin)
    pids = tmp_path / "pids"
    monkeypatch.setenv("NANO_HYBRID_TEST_FIRST_USE_PIDS", str(pids))
    _test_child(monkeypatch, "hang")
    t0 = time.monotonic()
    cfg, how, msgs = _select(tmp_path, budget_s=budget)
    took = time.monotonic() - t0
    assert budget + margin - 1 <= took < budget + margin + 20
    assert how == "nearest" and cfg.config["block_sizes"] == [2] and cfg.config["num_warps"] == 2
    one, = _first_use_warnings(msgs)
    assert f"first-use tuning of rmsnorm_fwd at {KEY} failed: overran its budget (5 s + 40 s" in one
    assert "killed after" in one and "using the nearest tuned shape m128" in one and "\n" not in one
    assert "`python scripts/tune_kernels.py <the run's overrides> --missing`" in one
    assert not [m for m in msgs if "no tuned sm90 config for rmsnorm_fwd" in m]  # the one warning says it all
    child, sleeper = map(int, pids.read_text().split())
    assert not _alive(child) and not _alive(sleeper)  # the child's process group is killed
    failure = _failures(tmp_path)[KEY]
    assert failure["run"] == first_use.run_id() and "overran its budget" in failure["what"]

    # another process of this run (a rank that waited on the lock) does not search again
    _no_child(monkeypatch)
    cfg, how, msgs = _select(tmp_path, budget_s=budget)
    assert how == "nearest" and cfg.config["num_warps"] == 2
    one, = _first_use_warnings(msgs)
    assert "failed earlier in this run (overran its budget" in one and "not searched again in this run" in one
    assert "--missing" in one

    # a later run searches again (here its child exits with an error: the record then names that run)
    starts = []
    monkeypatch.setattr(first_use, "run_id", lambda: "a later run")
    monkeypatch.setattr(first_use, "child_command",
                        lambda p: starts.append(p) or [sys.executable, "-c", "import sys; sys.exit(3)"])
    cfg, how, msgs = _select(tmp_path, budget_s=budget)
    assert len(starts) == 1 and how == "nearest"
    one, = _first_use_warnings(msgs)
    assert "failed: the child process failed (exit 3)" in one and "(log: " in one
    assert _failures(tmp_path)[KEY]["run"] == "a later run"


def test_the_real_search_failing_in_its_child_gives_one_warning_and_the_fallback(tmp_path):
    """The product's child command and ``tuner.tune_call``: on this CPU machine the search refuses to run (no CUDA);
    the parent says so once, with the child's log, and goes on with the nearest config."""
    t0 = time.monotonic()
    cfg, how, msgs = _select(tmp_path, budget_s=5)
    assert time.monotonic() - t0 < 5 + first_use.SEARCH_MARGIN_S
    assert how == "nearest" and cfg.config["num_warps"] == 2
    one, = _first_use_warnings(msgs)
    assert "failed: the child process failed (exit 1)" in one and "needs a CUDA GPU" in one, one
    log = Path(one.split("(log: ")[1].split(")")[0])
    assert "RuntimeError: tuning.search needs a CUDA GPU" in log.read_text()
    assert "needs a CUDA GPU" in _failures(tmp_path)[KEY]["what"]
    assert not list(log.parent.glob("*.pt"))  # the call's arguments are not left behind


def test_a_call_that_cannot_reach_a_child_falls_back_with_one_warning(tmp_path, monkeypatch):
    """A finalize that is no module-level function does not pickle: no child starts, the failure is said and
    recorded."""
    _no_child(monkeypatch)
    tuning.clear_caches()
    kernel = helion.kernel(R.rmsnorm_gated_fwd_kernel.fn, static_shapes=True)
    x = torch.randn(M, G, D, dtype=torch.bfloat16)
    args = (x, torch.ones(G, D, dtype=torch.bfloat16), x, 1e-5, False, False)
    rt = tuning.Runtime(HelionSettings(autotune=True, autotune_budget_s=5, cache_dir=str(tmp_path / "cache")))
    with pytest.warns(UserWarning, match=r"first-use tuning of rmsnorm_fwd at .* failed: the call could not be "
                                         r"handed to a child process .*; using the nearest tuned shape m128"):
        cfg, how = first_use.select_config("rmsnorm_fwd", kernel, args, R._norm_dims(M, G, D, False, False, torch.bfloat16),
                                           R.RMSNORM_FWD_DEFAULT, arch="sm90", root=tmp_path / "committed", rt=rt,
                                           finalize=lambda out, a: out)
    assert how == "nearest" and "could not be handed" in _failures(tmp_path)[KEY]["what"]


def test_run_id_names_the_launch(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    assert first_use.run_id() == "torchelastic:job42"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without --rdzv-id: the agent process names it
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert first_use.run_id().split(":")[1] == str(os.getppid())
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.delenv("LOCAL_RANK")
    host, pid, start = first_use.run_id().split(":")
    assert pid == str(os.getpid()) and start.isdigit()


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update([node.module] + [f"{node.module}.{a.name}" for a in node.names])
    return names


def test_layering_store_below_search_below_first_use():
    """kernels.tuning imports neither the search, the compile cache nor first_use, kernels.tuner and
    kernels.compile_cache not first_use (anywhere in the file, function-level imports too); nothing in kernels/
    imports nano_hybrid or megatron."""
    root = TESTS.parent / "kernels"
    assert not {"kernels.tuner", "kernels.first_use", "kernels.compile_cache"} & _imports(root / "tuning.py")
    assert "kernels.first_use" not in _imports(root / "tuner.py")
    assert not {"kernels.first_use", "kernels.tuner"} & _imports(root / "compile_cache.py")
    for f in root.glob("*.py"):
        assert not [n for n in _imports(f) if n.split(".")[0] in ("nano_hybrid", "megatron")], f


def test_an_unreadable_failure_record_is_taken_as_empty_and_replaced(tmp_path, monkeypatch):
    """A first-use failure record that cannot be read (a truncated file) does not stop the call: it counts as empty
    with one warning naming it, the search runs, and the failure it ends in replaces the file."""
    bad = tmp_path / "cache" / "sm90" / "rmsnorm_fwd.failed.json"
    bad.parent.mkdir(parents=True)
    bad.write_text('{"kernel": "rmsnorm_fwd", "failures": {"m6')
    monkeypatch.setattr(first_use, "child_command", lambda p: [sys.executable, "-c", "import sys; sys.exit(3)"])
    cfg, how, msgs = _select(tmp_path, budget_s=5)
    assert how == "nearest" and cfg.config["num_warps"] == 2
    said = [m for m in msgs if "failure record" in m]
    assert len(said) == 1 and str(bad) in said[0] and "JSONDecodeError" in said[0] and "taken as empty" in said[0]
    assert "the child process failed (exit 3)" in _failures(tmp_path)[KEY]["what"]
