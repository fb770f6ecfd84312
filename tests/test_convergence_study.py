"""The seed-study launcher (nano_hybrid/convergence_study.py, scripts/convergence_study.py) on CPU: the runs and
commands it plans (seeds, arms, the long run, W&B groups, per-run caches), bad arguments as one error line, and the
stop at the deadline (SIGTERM, then the same command resumes) with a stand-in trainer."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest

from nano_hybrid.config import compose
from nano_hybrid.convergence_study import StudyConfigError, launch, make_plan
from nano_hybrid.tools import convergence_study


def _plan(tmp_path, **kw):
    base = dict(out=tmp_path / "study", arms=["mamba_ssm", "helion"], seeds=[1, 2, 3], corpus=tmp_path / "corpus",
                corpus_roots=[str(tmp_path)], long_iters=20000, extra=[], long_extra=[], wandb="offline")
    base.update(kw)
    return make_plan(**base)


def test_plan_runs_seeds_per_arm_and_a_long_run(tmp_path):
    plan = _plan(tmp_path)
    assert [r.name for r in plan.runs] == ["mamba_ssm_s1", "mamba_ssm_s2", "mamba_ssm_s3", "helion_s1", "helion_s2",
                                           "helion_s3", "long_helion"]
    assert {a: [r.seed for r in rs] for a, rs in plan.arms().items()} == {"mamba_ssm": [1, 2, 3], "helion": [1, 2, 3]}
    seen_dirs = set()
    for r in plan.runs:
        cfg = compose(r.overrides)
        assert cfg.run_dir == str(r.run_dir) and cfg.seed == r.seed and r.run_dir not in seen_dirs
        seen_dirs.add(r.run_dir)
        assert cfg.model.name == "nano_proxy" and cfg.data.valid_seed == 1234
        assert cfg.data.paths == [f"{tmp_path / 'corpus'}/train"] and cfg.data.valid_paths == [f"{tmp_path / 'corpus'}/valid"]
        assert cfg.data.cache_dir == str(r.run_dir / "data_cache")  # no two processes write one index cache
        assert cfg.logger.wandb.mode == "offline" and cfg.logger.wandb.group == r.arm
        assert cfg.kernels.backend == ("mamba_ssm" if r.arm == "mamba_ssm" else "helion")
        assert r.train_iters == cfg.train.train_iters
        if r.arm != "long":
            assert cfg.train.train_iters == 2000
            tokens = cfg.train.global_batch_size * cfg.train.seq_length
            assert tokens == 8192  # the same tokens per step in every seed run
    long = plan.runs[-1]
    assert long.train_iters == 20000 and compose(long.overrides).train.eval_interval == 1000
    fp32 = _plan(tmp_path, arms=["mamba_ssm", "helion", "helion_fp32"], long_iters=None)
    cfg = compose(fp32.runs[-1].overrides)
    assert cfg.kernels.helion.bwd_states_dtype == "fp32" and cfg.kernels.helion.bwd_dstates_dtype == "fp32"
    assert cfg.kernels.helion.save_conv_states is False
    assert all(r.arm != "long" for r in fp32.runs)


def test_plan_of_the_long_run_alone(tmp_path):
    """--arms none: only the long helion run (the GPU to itself), seeds unused."""
    plan = _plan(tmp_path, arms=[], seeds=[])
    assert [r.name for r in plan.runs] == ["long_helion"] and plan.arms() == {}
    cfg = compose(plan.runs[0].overrides)
    assert cfg.kernels.backend == "helion" and cfg.train.train_iters == 20000 and cfg.train.global_batch_size == 4


@pytest.mark.parametrize("kw, match", [
    ({"arms": ["mamba_ssm", "triton"]}, "unknown arm"),
    ({"arms": ["helion"]}, "two different arms"),
    ({"arms": [], "long_iters": None}, "no arms and no long run"),
    ({"seeds": [1]}, "two different seeds"),
    ({"seeds": [1, 1]}, "two different seeds"),
    ({"extra": ["seed=4"]}, "set by the launcher"),
    ({"extra": ["train.train_iters"]}, "KEY=VALUE"),
    ({"extra": ["train.train_iters=abc"]}, "train.train_iters=abc: give a whole number"),
    ({"long_extra": ["train.train_iters=0"]}, "train.train_iters=0: give a whole number"),
    ({"wandb": "online"}, "offline or disabled"),
])
def test_bad_plans_are_refused(tmp_path, kw, match):
    with pytest.raises(StudyConfigError, match=match):
        _plan(tmp_path, **kw)


def test_dry_run_prints_every_command_and_bad_arguments_exit_2(tmp_path, capsys):
    from nano_hybrid.data.tokenizer import extract_tekken

    tok = tmp_path / "tok" / "tekken_131k.json"  # a fresh clone has no data/tokenizers/ yet
    extract_tekken(tok)
    assert convergence_study.main(["--dry-run", "--out", str(tmp_path / "s"), "--corpus", str(tmp_path / "c"),
                                   "--corpus-root", str(tmp_path), "--tokenizer", f"tiktoken:{tok}",
                                   "train.train_iters=300", f"data.tokenizer.path={tok}"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "scripts/prepare_corpus.py" in lines[0] and f"--root {tmp_path}" in lines[0]
    runs = lines[1:]
    assert len(runs) == 7 and all(" -m nano_hybrid.train recipe=convergence_seeds_h200 " in c for c in runs)
    assert sum("train.train_iters=300" in c for c in runs) == 7  # the long run's own train_iters comes after it
    assert runs[-1].endswith("train.train_iters=20000")
    assert convergence_study.main(["--dry-run", "--arms", "none", "--out", str(tmp_path / "s"), "--corpus",
                                   str(tmp_path / "c"), "--corpus-root", str(tmp_path), "--tokenizer",
                                   f"tiktoken:{tok}", f"data.tokenizer.path={tok}"]) == 0
    alone = capsys.readouterr().out.strip().splitlines()[1:]
    assert len(alone) == 1 and "logger.wandb.name=long_helion" in alone[0]
    assert convergence_study.main(["--dry-run", "--arms", "none", "--resume-check", "1000", "--out", str(tmp_path / "s"),
                                   "--corpus", str(tmp_path / "c"), "--corpus-root", str(tmp_path), "--tokenizer",
                                   f"tiktoken:{tok}", f"data.tokenizer.path={tok}"]) == 0
    check = capsys.readouterr().out.strip().splitlines()[1:]
    assert [c.split("logger.wandb.name=")[1].split()[0] for c in check] == ["long_helion", "long_helion_rc",
                                                                             "long_helion_ref"]
    assert all("train.deterministic=true" in c for c in check[1:]) and "train.deterministic" not in check[0]
    for argv in (["--seeds", "1,x"], ["--minutes", "0.1"], ["train.no_such_key=1"], ["--corpus-root", str(tmp_path / "no")],
                 ["--save-margin", "600"], ["--arms", "none", "--resume-check", "20000"]):
        assert convergence_study.main(["--dry-run", "--out", str(tmp_path / "s"), "--corpus", str(tmp_path / "c"),
                                       "--tokenizer", f"tiktoken:{tok}", f"data.tokenizer.path={tok}"] + argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), (argv, err)


FAKE_TRAINER = """#!/usr/bin/env bash
# a stand-in for `python -m nano_hybrid.train ...`: logs steps until SIGTERM, then "saves" and exits 0
for a in "$@"; do case "$a" in run_dir=*) d="${a#run_dir=}";; esac; done
mkdir -p "$d"
step=$(wc -l < "$d/metrics.jsonl" 2>/dev/null || echo 0)
trap 'echo "$step" > "$d/saved_at"; exit 0' TERM
while true; do step=$((step + 1)); echo "{\\"step\\": $step}" >> "$d/metrics.jsonl"; sleep 0.05; done
"""


def test_launch_stops_every_run_at_the_deadline_and_skips_complete_ones(tmp_path):
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_TRAINER)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    plan = _plan(tmp_path, seeds=[1, 2], long_iters=None)
    done = plan.runs[0].run_dir / "checkpoints"
    done.mkdir(parents=True)
    (done / "latest_checkpointed_iteration.txt").write_text("2000\n")
    t0 = time.monotonic()
    res = launch(plan, minutes=0.05, python=str(fake), grace_s=5, save_margin_s=0, poll_s=0.05, min_run_minutes=0,
                 log=lambda m: None)
    assert time.monotonic() - t0 < 15
    assert res[plan.runs[0].name] is None  # complete before: not started
    for r in plan.runs[1:]:
        assert res[r.name] == 0 and (r.run_dir / "saved_at").is_file()  # stopped by SIGTERM, saved, exit 0
        first = int((r.run_dir / "saved_at").read_text())
        assert first > 0 and (plan.out / "logs" / f"{r.name}.part1.log").is_file()
        cmd = (plan.out / "logs" / f"{r.name}.part1.log").read_text().splitlines()[0]
        assert f"run_dir={r.run_dir}" in cmd and "train.exit_after_minutes" not in cmd  # stopped by the signal
    # the same call again resumes each run in its own run_dir (a second log segment, the steps continue)
    launch(plan, minutes=0.05, python=str(fake), grace_s=5, save_margin_s=0, poll_s=0.05, min_run_minutes=0,
           log=lambda m: None)
    r = plan.runs[1]
    steps = [json.loads(x)["step"] for x in (r.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and (plan.out / "logs" / f"{r.name}.part2.log").is_file()
    assert not os.path.exists(plan.runs[0].run_dir / "metrics.jsonl")


RESUMING_TRAINER = """#!/usr/bin/env bash
# a stand-in trainer that resumes: continues from its checkpoint tracker, logs a deterministic loss per step until
# SIGTERM or its train.train_iters, then writes the tracker (unless checkpoint.save_on_exit=false) and exits 0
save=1
for a in "$@"; do case "$a" in run_dir=*) d="${a#run_dir=}";; train.train_iters=*) n="${a#train.train_iters=}";;
  checkpoint.save_on_exit=false) save=0;; esac; done
mkdir -p "$d/checkpoints"
step=$(cat "$d/checkpoints/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)
finish() { [ $save = 1 ] && echo "$step" > "$d/checkpoints/latest_checkpointed_iteration.txt"; exit 0; }
trap finish TERM
while [ "$step" -lt "$n" ]; do step=$((step + 1)); echo "{\\"step\\": $step, \\"loss\\": $((100000 / step)), \\"grad_norm\\": 1.5}" \\
  >> "$d/metrics.jsonl"; sleep 0.02; done
finish
"""


def test_resume_check_plans_a_deterministic_pair_and_refuses_bad_steps(tmp_path):
    plan = _plan(tmp_path, arms=[], long_iters=20000, resume_check=1000)
    long, rc, ref = plan.runs
    assert (long.name, long.stops) == ("long_helion", ())
    assert (rc.name, rc.arm, rc.stops) == ("long_helion_rc", "long_rc", (1000, 1400))
    assert (ref.name, ref.arm, ref.stops) == ("long_helion_ref", "long_ref", (1400,))
    assert plan.arms() == {}
    c_long, c_rc, c_ref = compose(long.overrides), compose(rc.overrides), compose(ref.overrides)
    assert c_ref.checkpoint.save_on_exit is False and c_rc.checkpoint.save_on_exit is True
    assert c_rc.logger.wandb.mode == c_ref.logger.wandb.mode == "disabled" and c_long.logger.wandb.mode == "offline"
    assert c_rc.train.deterministic and c_rc.kernels.deterministic and c_ref.train.deterministic
    assert not c_long.train.deterministic
    # the long run's settings otherwise: model, data, schedule, seed
    for key in ("model", "optim", "data.paths", "data.valid_paths", "train.train_iters", "train.global_batch_size",
                "train.eval_interval", "seed", "kernels.backend"):
        vals = []
        for c in (c_long, c_rc, c_ref):
            for part in key.split("."):
                c = c[part]
            vals.append(c)
        assert vals[0] == vals[1] == vals[2], key
    for bad in (0, 20000, -5):
        with pytest.raises(StudyConfigError, match="resume-check"):
            _plan(tmp_path, arms=[], long_iters=20000, resume_check=bad)
    with pytest.raises(StudyConfigError, match="resume-check"):
        _plan(tmp_path, long_iters=None, resume_check=100)


def test_launch_stops_and_resumes_the_check_run_beside_its_reference(tmp_path):
    from nano_hybrid.convergence_study import long_run_summary, resume_continuity, resume_steps

    fake = tmp_path / "fake_python"
    fake.write_text(RESUMING_TRAINER)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    plan = make_plan(out=tmp_path / "study", arms=[], seeds=[1], corpus=tmp_path / "corpus",
                     corpus_roots=[str(tmp_path)], long_iters=400, extra=[], long_extra=[], wandb="offline",
                     recipe_iters=2000, resume_check=20, resume_window=100)
    long, rc, ref = plan.runs
    # every run ends on its own (stop steps, train_iters; the check runs' last stop is far below train_iters, so a
    # slow poll cannot miss it): the deadline is only a cap
    res = launch(plan, minutes=3, python=str(fake), grace_s=5, save_margin_s=0, poll_s=0.05, min_run_minutes=0,
                 log=lambda m: None)
    assert res == {"long_helion": 0, "long_helion_rc": 0, "long_helion_ref": 0}
    k = resume_steps(rc.run_dir)
    assert len(k) == 1 and k[0] >= 20  # stopped at (about) step 20, resumed from its checkpoint
    assert resume_steps(long.run_dir) == [] and checkpointed_step_of(long) == 400  # the long run runs through
    segs = (plan.out / "logs" / "long_helion_rc.segments.jsonl").read_text().splitlines()
    assert [json.loads(x)["from_step"] for x in segs] == [0, k[0]]
    summary = long_run_summary(rc.run_dir)
    assert summary["missing_steps"] == [] and summary["resumed_from"] == k and summary["segments"] == 2
    assert summary["last_step"] >= 120 and checkpointed_step_of(rc) >= 120  # stopped at its last stop step
    assert not (ref.run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").exists()  # never saved
    cont = resume_continuity(rc.run_dir, ref.run_dir, window=10)
    assert cont["resume_step"] == k[0] and cont["first_differing_step"] is None and cont["bitwise_equal_after_resume"]
    # the next invocation starts none of them again (the check runs reached their last stop step, the long run its end)
    res = launch(plan, minutes=3, python=str(fake), grace_s=5, save_margin_s=0, poll_s=0.05, min_run_minutes=0,
                 log=lambda m: None)
    assert res == {"long_helion": None, "long_helion_rc": None, "long_helion_ref": None}


def test_long_stops_resume_the_long_run_inside_one_invocation(tmp_path):
    """--long-stops K1,K2: the long run gets SIGTERM once it has logged each step and the same command starts again at
    once from its checkpoint, then runs to its end; the next invocation finds it complete. Bad stop lists are refused
    before anything starts."""
    from nano_hybrid.convergence_study import long_run_summary, resume_steps

    fake = tmp_path / "fake_python"
    fake.write_text(RESUMING_TRAINER)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    plan = _plan(tmp_path, arms=[], long_iters=150, long_stops=(30, 90))
    (long,) = plan.runs
    assert long.stops == (30, 90) and long.resume_after_stops
    res = launch(plan, minutes=3, python=str(fake), grace_s=5, save_margin_s=0, poll_s=0.05, min_run_minutes=0,
                 log=lambda m: None)
    assert res == {"long_helion": 0}
    k = resume_steps(long.run_dir)
    assert len(k) == 2 and 30 <= k[0] < k[1] and k[1] >= 90  # stopped at (about) each stop step, resumed from there
    summary = long_run_summary(long.run_dir)
    assert summary["segments"] == 3 and summary["missing_steps"] == [] and summary["resumed_from"] == k
    assert checkpointed_step_of(long) == 150
    res = launch(plan, minutes=3, python=str(fake), grace_s=5, save_margin_s=0, poll_s=0.05, min_run_minutes=0,
                 log=lambda m: None)
    assert res == {"long_helion": None}
    for bad in ((90, 30), (30, 30), (0, 10), (10, 150)):
        with pytest.raises(StudyConfigError, match="--long-stops"):
            _plan(tmp_path, arms=[], long_iters=150, long_stops=bad)
    assert convergence_study.main(["--arms", "none", "--long-stops", "1k", "--dry-run"]) == 2


def test_long_stops_reach_the_launcher_from_the_command_line(tmp_path, capsys):
    assert convergence_study.main(["--arms", "none", "--long-iters", "100", "--long-stops", "150", "--dry-run",
                                   "--out", str(tmp_path / "s")]) == 2
    assert "--long-stops 150" in capsys.readouterr().err


def test_a_train_iters_override_that_is_not_a_number_is_one_line(tmp_path, capsys):
    assert convergence_study.main(["--dry-run", "--out", str(tmp_path / "s"), "train.train_iters=abc"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: override train.train_iters=abc"), err
    assert not (tmp_path / "s").exists()


def checkpointed_step_of(run):
    return int((run.run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())


def test_resume_continuity_finds_the_first_difference_and_plots(tmp_path):
    from nano_hybrid.convergence_study import plot_long_run, resume_continuity

    def write(d, losses, resumed_from=()):
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "loss": v, "grad_norm": 1.0, **({"val_loss": v} if s % 10 == 0 else {})}) + "\n"
            for s, v in enumerate(losses, 1)))
        (d.parent / "logs").mkdir(exist_ok=True)
        (d.parent / "logs" / f"{d.name}.segments.jsonl").write_text(
            "".join(json.dumps({"segment": i + 1, "from_step": f}) + "\n" for i, f in enumerate((0, *resumed_from))))

    ref = [4.0 - 0.01 * s for s in range(60)]
    run = list(ref)
    run[35] *= 1.01  # step 36, after the resume at step 30
    write(tmp_path / "runs" / "long", run, resumed_from=(30,))
    write(tmp_path / "runs" / "ref", ref)
    c = resume_continuity(tmp_path / "runs" / "long", tmp_path / "runs" / "ref", window=20)
    assert c["first_differing_step"] == 36 and not c["bitwise_equal_after_resume"]
    assert c["before"]["mean_abs_rel_loss_diff"] == 0.0 and c["after"]["steps"] == [31, 50]
    assert c["after"]["mean_abs_rel_loss_diff"] == pytest.approx(0.01 / 20, rel=1e-9)
    with pytest.raises(ValueError, match="no resume"):
        resume_continuity(tmp_path / "runs" / "ref", tmp_path / "runs" / "long")
    pytest.importorskip("matplotlib")
    png = plot_long_run(tmp_path / "runs" / "long", tmp_path / "out", tmp_path / "runs" / "ref", smooth=5)
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
