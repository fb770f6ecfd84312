"""scripts/backend_loss_match.py: the same model=tiny training run per kernel backend, losses compared.

CPU: torch vs helion (Helion interpret mode; tests/conftest.py sets HELION_INTERPRET=1 and the
aten::mm.dtype shim) for a few steps at a tiny shape, within the fp32 tolerance, plus a torch A-vs-A
arm that must match bitwise (the harness itself adds no difference); every arm's model, optimizer and
grad buffer are freed before the next arm builds; arms with settings (LM head + loss, fused AdamW).
GPU: the 50-step bf16 run.
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import weakref

import pytest
import torch

from nano_hybrid.bench import backend_loss_match as blm

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"

CPU = not torch.cuda.is_available()


# ---------------------------------------------------------------------------------------- units
def test_args():
    a = blm.parse_args(["--backends", "torch,helion,torch", "--steps", "3", "train.seq_length=32"])
    assert a.arms == ["torch", "helion", "torch"] and a.steps == 3 and a.overrides == ["train.seq_length=32"]
    for bad in (["--backends", "torch"], ["--steps", "0"], ["--max-rtol", "-1"], ["--bogus"]):
        with pytest.raises(SystemExit):
            blm.parse_args(bad)


def test_compare_losses_and_verdict():
    ref = [6.0, 4.0, 2.0]
    c = blm.compare_losses(ref, [6.0, 4.0, 2.0])
    assert c["bitwise_equal"] and c["max_rel_diff"] == 0 and c["max_abs_diff"] == 0
    c = blm.compare_losses(ref, [6.0, 4.04, 1.99])
    assert not c["bitwise_equal"]
    assert c["max_abs_diff"] == pytest.approx(0.04) and c["mean_abs_diff"] == pytest.approx(0.05 / 3)
    assert c["max_rel_diff"] == pytest.approx(0.01) and c["step_of_max_rel_diff"] == 2
    assert c["mean_rel_diff"] == pytest.approx((0.01 + 0.005) / 3)
    assert c["first_step_rel_diff"] == 0 and c["last_step_rel_diff"] == pytest.approx(0.005)
    tol = {"mean_rtol": 1e-2, "max_rtol": 3e-2}
    assert blm.verdict(c, tol)
    assert not blm.verdict(c, {"mean_rtol": 1e-2, "max_rtol": 5e-3})  # the max gate bites
    assert not blm.verdict(c, {"mean_rtol": 1e-3, "max_rtol": 3e-2})  # the mean gate bites
    assert not blm.verdict(blm.compare_losses(ref, [6.0, math.nan, 2.0]), tol)  # NaN never passes
    with pytest.raises(ValueError):
        blm.compare_losses(ref, ref[:2])


def test_tolerances_by_dtype():
    a = blm.parse_args([])
    assert blm.tolerances(a, "float32")["max_rtol"] < blm.tolerances(a, "bfloat16")["max_rtol"]
    a = blm.parse_args(["--mean-rtol", "0.5"])
    t = blm.tolerances(a, "bfloat16")
    assert t["mean_rtol"] == 0.5 and t["max_rtol"] == blm.TOLERANCES["bfloat16"]["max_rtol"]


def test_unknown_backend_fails_before_work(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPTS / "backend_loss_match.py"), "--backends", "torch,nope",
                        "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "error:" in r.stderr and "nope" in r.stderr, r.stderr[-2000:]
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------- CPU training run
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from nano_hybrid.data import stdlib_sources, write_indexed_dataset

    path = tmp_path_factory.mktemp("corpus") / "stdlib20"
    write_indexed_dataset(stdlib_sources()[:20], path)
    return path


class BuildTracker:
    """Wraps ``nano_hybrid.trainer.build_model_and_optimizer``: weak references to what each call returns (the
    Megatron DDP model, the optimizer, the first grad buffer) and, at each call after a gc, which of the
    earlier calls' objects are still alive."""

    def __init__(self, build):
        self.build, self.built, self.alive_at_build = build, [], []

    def alive(self) -> list[str]:
        gc.collect()
        return [f"build {i} {what}" for i, refs in enumerate(self.built) for what, r in refs.items() if r() is not None]

    def __call__(self, *args, **kw):
        self.alive_at_build.append(self.alive())
        model, optimizer, scheduler = self.build(*args, **kw)
        self.built.append({"model": weakref.ref(model), "optimizer": weakref.ref(optimizer),
                           "grad buffer": weakref.ref(model.buffers[0].grad_data)})
        return model, optimizer, scheduler


@pytest.fixture(scope="module")
def cpu_result(tmp_path_factory, corpus):
    """One process, three arms: torch (reference), helion (interpret mode), torch again (A-vs-A); every
    model built (setup()'s and each arm's) is tracked."""
    from nano_hybrid import trainer as T

    out = tmp_path_factory.mktemp("out")
    tracker = BuildTracker(T.build_model_and_optimizer)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(T, "build_model_and_optimizer", tracker)
        rc = blm.main([
            "--backends", "torch,helion,torch", "--steps", "4", "--out", str(out), "--quiet",
            "model=tiny", "train.device=cpu", f"data.paths=[{corpus}]", "data.prepare_if_missing=null",
            "train.seq_length=64", "train.micro_batch_size=1", "train.global_batch_size=1",
            f"run_dir={tmp_path_factory.mktemp('run')}",
        ])
    files = list(out.glob("backend_loss_match_tiny_torch_vs_helion_vs_torch2_float32.json"))
    assert len(files) == 1, list(out.iterdir())
    return rc, json.loads(files[0].read_text()), tracker


@pytest.mark.skipif(not CPU, reason="CPU (fp32, Helion interpret mode) run")
def test_cpu_torch_vs_helion_losses_match(cpu_result):
    rc, d, _ = cpu_result
    assert d["config"]["dtype"] == "float32" and d["config"]["device"] == "cpu"
    assert d["tolerance"]["max_rtol"] == blm.TOLERANCES["float32"]["max_rtol"]
    c = d["comparisons"]["helion_vs_torch"]
    assert c["pass"] and c["all_finite"], c
    assert c["max_rel_diff"] <= blm.TOLERANCES["float32"]["max_rtol"], c
    assert math.isfinite(c["final_weights_max_abs_diff"]) and not c["final_weights_bitwise_equal"], c  # really two backends
    losses = d["per_arm"]["helion"]["loss"]
    assert len(losses) == 4 and 5.5 < losses[0] < 7.0  # ~ln(512): a real model=tiny run at init
    assert rc == 0 and d["pass"]


@pytest.mark.skipif(not CPU, reason="CPU (fp32) run")
def test_cpu_torch_vs_torch_is_bitwise(cpu_result):
    _, d, _ = cpu_result
    c = d["comparisons"]["torch#2_vs_torch"]
    assert c["bitwise_equal"] and c["max_abs_diff"] == 0, c
    assert c["final_weights_bitwise_equal"] and c["final_weights_max_abs_diff"] == 0, c
    assert d["per_arm"]["torch"]["grad_norm"] == d["per_arm"]["torch#2"]["grad_norm"]


@pytest.mark.skipif(not CPU, reason="CPU run")
def test_cpu_result_json_records_env_and_shapes(cpu_result):
    _, d, _ = cpu_result
    env = d["env"]
    for k in ("date_utc", "torch", "helion", "megatron_core", "python", "git_commit"):
        assert k in env, k
    assert env["gpu"] is None
    assert d["shapes"]["tokens_per_microbatch"] == [1, 64] and d["config"]["num_microbatches"] == 1
    assert d["shapes"]["mamba"]["d_inner"] == 256 and d["shapes"]["mamba"]["chunk_size"] == 64
    assert d["config"]["n_params"] > 3e6 and d["steps"] == 4 and d["arms"] == ["torch", "helion", "torch#2"]
    for arm in d["arms"]:
        assert len(d["per_arm"][arm]["loss"]) == 4 and d["per_arm"][arm]["skipped"] == [0] * 4


@pytest.mark.skipif(not CPU, reason="CPU run")
def test_cpu_each_arm_is_freed_before_the_next_arm_builds(cpu_result):
    """An arm's model, optimizer and grad buffer are gone (weak references dead after a gc) when the next arm
    builds, and nothing built is alive after the run: one process holds one model at a time."""
    _, d, tracker = cpu_result
    assert len(tracker.built) == 1 + len(d["arms"])  # setup()'s model, then one per arm
    assert tracker.alive_at_build == [[]] * len(tracker.built), tracker.alive_at_build
    assert tracker.alive() == []


@pytest.mark.skipif(not CPU, reason="CPU (fp32) run")
def test_cpu_arms_with_settings(tmp_path, corpus):
    """Arms that differ in settings only (plain LM head + torch's default AdamW vs the chunked head + fused
    AdamW): the same math in another order, within the fp32 tolerance; each arm's settings are recorded."""
    out = tmp_path / "out"
    rc = blm.main([
        "--backends", "torch:model.lm_head_loss=plain:optim.fused=false,torch:model.lm_head_loss=chunked:optim.fused=true",
        "--steps", "3", "--out", str(out), "--quiet", f"data.paths=[{corpus}]", "data.prepare_if_missing=null",
        f"run_dir={tmp_path / 'run'}",
    ])
    files = list(out.glob("backend_loss_match_tiny_*_float32.json"))
    assert len(files) == 1, list(out.iterdir())
    d = json.loads(files[0].read_text())
    ref, other = "torch+lm_head_loss-plain+fused-false", "torch+lm_head_loss-chunked+fused-true"
    assert d["arms"] == [ref, other] and d["reference"] == ref
    assert d["per_arm"][ref]["settings"] == {"model.lm_head_loss": "plain", "optim.fused": False}
    assert d["per_arm"][other]["settings"] == {"model.lm_head_loss": "chunked", "optim.fused": True}
    assert d["per_arm"][ref]["backend"] == d["per_arm"][other]["backend"] == "torch"
    assert d["config"]["model"] == "tiny" and d["config"]["dtype"] == "float32"
    assert d["shapes"]["tokens_per_microbatch"] == [2, 64]  # the script's CPU defaults
    c = d["comparisons"][f"{other}_vs_{ref}"]
    losses = {arm: d["per_arm"][arm]["loss"] for arm in d["arms"]}
    assert all(len(v) == 3 for v in losses.values()) and 5.5 < losses[ref][0] < 7.0
    assert losses[ref][0] == losses[other][0], losses  # step 1: the same weights, loss computed in fp32 either way
    assert c["all_finite"] and c["pass"], c
    assert c["max_rel_diff"] <= blm.TOLERANCES["float32"]["max_rtol"], c
    assert rc == 0 and d["pass"]


def test_arm_with_a_key_that_cannot_switch_is_a_usage_error(tmp_path, capsys):
    """Only ab_step_time.SWITCHABLE keys: anything else (here a model architecture key) is argparse's exit 2."""
    with pytest.raises(SystemExit) as e:
        blm.main(["--backends", "torch,torch:model.hidden_size=128", "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "model.hidden_size=128" in err and "model.lm_head_loss" in err, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("arm,msg", [
    ("torch:optim.fused=maybe", "optim.fused='maybe' must be true or false"),
    ("torch:model.lm_head_loss=bogus", "model.lm_head_loss='bogus'; choose one of"),
    ("torch:model.lm_loss_chunk_tokens=0", "model.lm_loss_chunk_tokens=0 must be a positive integer"),
])
def test_arm_with_a_bad_setting_value_fails_before_work(tmp_path, corpus, capsys, arm, msg):
    out = tmp_path / "out"
    rc = blm.main(["--backends", f"torch,{arm}", "--steps", "1", "--out", str(out), f"data.paths=[{corpus}]",
                   "data.prepare_if_missing=null", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2 and f"error: arm torch+" in err and msg in err, err
    assert not out.exists() and not (tmp_path / "run").exists()


@pytest.mark.skipif(not CPU, reason="CPU (fp32) run")
def test_cpu_tolerance_catches_a_slightly_wrong_kernel(monkeypatch, tmp_path):
    """Negative control: a backend whose fused Mamba op output is 1% too large must FAIL the fp32 tolerance.

    Measured (3 steps, seq 64): 1% -> max rel loss diff ~1e-4 (fails); 0.1% -> ~7e-7 (passes: the mixer's
    output is small next to the residual stream at init, so this harness only sees errors of ~1% and up)."""
    import dataclasses

    from kernels import registry

    def off_backend():
        ref = registry.get_backend("torch")

        def op(*args, **kw):
            return ref.mamba_split_conv1d_scan_combined(*args, **kw) * 1.01

        return dataclasses.replace(ref, name="torch_off", mamba_split_conv1d_scan_combined=op)

    monkeypatch.setitem(registry._FACTORIES, "torch_off", off_backend)
    monkeypatch.delitem(registry._CACHE, "torch_off", raising=False)
    from nano_hybrid.data import stdlib_sources, write_indexed_dataset

    corpus = tmp_path / "stdlib20"
    write_indexed_dataset(stdlib_sources()[:20], corpus)
    rc = blm.main([
        "--backends", "torch,torch_off", "--steps", "3", "--out", str(tmp_path / "out"), "--quiet",
        "model=tiny", "train.device=cpu", f"data.paths=[{corpus}]", "data.prepare_if_missing=null",
        "train.seq_length=64", "train.micro_batch_size=1", "train.global_batch_size=1", f"run_dir={tmp_path / 'run'}",
        "data.split=\"100,0,0\"",  # the batches the measurement above used (the effect size depends on them)
    ])
    d = json.loads((tmp_path / "out" / "backend_loss_match_tiny_torch_vs_torch_off_float32.json").read_text())
    c = d["comparisons"]["torch_off_vs_torch"]
    assert rc == 1 and not d["pass"] and not c["pass"], c
    assert c["max_rel_diff"] > blm.TOLERANCES["float32"]["max_rtol"], c


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
def test_gpu_torch_vs_helion_50_steps_bf16(tmp_path):
    """model=tiny, 50 steps, bf16, helion's loss within the bf16 tolerance of torch's."""
    env = dict(os.environ, OUT=str(tmp_path))
    r = subprocess.run([sys.executable, str(SCRIPTS / "backend_loss_match.py"), "--backends", "torch,helion",
                        "--steps", "50", "--quiet"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    files = list(tmp_path.glob("backend_loss_match_tiny_torch_vs_helion_bfloat16.json"))
    assert len(files) == 1, r.stdout[-3000:] + r.stderr[-3000:]
    d = json.loads(files[0].read_text())
    c = d["comparisons"]["helion_vs_torch"]
    assert d["config"]["dtype"] == "bfloat16" and d["steps"] == 50
    assert c["all_finite"] and c["pass"], c
    assert r.returncode == 0, r.stderr[-3000:]
