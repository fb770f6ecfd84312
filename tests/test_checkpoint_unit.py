"""nano_hybrid.checkpoint in-process (gloo, world size 1): layout, atomic publication, pruning, refusal, RNG.

The end-to-end resume behaviour (bitwise losses, SIGKILL during save, SIGTERM, W&B) is in
tests/test_checkpoint_resume.py; this file checks the module's mechanics on a small Megatron module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
import random
import tempfile

import numpy as np
import pytest
import torch

from nano_hybrid import checkpoint as ck


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
class State:  # the shape of nano_hybrid.train.TrainState
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
