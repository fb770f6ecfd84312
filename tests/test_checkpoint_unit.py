"""nano_hybrid.checkpoint in-process (gloo, world size 1): layout, atomic publication, pruning, refusal, RNG.

The end-to-end resume behaviour (bitwise losses, SIGKILL during save, SIGTERM, W&B) is in
tests/test_checkpoint_resume.py; this file checks the module's mechanics on a small Megatron module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
import random
import shutil
import tempfile

import numpy as np
import pytest
import torch

from nano_hybrid import checkpoint as ck
from nano_hybrid.checkpoint import mcore_io


@pytest.fixture(scope="module")
def dist_world1():
    from megatron.core import parallel_state as ps

    from nano_hybrid.mcore_compat import apply_mcore_compat, model_parallel_manual_seed

    apply_mcore_compat()
    created = False
    if not torch.distributed.is_initialized():
        store = tempfile.NamedTemporaryFile(delete=False).name
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        created = True
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(1234)
    yield
    if created:
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _model(vocab=32, hidden=8):
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    class Tiny(MegatronModule):
        def __init__(self):
            super().__init__(TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1))
            self.embedding = torch.nn.Embedding(vocab, hidden)
            self.proj = torch.nn.Linear(hidden, hidden, bias=False)
            self.register_buffer("expert_bias", torch.zeros(4))  # persistent, like the MoE router's

    return Tiny()


@dataclass
class State:  # the shape of nano_hybrid.trainer.TrainState
    step: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0


def _cfg(tmp_path, **kw):
    from omegaconf import OmegaConf

    c = {"dir": str(tmp_path / "ckpt"), "interval": 2, "keep_last": 2, "load": "auto", "save_on_exit": True}
    c.update(kw)
    return OmegaConf.create({"model": {"name": "unit"}, "checkpoint": c})


def test_save_load_roundtrip_layout_and_rng(dist_world1, tmp_path):
    cfg = _cfg(tmp_path)
    m = _model()
    with torch.no_grad():
        m.expert_bias.copy_(torch.tensor([0.5, -1.0, 2.0, 0.25]))
    c = ck.Checkpointer(cfg)
    assert c.resume(m, None, None, State()) is None  # nothing there yet: fresh start with load=auto
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    p = c.save(State(step=4, consumed_samples=32, consumed_tokens=8192), m, wandb_run_id="abc123")
    assert p == tmp_path / "ckpt" / "iter_0000004"
    assert (tmp_path / "ckpt" / ck.TRACKER_FILE).read_text() == "4\n"
    for f in (ck.META_FILE, "config.yaml", "common.pt", "metadata.json", "rng/rank_00000.pt"):
        assert (p / f).is_file(), f
    meta = json.loads((p / ck.META_FILE).read_text())
    assert meta["model_signature"]["embedding.weight"] == [32, 8]
    assert meta["model_signature"]["expert_bias"] == [4]  # the MoE expert bias is a checkpointed buffer
    expect = (random.random(), np.random.rand(), torch.rand(3))

    m2 = _model()
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    c2 = ck.Checkpointer(cfg)
    assert c2.resume_wandb_run_id == "abc123"  # known before anything is loaded (W&B starts early)
    state = State()
    loaded = c2.resume(m2, None, None, state)
    assert state == State(4, 32, 8192) and loaded.wandb_run_id == "abc123"
    c2.restore_rng()
    for k, v in m.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expect[0] and got[1] == expect[1] and torch.equal(got[2], expect[2])


def test_tracker_prune_and_incomplete(dist_world1, tmp_path):
    cfg = _cfg(tmp_path, keep_last=2)
    m = _model()
    c = ck.Checkpointer(cfg)
    for step in (2, 4, 6):
        assert c.maybe_save(State(step=step), m) is not None
    assert c.maybe_save(State(step=7), m) is None  # not an interval step
    assert c.save(State(step=6), m) is None  # just saved
    root = tmp_path / "ckpt"
    assert sorted(d.name for d in root.glob("iter_*")) == ["iter_0000004", "iter_0000006"]
    # a crash mid-save of step 8: data written, never published
    (root / "iter_0000008").mkdir()
    (root / "iter_0000008" / "common.pt").write_bytes(b"partial")
    assert ck.resolve_load_path("auto", root) == root / "iter_0000006"
    assert not (root / "iter_0000008").exists()  # cleaned on load
    # an explicit path must exist and be complete
    (root / "iter_0000010").mkdir()
    with pytest.raises(ck.CheckpointError, match="not a complete checkpoint.*refusing to start from scratch"):
        ck.resolve_load_path(str(root / "iter_0000010"), root)
    with pytest.raises(ck.CheckpointError, match="no such checkpoint"):
        ck.resolve_load_path(str(tmp_path / "nowhere"), root)
    assert ck.resolve_load_path(str(root), root) == root / "iter_0000006"  # a checkpoints dir: its tracker
    assert ck.resolve_load_path("none", root) is None


def test_refuses_incompatible(dist_world1, tmp_path):
    cfg = _cfg(tmp_path)
    ck.Checkpointer(cfg).save(State(step=2), _model(vocab=32))
    with pytest.raises(ck.CheckpointError, match=r"vocab size differs: embedding.weight is \[32, 8\] in the checkpoint but \[40, 8\]"):
        ck.Checkpointer(cfg).resume(_model(vocab=40), None, None, State())
    meta = ck.read_meta(tmp_path / "ckpt" / "iter_0000002")
    meta["model_signature"]["proj.weight"] = [8, 9]
    with pytest.raises(ck.CheckpointError, match=r"model shape differs: proj.weight is \[8, 9\] in the checkpoint"):
        ck.check_compatible(meta, _model(), None, tmp_path)
    meta = ck.read_meta(tmp_path / "ckpt" / "iter_0000002")
    meta["model_signature"]["decoder.layers.9.weight"] = [1]
    with pytest.raises(ck.CheckpointError, match="model structure differs"):
        ck.check_compatible(meta, _model(), None, tmp_path)


def test_exit_request_signal_and_time_limit():
    import os
    import signal
    import time

    from nano_hybrid.signals import ExitRequest

    before = signal.getsignal(signal.SIGTERM)
    with ExitRequest(exit_after_minutes=None) as req:
        assert req.should_exit() is None
        os.kill(os.getpid(), signal.SIGTERM)  # handled: sets the flag, the process keeps running
        assert req.should_exit() == "signal"
    assert signal.getsignal(signal.SIGTERM) is before  # handlers are restored on exit
    with ExitRequest(exit_after_minutes=0.5, start_time=time.monotonic() - 31) as req:
        assert req.should_exit() == "time limit"
    with ExitRequest(exit_after_minutes=0.5) as req:
        assert req.should_exit() is None
    with pytest.raises(ValueError, match="exit_after_minutes must be > 0"):
        ExitRequest(exit_after_minutes=0)
    with ExitRequest() as req:
        os.kill(os.getpid(), signal.SIGINT)
        assert req.should_exit() == "signal"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C stops at once


# ------------------------------------------------------------------------ integrity, save failures, guards
def _flip(path, offset, n=4096):
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def test_checksums_in_manifest_and_corruption_named(dist_world1, tmp_path):
    from nano_hybrid import integrity

    c = ck.Checkpointer(_cfg(tmp_path, keep_last=0))
    p = c.save(State(step=2), _model())
    meta = ck.read_meta(p)
    assert meta["checksum"] == integrity.ALGORITHM
    listed = set(meta["files"])
    assert {"common.pt", "metadata.json", ".metadata", "config.yaml", "rng/rank_00000.pt"} <= listed
    assert any(f.endswith(".distcp") for f in listed) and ck.META_FILE not in listed
    assert listed == set(integrity.list_files(p, exclude=(ck.META_FILE,)))
    ck.verify_checkpoint(p)  # intact
    shard = sorted(p.glob("*.distcp"))[0]
    _flip(shard, 0, 64)
    with pytest.raises(ck.CheckpointError, match=rf"{shard}: checksum mismatch in bytes 0-\d+ \(corrupt file\)"):
        ck.resolve_load_path(str(p), tmp_path / "ckpt")
    assert ck.resolve_load_path(str(p), tmp_path / "ckpt", verify=False) == p  # checkpoint.verify=false
    (p / "common.pt").write_bytes(b"x")
    with pytest.raises(ck.CheckpointError, match=r"common.pt: 1 bytes, the manifest says \d+ \(truncated"):
        ck.verify_checkpoint(p)


def test_auto_falls_back_past_corrupt_checkpoints_and_keeps_them(dist_world1, tmp_path, capsys):
    cfg = _cfg(tmp_path, keep_last=0)
    m = _model()
    c = ck.Checkpointer(cfg)
    for step in (2, 4, 6):
        c.save(State(step=step, consumed_samples=step), m)
    root = tmp_path / "ckpt"
    _flip(sorted((root / "iter_0000006").glob("*.distcp"))[0], 10)
    (root / "iter_0000004" / "rng" / "rank_00000.pt").unlink()
    c2 = ck.Checkpointer(cfg)
    assert c2.locate() == root / "iter_0000002"
    assert c2.resume_step == 2
    out = capsys.readouterr().out
    assert "fails verification" in out and "falling back" in out and "2 newer one(s) set aside in" in out
    assert sorted(d.name for d in (root / "corrupt").iterdir()) == ["iter_0000004", "iter_0000006"]
    assert "missing" in (root / "corrupt" / "iter_0000004" / "WHY.txt").read_text()
    assert (root / ck.TRACKER_FILE).read_text() == "2\n"
    assert sorted(d.name for d in root.glob("iter_*")) == ["iter_0000002"]
    # nothing verifies: an error, never a silent fresh start
    _flip(sorted((root / "iter_0000002").glob("*.distcp"))[0], 10)
    with pytest.raises(ck.CheckpointError, match="no checkpoint in .* verifies .*refusing to start from scratch"):
        ck.Checkpointer(cfg).locate()
    assert len(list((root / "corrupt").iterdir())) == 3  # kept, never deleted
    # the same command again: still refused (the tracker and corrupt/ show the run's progress), nothing moves
    with pytest.raises(ck.CheckpointError, match=r"holds no checkpoint that verifies, but its tracker names iteration 2 "
                                                 r"and .*corrupt holds 3 checkpoint\(s\).*checkpoint.load=none"):
        ck.Checkpointer(cfg).locate()
    assert len(list((root / "corrupt").iterdir())) == 3 and (root / ck.TRACKER_FILE).read_text() == "2\n"
    # an unreadable tracker in a folder with no checkpoint left: refused too (it is evidence of saved progress)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / ck.TRACKER_FILE).write_text("garbage\n")
    with pytest.raises(ck.CheckpointError, match="holds no checkpoint that verifies, but it had a tracker file"):
        ck.Checkpointer(_cfg(tmp_path, dir=str(bare))).locate()


def test_a_tracked_checkpoint_that_lost_its_manifest_is_set_aside_not_deleted(dist_world1, tmp_path, capsys):
    """The tracker is written after the manifest: an iter dir that the tracker names had completed, so without its
    manifest it moves to corrupt/ (the run falls back to the previous checkpoint, said); an untracked iter dir
    without one is a save that never completed and is deleted."""
    cfg = _cfg(tmp_path, keep_last=0)
    m = _model()
    c = ck.Checkpointer(cfg)
    for step in (2, 4):
        c.save(State(step=step, consumed_samples=step), m)
    root = tmp_path / "ckpt"
    (root / "iter_0000004" / ck.META_FILE).unlink()
    (root / "iter_0000006").mkdir()  # a save of step 6 that crashed before its manifest and the tracker
    (root / "iter_0000006" / "common.pt").write_bytes(b"partial")
    c2 = ck.Checkpointer(cfg)
    assert c2.locate() == root / "iter_0000002" and c2.resume_step == 2
    assert sorted(d.name for d in (root / "corrupt").iterdir()) == ["iter_0000004"]
    assert "the tracker names this step" in (root / "corrupt" / "iter_0000004" / "WHY.txt").read_text()
    assert (root / "corrupt" / "iter_0000004" / "common.pt").is_file()  # its files are kept
    assert not (root / "iter_0000006").exists()
    out = capsys.readouterr().out
    assert "iter_0000004" in out and "moved to" in out and "removing incomplete checkpoint" in out
    assert (root / ck.TRACKER_FILE).read_text() == "2\n"


@pytest.mark.parametrize("code", ["ENOSPC", "EIO", "EACCES"])
def test_failed_save_is_one_line_and_previous_checkpoint_loads(dist_world1, tmp_path, monkeypatch, code):
    import errno
    import os

    cfg = _cfg(tmp_path, keep_last=2)
    m = _model()
    c = ck.Checkpointer(cfg)
    c.save(State(step=2), m)
    real = mcore_io.write_state

    def disk_fails(ckpt, state):
        (ckpt / "__0_0.distcp").write_bytes(b"\0" * 1000)  # part of a shard, then the error
        n = getattr(errno, code)
        raise OSError(n, os.strerror(n), str(ckpt / "__0_0.distcp"))

    monkeypatch.setattr(mcore_io, "write_state", disk_fails)
    with pytest.raises(ck.CheckpointSaveError) as e:
        c.save(State(step=4), m)
    msg = str(e.value)
    assert "\n" not in msg and f"[{code}]" in msg and os.strerror(getattr(errno, code)) in msg
    assert "iter_0000002 stays the checkpoint that loads" in msg and e.value.exit_code == 1
    root = tmp_path / "ckpt"
    assert not (root / "iter_0000004").exists() and (root / ck.TRACKER_FILE).read_text() == "2\n"
    monkeypatch.setattr(mcore_io, "write_state", real)
    assert ck.Checkpointer(cfg).locate() == root / "iter_0000002"
    # torch.save on a full disk loses the errno ("unexpected pos ..."): the line says what the filesystem has
    monkeypatch.setattr(mcore_io, "write_state", lambda ckpt, state: (_ for _ in ()).throw(RuntimeError("unexpected pos 704 vs 598")))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: type("U", (), {"free": 5 * 2**20})())
    with pytest.raises(ck.CheckpointSaveError, match=r"RuntimeError: unexpected pos 704 vs 598; 5 MiB free .*disk full"):
        c.save(State(step=6), m)


def test_nonfinite_model_is_never_saved(dist_world1, tmp_path):
    m = _model()
    with torch.no_grad():
        m.proj.weight[0, 0] = float("nan")
    with pytest.raises(ck.CheckpointSaveError, match=r"refusing to save step 2: non-finite values in \['proj.weight'\]"):
        ck.Checkpointer(_cfg(tmp_path)).save(State(step=2), m)
    assert not list((tmp_path / "ckpt").glob("iter_*")) if (tmp_path / "ckpt").exists() else True


def test_extra_checkpoints_and_free_space(dist_world1, tmp_path, monkeypatch):
    from nano_hybrid import storage

    c = ck.Checkpointer(_cfg(tmp_path, interval=10, keep_last=2))
    assert c.extra_checkpoints(100) == 3  # keep_last + the one being written
    assert ck.Checkpointer(_cfg(tmp_path, interval=10, keep_last=0)).extra_checkpoints(100) == 10  # keeps all
    assert ck.Checkpointer(_cfg(tmp_path, interval=0, keep_last=2)).extra_checkpoints(100) == 1  # final save only
    m = _model()  # 32*8 + 8*8 + 4 = 324 numbers
    one = storage.checkpoint_bytes(ck.model_signature(m), 4)
    assert one == int(324 * 12 * storage.MARGIN)
    assert storage.checkpoint_bytes(ck.model_signature(m), 2) == int(324 * 14 * storage.MARGIN)  # bf16 + fp32 main
    monkeypatch.setattr(storage, "free_bytes", lambda p: 3 * one - 1)
    with pytest.raises(storage.StorageError, match=r"checkpoint.dir .*: 0.0 GB free, this run needs about .*3 more checkpoint"):
        c.check_free_space(m, object(), 100)
    monkeypatch.setattr(storage, "free_bytes", lambda p: 3 * one)
    assert c.check_free_space(m, object(), 100) == one


def test_writable_probe(tmp_path, monkeypatch):
    import os

    from nano_hybrid import storage

    storage.check_writable(tmp_path / "a" / "b", "run_dir")
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())
    (tmp_path / "file").write_text("x")
    with pytest.raises(storage.StorageError, match=r"run_dir .*/file/run is not writable: .*\[(ENOTDIR|EEXIST)\]"):
        storage.check_writable(tmp_path / "file" / "run", "run_dir")
    real_open = os.open

    def denied(path, flags, *a):
        if "write_probe" in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(storage.StorageError, match=r"checkpoint.dir .* is not writable: Permission denied \[EACCES\]"):
        storage.check_writable(tmp_path / "ck", "checkpoint.dir")


def test_run_lock_exclusive_stale_and_released(tmp_path):
    import json
    import subprocess
    import sys

    from nano_hybrid.runlock import LOCK_FILE, RunLock, RunLockError

    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from nano_hybrid.runlock import RunLock; RunLock(sys.argv[1]).acquire(); "
        "print('locked', flush=True); time.sleep(60)"), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockError, match=rf"run_dir {tmp_path} is in use by pid {holder.pid} on "):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    # the killed holder's file is still there (kill -9: no clean-up); the next trainer takes it over
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid
    said = []
    lock = RunLock(tmp_path, log=said.append).acquire()
    assert lock.stale["pid"] == holder.pid and "stale lock" in said[0]
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_settings_check():
    from omegaconf import OmegaConf

    from nano_hybrid.config import ConfigError

    base = {"dir": "ck", "interval": 2, "keep_last": None, "load": "auto", "save_on_exit": True, "verify": True,
            "check_free_space": True}
    ck.check_settings(OmegaConf.create(base))
    for bad, msg in [({"interval": "often"}, "checkpoint.interval='often' must be a whole number or null"),
                     ({"keep_last": True}, "checkpoint.keep_last=True must be a whole number or null"),
                     ({"verify": "yes"}, "checkpoint.verify='yes' must be true or false"),
                     ({"check_free_space": None}, "checkpoint.check_free_space=None must be true or false"),
                     ({"dir": ""}, "checkpoint.dir is empty"),
                     ({"keep_last": -1}, r"checkpoint.interval \(2\) and keep_last \(-1\) must be >= 0")]:
        with pytest.raises(ConfigError, match=msg):
            ck.check_settings(OmegaConf.create({**base, **bad}))
