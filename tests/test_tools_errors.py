"""Bad input to the command-line tools (scripts/*.py): each stops with one ``error:`` line and exit code 2
before any work (training, measuring, writing), and leaves what is already saved as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from nano_hybrid.errors import EXIT_BAD_INPUT


def _tree(d: Path) -> dict[str, bytes | None]:
    """Every path under ``d`` with the bytes of each file (None for a directory)."""
    return {p.relative_to(d).as_posix(): (p.read_bytes() if p.is_file() else None) for p in sorted(d.rglob("*"))}


def _one_error(capsys, rc: int, *needles: str) -> str:
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and "warn" not in x.lower()]
    assert rc == EXIT_BAD_INPUT and len(err) == 1 and err[0].startswith("error: "), (rc, err)
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


@pytest.fixture
def saved(tmp_path) -> Path:
    """A folder with a file in it, and a regular file beside it (``saved / "file"``): output the tools must keep."""
    d = tmp_path / "saved"
    d.mkdir()
    (d / "kept.txt").write_text("kept\n")
    (d / "file").write_text("kept too\n")
    return d


# ----------------------------------------------------------------------------------- HF export and hf_check
@pytest.mark.parametrize("where", ["folder", "file", "under_file"])
def test_hf_check_refuses_out_before_training(saved, capsys, monkeypatch, where):
    from nano_hybrid.bench import hf_check, training

    monkeypatch.setattr(training, "setup", lambda *a, **k: pytest.fail("trained before checking --out"))
    out = {"folder": saved, "file": saved / "file", "under_file": saved / "file" / "x"}[where]
    before = _tree(saved)
    rc = hf_check.main(["--steps", "2", "--out", str(out), "model=tiny", "train.device=cpu"])
    _one_error(capsys, rc, "--out", str(out))
    assert _tree(saved) == before


@pytest.mark.parametrize("where", ["file", "under_file", "folder"])
def test_export_hf_refuses_out_that_is_a_file_or_not_empty(saved, capsys, where):
    from nano_hybrid import export_hf

    out = {"folder": saved, "file": saved / "file", "under_file": saved / "file" / "x"}[where]
    before = _tree(saved)
    rc = export_hf.main([str(saved.parent / "no_checkpoint"), str(out)])
    _one_error(capsys, rc, str(out))
    assert _tree(saved) == before


# ----------------------------------------------------------------------------------- run_summary.py
@pytest.mark.parametrize("metrics, needle", [(None, "no metrics file"), ("", "holds no records"),
                                             ("step 1 loss 2.0\n", "not a JSON line"),
                                             ('{"loss": 2.0}\n', "without a step number")])
def test_run_summary_bad_metrics_is_one_line(tmp_path, capsys, metrics, needle):
    from nano_hybrid.bench import run_summary

    run = tmp_path / "run"
    run.mkdir()
    if metrics is not None:
        (run / "metrics.jsonl").write_text(metrics)
    out = tmp_path / "summary.json"
    _one_error(capsys, run_summary.main([str(run), "--out", str(out)]), needle)
    assert not out.exists()
    good = tmp_path / "good"
    good.mkdir()
    (good / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    _one_error(capsys, run_summary.main([str(good), "--ref", str(run), "--out", str(out)]), needle)
    assert not out.exists()


# ----------------------------------------------------------------------------------- benchmark tools
def _unavailable(name, *args, **kwargs):
    from kernels.registry import BackendUnavailableError

    raise BackendUnavailableError(f"kernel backend {name!r} needs a CUDA GPU; use kernels.backend=torch on CPU")


@pytest.mark.parametrize("tool", ["bench_shape_grid", "bench_ssd_bwd"])
def test_bench_tools_refuse_an_unavailable_backend_before_measuring(tmp_path, capsys, monkeypatch, tool):
    import kernels.registry
    from nano_hybrid.bench import bench_kernels, bench_shape_grid, bench_ssd_bwd

    monkeypatch.setattr(kernels.registry, "get_backend", _unavailable)
    monkeypatch.setattr(bench_kernels, "run", lambda *a: pytest.fail("measured with an unavailable backend"))
    monkeypatch.setattr(bench_shape_grid, "run", lambda *a: pytest.fail("measured with an unavailable backend"))
    main = {"bench_shape_grid": lambda argv: bench_shape_grid.main(["--quick", *argv]),
            "bench_ssd_bwd": bench_ssd_bwd.main}[tool]
    out = tmp_path / "out"
    _one_error(capsys, main(["--out", str(out)]), "needs a CUDA GPU")
    assert not out.exists()


@pytest.mark.parametrize("tool", ["tune_kernels", "bench_norm_conv", "bench_ssd_fwd"])
def test_gpu_only_tools_say_error_on_a_cpu(capsys, monkeypatch, tool):
    import importlib

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    mod = importlib.import_module(f"nano_hybrid.bench.{tool}")
    _one_error(capsys, mod.main([]), f"{tool}.py needs a CUDA GPU")


@pytest.mark.parametrize("tool", ["ab_step_time", "bench_shape_grid", "bench_ssd_bwd", "bench_kernels"])
@pytest.mark.parametrize("where", ["file", "under_file", "env"])
def test_bench_tools_refuse_out_that_is_a_file_before_measuring(saved, capsys, monkeypatch, tool, where):
    from nano_hybrid.bench import ab_step_time, bench_kernels, bench_shape_grid, bench_ssd_bwd

    for mod in (ab_step_time, bench_kernels, bench_shape_grid):
        monkeypatch.setattr(mod, "run", lambda *a: pytest.fail("measured before checking --out"))
    out = saved / "file" / "x" if where == "under_file" else saved / "file"
    argv = {"ab_step_time": ["--backends", "torch,torch"], "bench_shape_grid": ["--baseline", "torch"],
            "bench_ssd_bwd": [], "bench_kernels": ["--backend", "torch"]}[tool]
    if where == "env":
        monkeypatch.setenv("OUT", str(out))
    else:
        argv += ["--out", str(out)]
    main = {"ab_step_time": ab_step_time.main, "bench_shape_grid": bench_shape_grid.main,
            "bench_ssd_bwd": bench_ssd_bwd.main, "bench_kernels": bench_kernels.main}[tool]
    before = _tree(saved)
    _one_error(capsys, main(argv), "$OUT" if where == "env" else "--out",
               "is a file, not a folder" if where == "under_file" else "is an existing file")
    assert _tree(saved) == before


def test_ab_step_time_refuses_n_boot_below_100_before_measuring(tmp_path, capsys, monkeypatch):
    from nano_hybrid.bench import ab_step_time

    monkeypatch.setattr(ab_step_time, "run", lambda *a: pytest.fail("measured before checking --n-boot"))
    _one_error(capsys, ab_step_time.main(["--backends", "torch,torch", "--n-boot", "0", "--out", str(tmp_path)]),
               "--n-boot must be >= 100")
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------------- prepare_tokenizer.py
@pytest.mark.parametrize("content", [b"not json\n", b"\xff\xfe\x00binary", b'{"config": {}, "vocab": 3}'])
def test_prepare_tokenizer_refuses_a_source_that_is_not_a_tekken_json(saved, capsys, content):
    from nano_hybrid.tools import prepare_tokenizer

    src = saved.parent / "source.json"
    src.write_bytes(content)
    before = _tree(saved)
    _one_error(capsys, prepare_tokenizer.main(["--source", str(src), "--output", str(saved / "file")]), str(src))
    assert _tree(saved) == before


# ----------------------------------------------------------------------------------- prepare_data.py
@pytest.mark.parametrize("where, needle", [("under_file", "is a file, not a folder"),
                                           ("under_file_deeper", "is a file, not a folder"),
                                           ("trailing_sep", "not a folder"), ("folder", "not a folder"),
                                           ("proc", "cannot write in /proc")])
def test_prepare_data_refuses_an_output_it_cannot_write_before_tokenizing(saved, capsys, monkeypatch, where, needle):
    import os

    from nano_hybrid.tools import prepare_data

    if where == "proc" and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    monkeypatch.setattr(prepare_data, "write_indexed_dataset", lambda *a, **k: pytest.fail("tokenized"))
    src = saved.parent / "in.txt"
    src.write_text("some text\n")
    out = {"under_file": f"{saved}/file/x", "under_file_deeper": f"{saved}/file/x/y", "trailing_sep": f"{saved}/",
           "folder": str(saved), "proc": "/proc/nano_hybrid_x"}[where]
    before = _tree(saved.parent)
    _one_error(capsys, prepare_data.main(["--input", str(src), "--output", out, "--no-progress"]), "--output", needle)
    assert _tree(saved.parent) == before


@pytest.mark.parametrize("committed_status,written", [("skipped_budget", False), ("ok", True), ("mismatch", True)])
def test_tune_kernels_replaces_a_committed_config_only_after_timing_it(monkeypatch, committed_status, written):
    """A search whose budget ends before the shape's committed config had its turn never compared its winner with
    it: the config file keeps the committed entry."""
    import argparse
    import types

    from nano_hybrid.bench import tune_kernels as tk

    committed = {"block_sizes": [64], "num_warps": 4}
    spec_default = {"block_sizes": [16], "num_warps": 4}

    def candidates(args, case, name, run):
        run["committed_config"] = committed
        return [spec_default, committed]

    results = [{"config": spec_default, "status": "ok", "time_ms": 2.0},
               {"config": committed, "status": committed_status, "time_ms": 1.0 if committed_status == "ok" else None}]
    best = committed if committed_status == "ok" else spec_default
    recorded = []
    monkeypatch.setattr(tk, "candidates", candidates)
    monkeypatch.setattr(tk.tuner, "search", lambda *a, **k: (best, results))
    monkeypatch.setattr(tk.tuning, "full_config", lambda kernel, args, cfg: cfg)
    monkeypatch.setattr(tk.tuning, "record", lambda *a, **k: recorded.append(a) or "path")
    case = types.SimpleNamespace(dims={"b": 1}, kernel=None, args=(), atol=1e-2, rtol=1e-2, finalize=None,
                                 prepare=None, default=spec_default)
    args = argparse.Namespace(no_write=False, out_root=None, rep_ms=10, timing_lock=None)
    run: dict = {}
    tk.search_pair(args, case, "rmsnorm_fwd", "nano", 1.0, run, 0.0)
    assert bool(recorded) == written and run.get("kept_committed", False) == (not written)


@pytest.mark.parametrize("flag", [["--budget-min", "0"], ["--budget-s", "-5"]])
def test_tune_kernels_refuses_a_budget_that_is_not_positive(flag, capsys):
    from nano_hybrid.bench import tune_kernels as tk

    with pytest.raises(SystemExit) as e:
        tk.main(["--list", *flag])
    assert e.value.code == 2 and "the budget must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize("tool", ["grad_match", "kernel_equivalence"])
def test_check_tools_refuse_out_that_is_a_file_before_any_work(tool, tmp_path, capsys):
    import importlib

    mod = importlib.import_module(f"nano_hybrid.bench.{tool}")
    out = tmp_path / "results"
    out.write_text("keep\n")
    assert mod.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --out {out} is an existing file, not a folder"] and out.read_text() == "keep\n"


def test_run_summary_refuses_an_explicit_skip_that_leaves_no_step(tmp_path, capsys):
    from nano_hybrid.bench import run_summary

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {i}, "loss": 2.0, "step_time_s": 0.1}}\n' for i in (1, 2, 3)))
    _one_error(capsys, run_summary.main([str(run), "--skip", "3"]), "--skip 3 leaves no step to time")
    assert run_summary.main([str(run), "--skip", "2"]) == 0
    assert run_summary.main([str(run)]) == 0  # the default skip (5): a run shorter than it is timed whole


@pytest.mark.parametrize("args, needle", [
    (["--arch", "bogus"], "--arch 'bogus': a GPU arch such as sm90"),
    (["--arch", "../../etc"], "--arch '../../etc'"),
    (["--device", "bogus"], "--device 'bogus': cpu, cuda or cuda:N"),
    (["--out", "FILE"], "is a file, not a folder"),
    (["model=tiny", "model.mamba_chunk_size=96"], "chunk_size=96 (a power of two in 16..256) is not supported"),
])
def test_bench_compile_cache_refuses_bad_arguments_before_any_child(saved, capsys, monkeypatch, args, needle):
    import subprocess

    from nano_hybrid.bench import bench_compile_cache

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a child was started"))
    monkeypatch.delenv("HELION_INTERPRET", raising=False)  # the tool refuses interpret mode before these checks
    before = _tree(saved)
    args = [str(saved / "file") if a == "FILE" else a for a in args]
    with pytest.raises(SystemExit) as e:
        bench_compile_cache.main(["--kernels", "rmsnorm_fwd", *args] + ([] if "--out" in args else
                                                                       ["--out", str(saved / "out")]))
    assert e.value.code == EXIT_BAD_INPUT and needle in capsys.readouterr().err
    assert _tree(saved) == before
