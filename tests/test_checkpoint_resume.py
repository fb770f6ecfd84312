"""End-to-end resume behaviour of ``python -m nano_hybrid.train`` on CPU (model=tiny, mock data).

- an uninterrupted run of 2N steps == N steps + resume for N steps: per-step losses bitwise, final
  model and optimizer state bitwise;
- a process SIGKILLed while writing a checkpoint resumes from the previous complete one; its checkpoint
  writer helper processes end with it; the resume drops the re-run steps from ``metrics.jsonl`` first, so
  every step is logged once;
- SIGTERM mid-run: checkpoint written, exit code 0, the resume continues the curve; the first step
  after a resume is logged once; ``train.exit_after_minutes`` stops the same way;
- an incompatible checkpoint (vocab) and a missing ``checkpoint.load`` path are refused with one line;
- W&B offline: the run directory holds the offline run, and the resume continues the same run id.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from side_by_side import side_by_side

REPO = Path(__file__).resolve().parent.parent
N = 3  # steps before the interruption; uninterrupted runs do 2N

COMMON = [
    "model=tiny", "data=mock", "kernels.backend=torch", "train.seq_length=64", "train.micro_batch_size=2",
    "train.global_batch_size=4", "optim.warmup_iters=1", "train.torch_threads=1", "seed=1234",
]


def _env(**extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_SILENT="true", WANDB_DISABLE_GIT="true")
    env.pop("WANDB_API_KEY", None)
    env.update(extra)
    return env


def group_processes(pgid: int) -> list[str]:
    """Command lines of the live processes in process group ``pgid``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] != "Z" and int(fields[2]) == pgid:
                out.append((d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _run(cmd, env, log: Path, timeout: float, on_start=None, after_exit=None) -> subprocess.CompletedProcess:
    """Run in a new session with output in files: a SIGKILLed trainer can leave children (the W&B service)
    that would hold pipes open; they are killed here, after ``after_exit(proc)`` had a look."""
    with open(log.with_suffix(".out"), "w") as out, open(log.with_suffix(".err"), "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            if on_start is not None:
                on_start(proc)
            rc = proc.wait(timeout=timeout)
            if after_exit is not None:
                after_exit(proc)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # this run's leftover children (its own process group)
            except ProcessLookupError:
                pass
            proc.wait()
    return subprocess.CompletedProcess(cmd, rc, log.with_suffix(".out").read_text(), log.with_suffix(".err").read_text())


def train(run_dir: Path, *overrides: str, env=None, timeout=300, on_start=None, after_exit=None,
          hooked=False) -> subprocess.CompletedProcess:
    """``python -m nano_hybrid.train``; ``hooked``: through tests/hooked_train.py (faults from the environment)."""
    launcher = [sys.executable, str(REPO / "tests" / "hooked_train.py")] if hooked else [sys.executable, "-m", "nano_hybrid.train"]
    cmd = [*launcher, *COMMON, f"run_dir={run_dir}", *overrides]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    n = len(list(run_dir.parent.glob(f"{run_dir.name}.log*.out")))
    return _run(cmd, env or _env(), run_dir.parent / f"{run_dir.name}.log{n}", timeout, on_start, after_exit)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def losses(run_dir: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for r in records(run_dir):
        out[r["step"]] = r["loss"]  # a re-logged step (resume from an older checkpoint) overwrites
    return out


def ckpt_tensors(ckpt: Path, tmp: Path) -> dict:
    """All tensors of a dist checkpoint (model + optimizer), read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{ckpt.parent.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    return torch.load(out, weights_only=False)


def _assert_ok(p: subprocess.CompletedProcess):
    assert p.returncode == 0, f"rc={p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A: 2N steps uninterrupted. B: 2N steps with a checkpoint every N, SIGKILLed while saving step 2N,
    then resumed (from step N) to 2N. B runs with W&B offline."""
    root = tmp_path_factory.mktemp("resume")
    a, b = root / "A", root / "B"
    wb = ["logger.wandb.mode=offline", "logger.wandb.project=nano-hybrid-test"]
    helpers: list[str] = []

    def helpers_left(proc):  # checkpoint-writer helpers (multiprocessing) still alive 5 s after the SIGKILL
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            helpers[:] = [c for c in group_processes(proc.pid) if "multiprocessing" in c]
            if not helpers:
                return
            time.sleep(0.2)

    pa, pb1 = side_by_side(
        lambda: train(a, f"train.train_iters={2 * N}", "checkpoint.interval=0"),
        lambda: train(b, f"train.train_iters={2 * N}", f"checkpoint.interval={N}", *wb, hooked=True,
                      env=_env(NANO_HYBRID_TEST_KILL_DURING_SAVE=str(2 * N)), after_exit=helpers_left))
    _assert_ok(pa)
    b_after_kill = {
        "helpers_left": list(helpers),
        "steps_logged": [r["step"] for r in records(b)],
        "rc": pb1.returncode,
        "stdout": pb1.stdout,
        "dirs": sorted(d.name for d in (b / "checkpoints").glob("iter_*")),
        "tracker": (b / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip(),
        "published": sorted(d.parent.name for d in (b / "checkpoints").glob("iter_*/nano_hybrid_checkpoint.json")),
        "wandb_runs": sorted(d.name for d in (b / "wandb").glob("offline-run-*")),
    }
    pb2 = train(b, f"train.train_iters={2 * N}", f"checkpoint.interval={N}", *wb)
    _assert_ok(pb2)
    return {"root": root, "A": a, "B": b, "pa": pa, "b_after_kill": b_after_kill, "pb2": pb2}


def test_sigkill_during_save_leaves_previous_checkpoint(runs):
    k = runs["b_after_kill"]
    assert k["rc"] == -signal.SIGKILL, k["stdout"][-2000:]
    assert "SIGKILL during save" in k["stdout"]
    # iter_2N was being written (no completion marker), the tracker still names N
    assert k["dirs"] == [f"iter_{N:07d}", f"iter_{2 * N:07d}"]
    assert k["published"] == [f"iter_{N:07d}"]
    assert k["tracker"] == str(N)
    out = runs["pb2"].stdout
    assert "removing incomplete checkpoint" in out and f"iter_{2 * N:07d}" in out
    assert f"loaded {runs['B'] / 'checkpoints' / f'iter_{N:07d}'} (step {N}" in out


def test_resume_is_bitwise_identical(runs, tmp_path):
    la, lb = losses(runs["A"]), losses(runs["B"])
    assert sorted(la) == sorted(lb) == list(range(1, 2 * N + 1))
    for s in la:
        assert la[s] == lb[s], f"step {s}: {la[s]!r} != {lb[s]!r}"  # bitwise (float repr round-trips)
    ta = ckpt_tensors(runs["A"] / "checkpoints" / f"iter_{2 * N:07d}", tmp_path)
    tb = ckpt_tensors(runs["B"] / "checkpoints" / f"iter_{2 * N:07d}", tmp_path)
    tensor_keys = sorted(k for k, v in ta.items() if isinstance(v, torch.Tensor))
    assert any("optimizer" in k for k in tensor_keys) and any("expert_bias" in k for k in tensor_keys)
    assert tensor_keys == sorted(k for k, v in tb.items() if isinstance(v, torch.Tensor))
    for k in tensor_keys:
        assert torch.equal(ta[k], tb[k]), k
    # the MoE expert bias moved during training (so its round trip is a real check)
    assert any(torch.count_nonzero(ta[k]) > 0 for k in tensor_keys if k.endswith("expert_bias"))


def test_kill9_resume_logs_each_step_once(runs):
    # segment 1 logged 1..2N (killed while saving 2N); segment 2 resumed at N: it first dropped N+1..2N
    # from metrics.jsonl, then logged them again
    assert runs["b_after_kill"]["steps_logged"] == list(range(1, 2 * N + 1))
    assert f"dropped {N} record(s) after step {N}" in runs["pb2"].stdout
    recs = records(runs["B"])
    assert [r["step"] for r in recs] == list(range(1, 2 * N + 1))
    assert recs[N]["tokens"] == (N + 1) * 4 * 64 and recs[N]["consumed_samples"] == (N + 1) * 4


def test_helper_processes_end_with_the_trainer(runs):
    assert runs["b_after_kill"]["rc"] == -signal.SIGKILL
    assert runs["b_after_kill"]["helpers_left"] == []


def test_wandb_offline_resume_keeps_run_id(runs):
    k = runs["b_after_kill"]
    assert len(k["wandb_runs"]) == 1, k["wandb_runs"]
    run_id = k["wandb_runs"][0].rsplit("-", 1)[1]
    meta = json.loads((runs["B"] / "checkpoints" / f"iter_{2 * N:07d}" / "nano_hybrid_checkpoint.json").read_text())
    assert meta["wandb_run_id"] == run_id
    after = sorted(d.name for d in (runs["B"] / "wandb").glob("offline-run-*"))
    assert len(after) == 2 and all(d.endswith(f"-{run_id}") for d in after), after


def test_sigterm_saves_and_exits_zero_then_resume_continues(tmp_path):
    run = tmp_path / "C"

    def sigterm_after_a_periodic_save(proc):
        # after the step-2 checkpoint: its writer's manager process exists when the signal arrives
        deadline = time.monotonic() + 240
        m = run / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if m.is_file() and len(m.read_text().splitlines()) >= 3:
                break
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)  # the whole process group, as Slurm, `timeout` and Ctrl-C do

    p = train(run, "train.train_iters=500", "checkpoint.interval=2", "checkpoint.keep_last=1",
              on_start=sigterm_after_a_periodic_save)
    out = p.stdout
    _assert_ok(p)
    assert "got SIGTERM" in out
    k = records(run)[-1]["step"]
    assert 3 <= k < 500
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(k)
    # resume under a time limit that has already passed: one step, save, exit 0
    p = train(run, "train.train_iters=500", "checkpoint.interval=0", "train.exit_after_minutes=0.0001")
    _assert_ok(p)
    assert "time limit" in p.stdout
    steps = [r["step"] for r in records(run)]
    assert steps == list(range(1, k + 2))  # continues at k+1, nothing logged twice
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(k + 1)


def test_refuses_incompatible_and_missing(runs, tmp_path):
    ck = runs["A"] / "checkpoints" / f"iter_{2 * N:07d}"
    p, p_missing = side_by_side(
        lambda: train(tmp_path / "D", f"train.train_iters={2 * N + 2}", f"optim.lr_decay_iters={2 * N}",
                      "model.vocab_size=640", f"checkpoint.load={ck}"),
        lambda: train(tmp_path / "E", "train.train_iters=2", f"checkpoint.load={tmp_path / 'nowhere'}"))
    assert p.returncode == 2, p.stderr[-2000:]
    err = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "vocab size differs" in err[0] and "[512, 256]" in err[0] and "[640, 256]" in err[0], p.stderr[-2000:]
    assert not (tmp_path / "D" / "metrics.jsonl").exists() or not records(tmp_path / "D")
    p = p_missing
    assert p.returncode == 2 and "no such checkpoint" in p.stderr and "refusing to start from scratch" in p.stderr


def _errors(p: subprocess.CompletedProcess) -> list[str]:
    return [x for x in p.stderr.splitlines() if x.startswith("error:")]


def test_resume_refuses_another_schedule_other_data_or_a_step_past_the_end(runs, tmp_path):
    ck = runs["A"] / "checkpoints" / f"iter_{2 * N:07d}"  # A: 2N steps, schedule over 2N steps
    longer, data, past = side_by_side(
        lambda: train(tmp_path / "L", f"train.train_iters={2 * N + 2}", f"checkpoint.load={ck}"),
        lambda: train(tmp_path / "S", f"train.train_iters={2 * N + 2}", f"optim.lr_decay_iters={2 * N}",
                      "train.seq_length=32", "seed=7", f"checkpoint.load={ck}"),
        lambda: train(tmp_path / "P", f"train.train_iters={2 * N - 1}", f"checkpoint.load={ck}"))
    for p, name in ((longer, "L"), (data, "S"), (past, "P")):
        assert p.returncode == 2 and len(_errors(p)) == 1, p.stderr[-2000:]
        assert not (tmp_path / name / "metrics.jsonl").exists()  # refused before any work
    err = _errors(longer)[0]  # a longer run decays over other steps: refused, naming both ways on
    assert f"decay steps (optim.lr_decay_iters, else train.train_iters) {2 * N} -> {2 * N + 2}" in err, err
    assert "optim.override_scheduler=true" in err and f"optim.lr_decay_iters={2 * N}" in err, err
    err = _errors(data)[0]
    assert "train.seq_length 64 -> 32" in err and "seed 1234 -> 7" in err and "checkpoint.allow_data_change=true" in err
    assert "LR schedule" not in err  # the pinned decay keeps the checkpoint's schedule
    assert f"is at step {2 * N}, past train.train_iters={2 * N - 1}" in _errors(past)[0]


def test_resume_extends_on_its_schedule_or_follows_the_new_one_when_told(runs, tmp_path):
    ck = runs["A"] / "checkpoints" / f"iter_{2 * N:07d}"
    n = 2 * N + 2
    pinned, override, fresh, moved = side_by_side(
        lambda: train(tmp_path / "X", f"train.train_iters={n}", f"optim.lr_decay_iters={2 * N}", f"checkpoint.load={ck}"),
        lambda: train(tmp_path / "Y", f"train.train_iters={n}", "optim.lr=2e-3", "optim.override_scheduler=true",
                      f"checkpoint.load={ck}"),
        lambda: train(tmp_path / "Z", f"train.train_iters={n}", "optim.lr=2e-3", "checkpoint.interval=0"),
        lambda: train(tmp_path / "W", f"train.train_iters={2 * N + 1}", f"optim.lr_decay_iters={2 * N}",
                      "train.seq_length=32", "checkpoint.allow_data_change=true", f"checkpoint.load={ck}"))
    for p in (pinned, override, fresh, moved):
        _assert_ok(p)
    lr_a = {r["step"]: r["lr"] for r in records(runs["A"])}
    lr_x = {r["step"]: r["lr"] for r in records(tmp_path / "X")}
    assert sorted(lr_x) == [2 * N + 1, n] and lr_x[2 * N + 1] == lr_x[n] == 1e-5  # past the decay: optim.min_lr
    # the override continues on the new schedule: the lr an uninterrupted run of that schedule has at those steps
    assert f"resuming step {2 * N} on this config's LR schedule (optim.override_scheduler=true)" in override.stdout
    lr_y = {r["step"]: r["lr"] for r in records(tmp_path / "Y")}
    lr_z = {r["step"]: r["lr"] for r in records(tmp_path / "Z")}
    assert sorted(lr_y) == [2 * N + 1, n] and all(lr_y[s] == lr_z[s] for s in lr_y), (lr_y, lr_z)
    assert lr_y[2 * N + 1] != lr_a[2 * N]
    assert "on changed training data (checkpoint.allow_data_change=true)" in moved.stdout
    assert "train.seq_length 64 -> 32" in moved.stdout
    (rec,) = records(tmp_path / "W")
    assert rec["step"] == 2 * N + 1 and rec["consumed_samples"] == (2 * N + 1) * 4


def test_distributed_optimizer_resume_is_bitwise_identical(tmp_path):
    """parallel.use_distributed_optimizer=true (dp_reshardable optimizer state): 2 steps + resume == 4 steps."""
    a, b = tmp_path / "A", tmp_path / "B"
    dist_opt = ["parallel.use_distributed_optimizer=true", "train.train_iters=4", "checkpoint.keep_last=0"]
    _assert_ok(train(a, *dist_opt, "checkpoint.interval=2"))
    _assert_ok(train(b, *dist_opt, "checkpoint.interval=0", f"checkpoint.load={a / 'checkpoints' / 'iter_0000002'}"))
    la, lb = losses(a), losses(b)
    assert sorted(lb) == [3, 4] and all(la[s] == lb[s] for s in lb), (la, lb)
    ta = ckpt_tensors(a / "checkpoints" / "iter_0000004", tmp_path)
    tb = ckpt_tensors(b / "checkpoints" / "iter_0000004", tmp_path)
    keys = sorted(k for k, v in ta.items() if isinstance(v, torch.Tensor))
    assert any("exp_avg_sq" in k for k in keys)
    # Model weights after step 4 are bitwise equal. They depend on Adam's m, v and step after step 3, so
    # the optimizer state was restored exactly. (The optimizer buckets themselves are not compared: the
    # dp_reshardable format stores the buckets' intra-parameter padding, which is uninitialised memory.)
    model_keys = [k for k in keys if not k.startswith("optimizer.")]
    assert model_keys and any(k.endswith("expert_bias") for k in model_keys)
    for k in model_keys:
        assert torch.equal(ta[k], tb[k]), k


def test_stale_lock_of_killed_trainer_is_taken_over(runs):
    assert "taking over a stale lock" in runs["pb2"].stdout and "that process is gone" in runs["pb2"].stdout
    assert not (runs["B"] / ".nano_hybrid.lock").exists()  # released at the clean exit


def _flip(path: Path, offset: int, n: int = 4096) -> None:
    """Invert ``n`` bytes in place (same size: only a checksum notices)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def test_corrupt_shard_auto_falls_back_and_explicit_load_refuses(runs, tmp_path):
    import shutil

    run = tmp_path / "F"
    shutil.copytree(runs["B"] / "checkpoints", run / "checkpoints")
    newest = run / "checkpoints" / f"iter_{2 * N:07d}"
    shard = sorted(newest.glob("*.distcp"))[0]
    _flip(shard, shard.stat().st_size // 2)
    # an explicit path: one line naming the file, nothing loaded
    p = train(tmp_path / "G", f"train.train_iters={2 * N}", f"checkpoint.load={newest}")
    assert p.returncode == 2, p.stderr[-2000:]
    err = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and str(shard) in err[0] and "checksum mismatch" in err[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    # auto: the corrupt checkpoint is set aside (kept), the previous one loads, the curve is the uninterrupted one
    p = train(run, f"train.train_iters={2 * N}", "checkpoint.interval=0")
    _assert_ok(p)
    assert "fails verification" in p.stdout and f"loaded {run / 'checkpoints' / f'iter_{N:07d}'}" in p.stdout
    kept = run / "checkpoints" / "corrupt" / newest.name
    assert (kept / shard.name).is_file() and (kept / shard.name).stat().st_size == (newest / shard.name).stat().st_size
    assert "checksum mismatch" in (kept / "WHY.txt").read_text()
    la, lf = losses(runs["A"]), losses(run)
    assert sorted(lf) == list(range(N + 1, 2 * N + 1)) and all(lf[s] == la[s] for s in lf), (la, lf)


def test_damaged_files_are_one_line_naming_them(runs, tmp_path):
    import shutil

    src = runs["B"] / "checkpoints" / f"iter_{N:07d}"
    cases = {
        "common.pt": lambda d: (d / "common.pt").write_bytes((d / "common.pt").read_bytes()[:100]),
        "rng/rank_00000.pt": lambda d: (d / "rng" / "rank_00000.pt").unlink(),
        "nano_hybrid_checkpoint.json": lambda d: (d / "nano_hybrid_checkpoint.json").write_text('{"format": "nano-hy'),
    }
    expect = {"common.pt": "truncated", "rng/rank_00000.pt": "missing", "nano_hybrid_checkpoint.json": "unreadable"}
    damaged = {}
    for name, damage in cases.items():
        d = tmp_path / name.replace("/", "_") / src.name
        shutil.copytree(src, d)
        damage(d)
        damaged[name] = d
    # one refused run per damaged checkpoint, side by side (each in its own run directory)
    procs = side_by_side(*[partial(train, tmp_path / f"H{i}", "train.train_iters=2", f"checkpoint.load={d}")
                           for i, d in enumerate(damaged.values())])
    for (name, d), p in zip(damaged.items(), procs):
        err = [x for x in p.stderr.splitlines() if x.startswith("error:")]
        assert p.returncode == 2 and len(err) == 1, (name, p.stderr[-2000:])
        assert str(d / name) in err[0] and expect[name] in err[0], err
        assert "Traceback" not in p.stderr
