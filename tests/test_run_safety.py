"""Long runs that cannot be poisoned, end to end on CPU (``python -m nano_hybrid.train``, model=tiny, mock data):

- a NaN step skips its update, is logged ``skipped``, is never checkpointed, and ``train.max_skipped_steps``
  consecutive skips stop the run with one line and the last good checkpoint intact;
- storage: an unwritable run dir, too little free space for the checkpoints, a save that fails (ENOSPC)
  -> one line; the failed save leaves the previous checkpoint as the one that loads;
- a second trainer on a run dir in use refuses with one line naming the first;
- a typo'd data path is an error, not a new corpus; metrics.jsonl truncation on resume (unit);
- under torchrun the one error line reaches torchrun's failure summary.

Faults (a full disk) are injected by tests/hooked_train.py, never by the product code.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from functools import partial

import pytest
import torch

from side_by_side import side_by_side
from test_checkpoint_resume import COMMON, REPO, _env, ckpt_tensors, records, train


def _errors(p) -> list[str]:
    return [x for x in p.stderr.splitlines() if x.startswith("error:")]


def _one_error(p, rc: int, *needles: str) -> str:
    err = _errors(p)
    assert p.returncode == rc and len(err) == 1, f"rc={p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


def test_nan_steps_skip_update_never_checkpointed_and_stop(tmp_path):
    run = tmp_path / "nan"
    # lr 1e3: steps 1-2 are finite, from step 3 on the loss and the gradient norm are NaN
    p = train(run, "optim.lr=1e3", "train.train_iters=8", "train.max_skipped_steps=2", "checkpoint.interval=1",
              "checkpoint.keep_last=0")
    _one_error(p, 1, "2 consecutive steps skipped", "train.max_skipped_steps=2", "last checkpoint is intact")
    recs = records(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert [r["skipped"] for r in recs] == [0, 0, 1, 1]
    assert all(not math.isfinite(r["grad_norm"]) or not math.isfinite(r["loss"]) for r in recs[2:])
    ck = run / "checkpoints"
    assert sorted(d.name for d in ck.glob("iter_*")) == ["iter_0000001", "iter_0000002"]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    tensors = ckpt_tensors(ck / "iter_0000002", tmp_path)
    assert tensors and all(torch.isfinite(v).all() for v in tensors.values() if isinstance(v, torch.Tensor) and v.is_floating_point())


def test_unwritable_dirs_and_too_little_space_refused_before_work(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cmd = [sys.executable, "-m", "nano_hybrid.train", *COMMON, f"run_dir={blocker / 'run'}", "train.train_iters=2"]
    # the three refused runs side by side; 1 MB free: a tiny-model checkpoint is ~45 MB, keep_last=2 needs room for 3
    p_run_dir, p_ck_dir, p_space = side_by_side(
        partial(subprocess.run, cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300),
        partial(train, tmp_path / "r2", "train.train_iters=2", f"checkpoint.dir={blocker / 'ck'}"),
        partial(train, tmp_path / "r3", "train.train_iters=4", "checkpoint.interval=1", hooked=True,
                env=_env(NANO_HYBRID_TEST_FREE_BYTES=str(10**6))))
    _one_error(p_run_dir, 2, f"run_dir {blocker / 'run'} is not writable", "[ENOTDIR]")
    _one_error(p_ck_dir, 2, f"checkpoint.dir {blocker / 'ck'} is not writable")
    assert not (tmp_path / "r2" / "metrics.jsonl").exists()
    _one_error(p_space, 2, "0.0 GB free, this run needs about 0.1 GB", "3 more checkpoint(s)", "checkpoint.keep_last=2")
    assert not (tmp_path / "r3" / "metrics.jsonl").exists()


def test_failed_save_is_one_line_and_previous_checkpoint_loads(tmp_path):
    run = tmp_path / "full"
    p = train(run, "train.train_iters=3", "checkpoint.interval=1", hooked=True,
              env=_env(NANO_HYBRID_TEST_SAVE_ERRNO="2:ENOSPC"))
    ck = run / "checkpoints"
    _one_error(p, 1, "saving checkpoint step 2", "No space left on device [ENOSPC]",
               f"{ck / 'iter_0000001'} stays the checkpoint that loads")
    assert sorted(d.name for d in ck.glob("iter_*")) == ["iter_0000001"]
    p = train(run, "train.train_iters=3", "checkpoint.interval=1")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"loaded {ck / 'iter_0000001'} (step 1" in p.stdout
    assert [r["step"] for r in records(run)] == [1, 2, 3]


def test_second_trainer_on_a_run_dir_refuses(tmp_path):
    run = tmp_path / "shared"
    first = subprocess.Popen(
        [sys.executable, "-m", "nano_hybrid.train", "model=tiny", "data=mock", "kernels.backend=torch",
         "train.seq_length=64", "train.micro_batch_size=2", "train.global_batch_size=4", "optim.warmup_iters=1",
         "train.torch_threads=1", "train.train_iters=100000", "checkpoint.interval=0", "checkpoint.save_on_exit=false",
         f"run_dir={run}"],
        cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text():
            assert first.poll() is None and time.monotonic() < deadline, "first trainer did not start"
            time.sleep(0.2)
        p = train(run, "train.train_iters=3")
        _one_error(p, 2, f"run_dir {run} is in use by pid {first.pid}", "one trainer per run directory")
        assert first.poll() is None  # the first one trains on
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=120)
    steps = [r["step"] for r in records(run)]
    assert steps == list(range(1, len(steps) + 1))  # every step once: the second trainer logged nothing


def test_typo_data_path_is_an_error_not_a_new_corpus(tmp_path):
    typo = tmp_path / "data" / "stdlib" / "stdlbi"
    cmd = [sys.executable, "-m", "nano_hybrid.train", "model=tiny", f"data.paths=[{typo}]", f"run_dir={tmp_path / 'r'}"]
    p = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    _one_error(p, 2, f"data path not found: {typo}.bin/.idx", "default location")
    assert not typo.parent.exists() and not (tmp_path / "r").exists()


def test_metrics_truncated_to_the_resume_step(tmp_path):
    from nano_hybrid.metrics import MetricsLogger, truncate_records

    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in (1, 2, 3, 4, 5, 3, 4)) + '{"step": 5, "lo')
    said = []
    MetricsLogger(tmp_path, rank=0, train_iters=9, backend="torch", start_step=2,
                  print_fn=lambda m, **k: said.append(m)).close()
    assert [json.loads(x)["step"] for x in f.read_text().splitlines()] == [1, 2]
    assert said == ["metrics.jsonl: dropped 6 record(s) after step 2 (they are re-run from the checkpoint)"]
    assert truncate_records(f, 2) == 0 and truncate_records(tmp_path / "absent.jsonl", 0) == 0


def test_torchrun_error_is_one_line_per_job_and_named_in_the_summary(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "nano_hybrid.train", "parallel=dp2", "data=mock", "model=tiny", "kernels.backend=torch",
           f"run_dir={tmp_path / 'r'}"]
    p = subprocess.run(cmd, cwd=REPO, env=_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    line = "error: train.global_batch_size=8 must be a multiple of train.micro_batch_size=8 x data-parallel size 2"
    assert p.returncode != 0
    ours = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert ours == [line], p.stderr[-3000:]  # rank 0 reports the config error every rank found
    assert "nano_hybrid/train.py" not in p.stderr
    summary = p.stderr[p.stderr.index("Root Cause"):]
    assert f"traceback : {line}" in summary, summary
    assert not (tmp_path / "r").exists()


def test_launcher_reports_one_line_before_and_after_the_workers_start(tmp_path):
    """python -m nano_hybrid.launch: a config error never starts a worker; a worker's error is its one line, without
    torchrun's failure summary; the exit code is the worker's."""
    base = [sys.executable, "-m", "nano_hybrid.launch", "--standalone", "--nproc-per-node", "2"]
    # the corpus for the second run: 3 documents leave the validation split empty
    from nano_hybrid.data.prepare import text_sources, write_indexed_dataset

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"d{i}.txt").write_text(f"document {i} " * 50)
    write_indexed_dataset(text_sources([docs]), tmp_path / "c" / "c", "byte")
    run = partial(subprocess.run, cwd=REPO, env=_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    p, p_data = side_by_side(
        partial(run, [*base, "parallel=dp2", "data=mock", "model=tiny", "kernels.backend=torch",
                      f"run_dir={tmp_path / 'r'}"]),
        partial(run, [*base, "parallel=dp2", "model=tiny", "kernels.backend=torch", "train.micro_batch_size=4",
                      f"data.paths=[{tmp_path / 'c' / 'c'}]", "data.prepare_if_missing=null", "train.eval_interval=2",
                      f"run_dir={tmp_path / 'r2'}"]))
    line = "error: train.global_batch_size=8 must be a multiple of train.micro_batch_size=8 x data-parallel size 2"
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [line], p.stderr[-3000:]
    assert not (tmp_path / "r").exists()
    # a data error found by the workers: one line, exit 2
    p = p_data
    ours = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert p.returncode == 2 and len(ours) == 1 and "validation split" in ours[0], p.stderr[-3000:]
    assert "ChildFailedError" not in p.stderr and "Traceback" not in p.stderr and "Root Cause" not in p.stderr
    assert not (tmp_path / "r2").exists()


def test_sigterm_to_the_launcher_saves_and_exits_zero(tmp_path):
    """A scheduler's SIGTERM to python -m nano_hybrid.launch (only the launcher): torchrun passes it to the workers,
    which finish their step, save and stop; the launcher exits 0 without torchrun's signal traceback."""
    run_dir = tmp_path / "r"
    cmd = [sys.executable, "-m", "nano_hybrid.launch", "--standalone", "--nproc-per-node", "2", "parallel=dp2",
           *COMMON, "train.train_iters=100000", "checkpoint.interval=0", f"run_dir={run_dir}"]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(OMP_NUM_THREADS="1"), stdout=out, stderr=err, text=True,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            m = run_dir / "metrics.jsonl"
            while time.monotonic() < deadline and proc.poll() is None:
                if m.is_file() and len(m.read_text().splitlines()) >= 2:
                    break
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)  # the launcher alone
            rc = proc.wait(timeout=120)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    stdout, stderr = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert rc == 0, stderr[-3000:]
    assert "got SIGTERM" in stdout and "Traceback" not in stderr and "SignalException" not in stderr, stderr[-3000:]
    step = records(run_dir)[-1]["step"]
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(step)


def test_launcher_says_when_torchrun_killed_workers_that_did_not_stop(monkeypatch, capsys):
    """After a stop signal torchrun's agent waits for the workers, then kills those still running and logs it: the
    launcher then exits 1 with one line (the workers' own stop could not finish its checkpoint)."""
    import logging

    import torch.distributed.run as trun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from nano_hybrid import launch

    def run(args):
        log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
        log.warning("Unable to shutdown process %s via %s, forcefully exiting via %s", 123, signal.SIGTERM, "SIGKILL")
        raise SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)

    monkeypatch.setattr(trun, "run", run)
    monkeypatch.setattr(launch, "validate_for", lambda overrides, world: None)
    assert launch.main(["--standalone", "--nproc-per-node", "2", "model=tiny"]) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith("error: the launcher got SIGTERM and the workers did not stop"), err


@pytest.mark.parametrize("opts,needle", [
    (["--nproc-per-node", "abc"], "--nproc-per-node='abc': a positive number of workers, or one of auto, cpu, gpu"),
    (["--nproc-per-node", "0"], "--nproc-per-node='0': a positive number of workers"),
    (["--nnodes", "0", "--nproc-per-node", "2"], "--nnodes='0': a positive number of nodes"),
])
def test_launcher_refuses_bad_worker_counts_in_one_line_before_starting(opts, needle, monkeypatch, capsys):
    import torch.distributed.run as trun

    from nano_hybrid import launch

    started = []
    monkeypatch.setattr(trun, "run", lambda args: started.append(args))
    assert launch.main(["--standalone", *opts, "model=tiny", "kernels.backend=torch"]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith(f"error: {needle}"), err
    assert not started
