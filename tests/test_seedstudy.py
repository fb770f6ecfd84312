"""Grouped comparison of seeds per arm (nano_hybrid/seedstudy.py, scripts/compare_seeds.py) on synthetic
metrics.jsonl files: the Welch interval against a hand computation, the Student t quantiles, paired seeds,
the common final step, and one-line refusals (mismatched tokens per step, too few runs)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from nano_hybrid.seedstudy import (
    StudyError,
    compare_arms,
    load_run,
    smooth_trailing,
    t_quantile,
    welch_interval,
)
from nano_hybrid.tools import compare_seeds


def _run(tmp_path, name, seed, final_val, *, steps=100, tokens_per_step=4096, eval_every=50):
    d = tmp_path / name
    d.mkdir()
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            rec = {"step": s, "loss": 5.0 - 2.0 * s / steps + 0.01 * seed, "tokens_per_step": tokens_per_step,
                   "step_time_s": 0.1}
            if s % eval_every == 0:
                rec["val_loss"] = final_val + 0.5 * (100 - s) / 100
            f.write(json.dumps(rec) + "\n")
    (d / "config.yaml").write_text(f"seed: {seed}\nrun_dir: {d}\n")
    return d


def test_student_t_quantiles():
    for df, want in ((1, 12.706205), (2, 4.302653), (4, 2.776445), (10, 2.228139), (30, 2.042272), (1000, 1.962339)):
        assert t_quantile(0.975, df) == pytest.approx(want, abs=2e-6), df
    assert t_quantile(0.025, 4) == pytest.approx(-2.776445, abs=2e-6)
    assert t_quantile(0.975, 6) < t_quantile(0.975, 5.5) < t_quantile(0.975, 5)


def test_welch_interval_matches_a_hand_computation():
    base, arm = np.array([1.00, 1.02, 1.04]), np.array([1.04, 1.06, 1.08])
    w = welch_interval(base, arm)
    # equal variances (0.0004) and sizes (3): se = sqrt(2 * 0.0004 / 3), Welch-Satterthwaite df = 2 (n - 1) = 4
    se = math.sqrt(2 * 0.0004 / 3)
    assert w["diff"] == pytest.approx(0.04) and w["se"] == pytest.approx(se) and w["df"] == pytest.approx(4.0)
    assert (w["low"], w["high"]) == pytest.approx((0.04 - 2.776445 * se, 0.04 + 2.776445 * se), abs=1e-6)
    # unequal spreads: df below n_a + n_b - 2
    u = welch_interval(np.array([1.0, 1.02, 1.04]), np.array([1.03, 1.05, 1.10]))
    va, vb = 0.0004 / 3, 0.0013 / 3
    assert u["df"] == pytest.approx((va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 2))
    assert u["high"] - u["diff"] == pytest.approx(t_quantile(0.975, u["df"]) * math.sqrt(va + vb))


def test_study_report_numbers_and_reference(tmp_path):
    m = [load_run(_run(tmp_path, f"m{s}", s, v)) for s, v in zip((1, 2, 3), (1.00, 1.02, 1.04))]
    h = [load_run(_run(tmp_path, f"h{s}", s, v)) for s, v in zip((1, 2, 3), (1.04, 1.06, 1.08))]
    r = compare_arms({"mamba_ssm": m, "helion": h}, "mamba_ssm", smooth=10, reference_rel=0.0052)
    assert r["final_val_step"] == 100 and r["tokens_per_step"] == 4096
    assert r["arms"]["mamba_ssm"]["mean"] == pytest.approx(1.02)
    assert r["arms"]["mamba_ssm"]["std"] == pytest.approx(0.02) == r["arms"]["helion"]["std"]
    d = r["diffs"]["helion"]
    se = math.sqrt(2 * 0.0004 / 3)
    assert d["rel_diff"] == pytest.approx(0.04 / 1.02)
    assert d["rel_low"] == pytest.approx((0.04 - 2.776445 * se) / 1.02, abs=1e-6)
    assert d["reference_inside"] is True  # 0.52% lies in [-0.52%, +8.37%]
    assert d["paired"]["diff"] == pytest.approx(0.04) and d["paired"]["pairs"] == 3
    out = compare_arms({"mamba_ssm": m, "helion": h}, "mamba_ssm", reference_rel=-0.01)
    assert out["diffs"]["helion"]["reference_inside"] is False
    # the per-step validation band at step 100 is the final interval
    vb = r["bands"]["val_diff"]["helion"]
    assert vb["diff"][-1] == pytest.approx(0.04) and vb["half_width_95"][-1] == pytest.approx(2.776445 * se, abs=1e-6)


def test_final_step_is_the_last_one_all_runs_reached(tmp_path):
    m = [load_run(_run(tmp_path, f"m{s}", s, 1.0)) for s in (1, 2)]
    h = [load_run(_run(tmp_path, "h1", 1, 1.1)), load_run(_run(tmp_path, "h2", 2, 1.1, steps=80))]
    r = compare_arms({"a": m, "b": h}, "a")
    assert r["final_val_step"] == 50
    assert r["diffs"]["b"]["welch"]["diff"] == pytest.approx(0.1)


def test_smoothing_is_a_trailing_mean():
    assert smooth_trailing(np.array([1.0, 3.0, 5.0, 7.0]), 2).tolist() == [1.0, 2.0, 4.0, 6.0]


def test_cli_writes_report_and_plot(tmp_path, capsys):
    arms = []
    for arm, vals in (("mamba_ssm", (1.00, 1.02, 1.04)), ("helion", (1.04, 1.06, 1.08))):
        arms += ["--arm", f"{arm}=" + ",".join(str(_run(tmp_path, f"{arm}{s}", s, v)) for s, v in zip((1, 2, 3), vals))]
    out = tmp_path / "cmp"
    assert compare_seeds.main(arms + ["--reference-diff", "0.0052", "--smooth", "5", "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "| helion | +0.04000 | +3.922% |" in md and "+0.520%: yes" in md
    rep = json.loads((out / "report.json").read_text())
    assert rep["diffs"]["helion"]["welch"]["df"] == pytest.approx(4.0)
    assert (out / "seed_bands.png").stat().st_size > 10_000


def test_mismatched_tokens_per_step_is_refused_with_one_line(tmp_path, capsys):
    a = [str(_run(tmp_path, f"a{s}", s, 1.0)) for s in (1, 2)]
    b = [str(_run(tmp_path, "b1", 1, 1.0)), str(_run(tmp_path, "b2", 2, 1.0, tokens_per_step=2048))]
    capsys.readouterr()
    rc = compare_seeds.main(["--arm", "a=" + ",".join(a), "--arm", "b=" + ",".join(b), "--no-plots",
                             "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: runs differ in tokens per step")
    assert "b/b2=2048" in err[0] and "a/a1=4096" in err[0]


def test_too_few_runs_and_missing_runs_are_errors(tmp_path):
    a = [load_run(_run(tmp_path, f"a{s}", s, 1.0)) for s in (1, 2)]
    with pytest.raises(StudyError, match="needs >= 2"):
        compare_arms({"a": a, "b": [load_run(_run(tmp_path, "b1", 1, 1.0))]}, "a")
    with pytest.raises(StudyError, match="no metrics.jsonl"):
        load_run(tmp_path / "absent")


def test_a_run_listed_twice_in_an_arm_is_refused(tmp_path, capsys):
    a1, a2 = _run(tmp_path, "a1", 1, 1.0), _run(tmp_path, "a2", 2, 1.0)
    b = [str(_run(tmp_path, f"b{s}", s, 1.0)) for s in (1, 2)]
    out = tmp_path / "o"
    capsys.readouterr()
    rc = compare_seeds.main(["--arm", f"a={a1},{tmp_path}/../{tmp_path.name}/a1/metrics.jsonl",
                             "--arm", "b=" + ",".join(b), "--no-plots", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: arm a lists the run") and "twice" in err[0]
    assert not out.exists()
    assert compare_seeds.main(["--arm", f"a={a1},{a2}", "--arm", "b=" + ",".join(b), "--no-plots",
                               "--out", str(out)]) == 0


@pytest.mark.parametrize("sub", ["", "x"])
def test_out_that_is_a_file_is_refused_before_any_work(tmp_path, capsys, sub):
    a = [str(_run(tmp_path, f"a{s}", s, 1.0)) for s in (1, 2)]
    b = [str(_run(tmp_path, f"b{s}", s, 1.0)) for s in (1, 2)]
    f = tmp_path / "report"
    f.write_text("kept\n")
    capsys.readouterr()
    rc = compare_seeds.main(["--arm", "a=" + ",".join(a), "--arm", "b=" + ",".join(b), "--no-plots",
                             "--out", str(f / sub if sub else f)])
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: --out ") and "existing file" in err[0]
    assert cap.out == "" and f.read_text() == "kept\n"
