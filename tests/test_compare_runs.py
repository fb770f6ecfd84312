"""scripts/compare_runs.py on synthetic metrics.jsonl runs: every printed number checked exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nano_hybrid.bench import compare_runs as cr

REPO = Path(__file__).resolve().parent.parent


def _write_run(d: Path, losses, times, tokens_per_step=1000, backend="torch", extra=None, tail=""):
    d.mkdir(parents=True)
    with open(d / "metrics.jsonl", "w") as f:
        for i, (loss, dt) in enumerate(zip(losses, times), 1):
            rec = {"step": i, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "step_time_s": dt,
                   "tokens": tokens_per_step * i, "tokens_per_s": tokens_per_step / dt, "world_size": 2,
                   "tflops_per_gpu": 0.0, "mem_gb": 0.0, "backend": backend}
            rec.update((extra or {}).get(i, {}))
            f.write(json.dumps(rec) + "\n")
        f.write(tail)
    return d


@pytest.fixture
def two_runs(tmp_path):
    # 20 steps. Run A: loss 10 - 0.1*i, step time 1.0 except 2 slow warm-up steps.
    la = [10.0 - 0.1 * i for i in range(1, 21)]
    ta = [5.0, 3.0] + [1.0 + 0.01 * k for k in range(18)]
    # Run B: loss +1% of A, step times exactly half of A's.
    lb = [x * 1.01 for x in la]
    tb = [t / 2 for t in ta]
    a = _write_run(tmp_path / "A", la, ta)
    b = _write_run(tmp_path / "B", lb, tb, backend="helion")
    return a, b, la, ta, lb, tb


def test_numbers_exact(two_runs):
    a, b, la, ta, lb, tb = two_runs
    res = cr.compare([cr.load_run(str(a)), cr.load_run(str(b))], warmup=2)
    ra, rb = res["runs"]
    post = np.array(ta[2:])
    assert ra["timed_steps"] == 18
    assert ra["step_time_median_s"] == pytest.approx(float(np.median(post)), abs=0, rel=1e-15)
    assert ra["step_time_median_s"] == pytest.approx(1.085, rel=1e-12)
    assert ra["step_time_p90_s"] == pytest.approx(float(np.percentile(post, 90)), rel=1e-15)
    assert rb["step_time_median_ratio"] == pytest.approx(0.5, rel=1e-12)
    assert rb["step_time_p90_ratio"] == pytest.approx(0.5, rel=1e-12)
    # tokens/s/GPU = tokens_per_s / world_size = 1000 / dt / 2
    assert ra["tokens_per_s_per_gpu_median"] == pytest.approx(float(np.median(500.0 / post)), rel=1e-12)
    assert rb["tokens_per_s_per_gpu_median"] == pytest.approx(2 * ra["tokens_per_s_per_gpu_median"], rel=1e-12)
    assert ra["loss_final"] == la[-1] and rb["loss_final"] == lb[-1]
    assert ra["loss_mean_last10pct"] == pytest.approx((la[-2] + la[-1]) / 2, rel=1e-15)
    assert ra["loss_mean"] == pytest.approx(float(np.mean(la)), rel=1e-15)
    assert ra["tokens"] == 20000 and ra["backend"] == "torch" and rb["backend"] == "helion"

    d = res["loss_diff"][0]
    assert d["matching_steps"] == 20 and d["first_step"] == 1 and d["last_step"] == 20
    absd = np.abs(np.array(lb) - np.array(la))
    assert d["all"]["mean_abs_diff"] == pytest.approx(float(absd.mean()), rel=1e-12)
    assert d["all"]["max_abs_diff"] == pytest.approx(0.099, rel=1e-9)  # 1% of the largest loss (9.9)
    assert d["all"]["mean_rel_diff"] == pytest.approx(0.01, rel=1e-9)
    assert d["all"]["max_rel_diff"] == pytest.approx(0.01, rel=1e-9)
    # b is 1% above a at every step: the signed mean and the difference of the means say +1% (and the sign)
    assert d["all"]["mean_signed_rel_diff"] == pytest.approx(0.01, rel=1e-9)
    assert d["last10pct"]["rel_diff_of_means"] == pytest.approx(0.01, rel=1e-9)
    assert d["last10pct"]["steps"] == 2
    assert d["last10pct"]["mean_abs_diff"] == pytest.approx(0.01 * (la[-2] + la[-1]) / 2, rel=1e-9)
    assert d["last10pct"]["max_abs_diff"] == pytest.approx(0.01 * la[-2], rel=1e-9)


def test_resumed_run_last_record_wins_and_partial_steps(tmp_path):
    # Run A logged steps 1..10, crashed after 8 with a checkpoint at 6, resumed: steps 7, 8 logged twice.
    la = [5.0 - 0.1 * i for i in range(1, 11)]
    a = _write_run(tmp_path / "A", la, [1.0] * 10, tail="")
    with open(a / "metrics.jsonl") as f:
        lines = f.readlines()
    stale = [json.loads(x) for x in lines[6:8]]
    for r in stale:
        r["loss"] = 99.0  # the curve that was lost with the crash
    with open(a / "metrics.jsonl", "w") as f:  # file order = time order; a truncated last line from a kill
        f.writelines(lines[:6] + [json.dumps(r) + "\n" for r in stale] + lines[6:] + ['{"step": 11, "loss": 3.'])
    run = cr.load_run(str(a))
    assert list(run.steps) == list(range(1, 11))
    np.testing.assert_array_equal(run.loss, np.array(la))
    # B only has steps 3..6 (a short run): diffs over matching steps only
    b = tmp_path / "B"
    b.mkdir()
    with open(b / "metrics.jsonl", "w") as f:
        for s in range(3, 7):
            f.write(json.dumps({"step": s, "loss": la[s - 1] + 0.5, "step_time_s": 2.0, "tokens_per_s": 500.0}) + "\n")
    rb = cr.load_run(str(b / "metrics.jsonl"))
    np.testing.assert_array_equal(rb.tokens, np.array([3000.0, 4000.0, 5000.0, 6000.0]))  # 1000 tokens/step * step
    d = cr.loss_diff_stats(run, rb)
    assert d["matching_steps"] == 4 and d["first_step"] == 3 and d["last_step"] == 6
    assert d["all"]["max_abs_diff"] == pytest.approx(0.5, rel=1e-12)
    assert d["last10pct"]["steps"] == 1
    assert d["last10pct"]["max_rel_diff"] == pytest.approx(0.5 / la[5], rel=1e-12)


def test_cli_plots_and_json(two_runs, tmp_path):
    a, b, *_ = two_runs
    out = tmp_path / "cmp"
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "compare_runs.py"), str(a), str(b), "--warmup", "2",
                        "--out", str(out), "--json", str(out / "s.json")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "loss diff B vs A over 20 matching steps" in p.stdout
    for png in ("loss.png", "step_time.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    js = json.loads((out / "s.json").read_text())
    assert js["runs"][1]["step_time_median_ratio"] == pytest.approx(0.5)
    assert js["plots"] == [str(out / "loss.png"), str(out / "step_time.png")]


def test_errors(tmp_path):
    assert cr.main([str(tmp_path / "nope"), str(tmp_path / "nope2")]) == 2
    a = _write_run(tmp_path / "A", [1.0, 2.0], [1.0, 1.0])
    with pytest.raises(cr.CompareError, match="none left after --warmup 5"):
        cr.compare([cr.load_run(str(a)), cr.load_run(str(a))], warmup=5)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": 1\n{"step": 2, "loss": 1.0, "step_time_s": 1.0, "tokens": 5}\n')
    with pytest.raises(cr.CompareError, match=r"metrics.jsonl:1: not a JSON line"):
        cr.load_run(str(bad))
    with pytest.raises(cr.CompareError, match="expected wandb:ENTITY/PROJECT/RUN_ID"):
        cr.load_run("wandb:only/two")


def test_wandb_history_mapping(monkeypatch, two_runs):
    """W&B paths go through wandb.Api().run(path).scan_history(); 'train/'-prefixed keys are understood."""
    import types

    rows = [{"_step": i, "train/step": i, "train/loss": 3.0 - 0.1 * i, "train/step_time_s": 0.5,
             "train/tokens": 100 * i, "train/tokens_per_s_per_gpu": 200.0} for i in range(1, 6)]
    calls = []

    class FakeRun:
        def scan_history(self):
            return iter(rows)

    class FakeApi:
        def run(self, path):
            calls.append(path)
            return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(Api=FakeApi))
    run = cr.load_run("wandb:team/proj/abc123")
    assert calls == ["team/proj/abc123"]
    assert list(run.steps) == [1, 2, 3, 4, 5] and run.tokens[-1] == 500
    assert cr.run_stats(run, 1)["tokens_per_s_per_gpu_median"] == 200.0


def test_runs_with_other_tokens_per_step_compare_at_equal_tokens(tmp_path, capsys):
    """Sequence 128 vs 256: B's step k saw A's step 2k's tokens; the loss is compared there, and the report says so."""
    la = [6.0 - 0.1 * i for i in range(1, 21)]  # A: 1000 tokens per step, loss linear in tokens
    a = _write_run(tmp_path / "A", la, [1.0] * 20)
    lb = [6.0 - 0.2 * i + 0.05 for i in range(1, 11)]  # B: 2000 tokens per step, the same curve + 0.05
    b = _write_run(tmp_path / "B", lb, [1.0] * 10, tokens_per_step=2000)
    ra, rb = cr.load_run(str(a)), cr.load_run(str(b))
    assert not cr.same_tokens_per_step(ra, rb)
    d = cr.loss_diff_stats(ra, rb)
    assert d["aligned_by"] == "tokens" and d["first_step"] == 2 and d["last_step"] == 20 and d["matching_steps"] == 19
    assert d["all"]["mean_diff"] == pytest.approx(0.05, abs=1e-9) and d["all"]["max_abs_diff"] == pytest.approx(0.05, abs=1e-9)
    assert cr.main([str(a), str(b), "--no-plots", "--warmup", "2"]) == 0
    out = capsys.readouterr().out
    assert "differ in tokens per step" in out and "at the tokens of 19 baseline steps" in out
    # equal tokens per step: compared step by step, no note
    c = _write_run(tmp_path / "C", [x + 0.01 for x in la], [1.0] * 20)
    d = cr.loss_diff_stats(ra, cr.load_run(str(c)))
    assert d["aligned_by"] == "steps" and d["matching_steps"] == 20
