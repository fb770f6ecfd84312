"""End-to-end CPU training of model=tiny through ``python -m nano_hybrid.train`` (and torchrun, DP=2)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nano_hybrid.arch import HybridArch
from nano_hybrid.data import stdlib_sources, write_indexed_dataset
from nano_hybrid.flops import training_flops_per_token

REPO = Path(__file__).resolve().parent.parent
FIELDS = {"step", "tokens", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "tokens_per_s_per_gpu",
          "tflops_per_gpu", "mem_gb", "backend", "consumed_samples"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("corpus") / "stdlib40"
    write_indexed_dataset(stdlib_sources()[:40], prefix)
    return prefix


def run_train(args, timeout=300, launcher=None):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = (launcher or [sys.executable, "-m"]) + ["nano_hybrid.train", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def common(corpus, run_dir, iters):
    return [
        "model=tiny", "kernels=torch", "train.device=cpu", f"data.paths=[{corpus}]", "data.prepare_if_missing=null",
        "train.seq_length=64", "train.micro_batch_size=4", "train.global_batch_size=8", f"train.train_iters={iters}",
        "optim.lr=3e-3", "optim.warmup_iters=3", f"run_dir={run_dir}", "checkpoint.load=none",
        "checkpoint.interval=0", "checkpoint.save_on_exit=false", "train.log_interval=5",
    ]


def read_metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_tiny_cpu_training_loss_decreases(corpus, tmp_path):
    run_dir = tmp_path / "run"
    p = run_train(common(corpus, run_dir, 24))
    assert p.returncode == 0, p.stderr[-3000:]
    recs = read_metrics(run_dir)
    assert [r["step"] for r in recs] == list(range(1, 25))
    for r in recs:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["backend"] == "torch" and r["mem_gb"] > 0 and r["step_time_s"] > 0
    losses = [r["loss"] for r in recs]
    assert 5.5 < losses[0] < 7.0  # ~ln(512) at init
    assert sum(losses[-4:]) / 4 < sum(losses[:3]) / 3 - 1.5, losses
    assert recs[-1]["tokens"] == 24 * 8 * 64 and recs[-1]["consumed_samples"] == 24 * 8
    # MoE aux loss is tracked, the schedule warms up then decays (WSD) to min_lr
    assert "seq_load_balancing_loss" in recs[0]
    assert recs[0]["lr"] < recs[3]["lr"] and recs[-1]["lr"] == pytest.approx(1e-5)  # optim.min_lr of adamw_wsd
    # tflops_per_gpu uses the documented formula with the shape read from the built model
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())  # the resolved config the run wrote
    m = cfg["model"]
    arch = HybridArch(
        hybrid_override_pattern=m["hybrid_override_pattern"], hidden_size=m["hidden_size"], padded_vocab_size=512,
        mamba_num_heads=m["mamba_num_heads"], mamba_head_dim=m["mamba_head_dim"], mamba_state_dim=m["mamba_state_dim"],
        mamba_num_groups=m["mamba_num_groups"], mamba_conv_width=m["mamba_conv_width"],
        mamba_chunk_size=m["mamba_chunk_size"], num_attention_heads=m["num_attention_heads"],
        num_query_groups=m["num_query_groups"], kv_channels=m["kv_channels"], num_moe_experts=m["num_moe_experts"],
        moe_router_topk=m["moe_router_topk"], moe_ffn_hidden_size=m["moe_ffn_hidden_size"],
        moe_shared_expert_intermediate_size=m["moe_shared_expert_intermediate_size"], ffn_hidden_size=m["ffn_hidden_size"],
    )
    r = recs[-1]
    assert r["tflops_per_gpu"] == pytest.approx(training_flops_per_token(arch, 64) * r["tokens_per_s"] / 1e12, rel=1e-9)
    # resolved config; console lines with loss
    assert cfg["model"]["name"] == "tiny" and cfg["train"]["seq_length"] == 64 and cfg["run_dir"] == str(run_dir)
    assert "step 24/24" in p.stdout and "loss" in p.stdout


def test_torchrun_data_parallel_two_ranks(corpus, tmp_path):
    """Two gloo ranks, DP=2 with the distributed optimizer: one metrics file, global token counts."""
    run_dir = tmp_path / "dp2"
    args = common(corpus, run_dir, 3) + ["parallel=dp2", "train.micro_batch_size=2", "optim.warmup_iters=1"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    p = run_train(args, launcher=launcher)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = read_metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert recs[-1]["world_size"] == 2 and recs[-1]["tokens"] == 3 * 8 * 64
    assert recs[-1]["tokens_per_s_per_gpu"] == pytest.approx(recs[-1]["tokens_per_s"] / 2)
    assert "dp=2" in p.stdout


BIAS_SCRIPT = """
import sys
from nano_hybrid import runconfig, trainer as T
from nano_hybrid.config import compose

def main():
    cfg = compose(sys.argv[1:])
    plan = runconfig.validate(cfg)
    ctx = T.Trainer.build(cfg, plan)
    ctx.start_data()
    def biases():
        return [m.expert_bias.clone() for m in ctx.model.modules() if getattr(m, "expert_bias", None) is not None]
    before = biases()
    for _ in range(2):
        ctx.train_step()
    print("BIAS", len(before), max(float((a - b).abs().max()) for a, b in zip(before, biases())))
    T.shutdown(ctx)

if __name__ == "__main__":
    main()
"""


def test_router_expert_bias_updates_each_step(corpus, tmp_path):
    """finalize_model_grads (called by megatron's schedule) applies the aux-loss-free expert-bias update."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", BIAS_SCRIPT, *common(corpus, tmp_path / "bias", 4)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    _, n_layers, delta = p.stdout.strip().splitlines()[-1].split()
    assert int(n_layers) == 2  # tiny has two E layers
    assert float(delta) == pytest.approx(2 * 1e-3, rel=1e-3)  # 2 steps x moe_router_bias_update_rate


def test_a_plan_for_another_backend_is_refused_and_replanned():
    """Validation resolves the kernel backend once; a tool that switches cfg.kernels.backend must re-plan, never
    build silently with the validated backend."""
    from omegaconf import open_dict

    from nano_hybrid import runconfig, trainer as T
    from nano_hybrid.config import compose

    cfg = compose(["model=tiny", "kernels.backend=torch", "train.device=cpu", "data=mock"])
    plan = runconfig.validate(cfg)
    assert plan.backend.name == "torch"
    with open_dict(cfg):
        cfg.kernels.backend = "helion"
    with pytest.raises(ValueError, match=r"plan\.for_backend\(cfg\)"):
        T.build_model_and_optimizer(plan, cfg)
    replanned = plan.for_backend(cfg)
    assert replanned.backend.name == "helion" and replanned.backend_name == "helion"


def test_deterministic_training_runs_and_needs_the_kernel_switch(corpus, tmp_path):
    run_dir = tmp_path / "det"
    p = run_train(common(corpus, run_dir, 4) + ["train.deterministic=true", "kernels.deterministic=true"])
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["train"]["deterministic"] is True and cfg["kernels"]["deterministic"] is True
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]
    p = run_train(common(corpus, tmp_path / "bad", 4) + ["train.deterministic=true"])
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and err[-1] == ("error: train.deterministic=true needs kernels.deterministic=true "
                                             "(the kernel backend's own switch)"), p.stderr[-2000:]
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
