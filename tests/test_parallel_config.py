"""Parallel layout validation (messages name the numbers), single-process init, and 2-rank gloo runs."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from gloo_ranks import spawn_ranks

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

from nano_hybrid.config import CONFIG_DIR, ConfigError, compose  # noqa: E402
from nano_hybrid.layout import LaunchEnv, ParallelDims  # noqa: E402
from nano_hybrid.parallel import destroy_parallel, initialize_parallel  # noqa: E402

PARALLEL_CONFIGS = sorted(p.stem for p in (CONFIG_DIR / "parallel").glob("*.yaml"))


def _cfg(*overrides):
    return compose(["model=nano30b", *overrides])


def _dims(cfg, world_size: int) -> ParallelDims:
    return ParallelDims.build(cfg, LaunchEnv.planned(world_size))


def test_parallel_configs_present():
    assert {"single", "dp2", "tp2", "ep2"} <= set(PARALLEL_CONFIGS)


@pytest.mark.parametrize("name", [n for n in PARALLEL_CONFIGS if n != "single"])
@pytest.mark.parametrize("model", ["tiny", "nano30b", "nano30b_slice"])
def test_shipped_two_rank_layouts_are_valid(name, model):
    cfg = compose([f"model={model}", f"parallel={name}"])
    if name == "pp2" and len(cfg.model.hybrid_override_pattern) % 2:  # tiny (5 layers), nano30b_slice (13)
        with pytest.raises(ConfigError, match="not divisible by pipeline_model_parallel_size=2"):
            _dims(cfg, 2)
        return
    out = _dims(cfg, 2)
    assert out.world_size == 2
    assert out.dp * out.tp * out.pp * out.cp == 2


def test_single_is_valid_and_derives_dp():
    out = _dims(_cfg("parallel=single"), 8)
    assert out.dp == 8 and out.edp == 8


@pytest.mark.parametrize(
    "overrides, world, pattern",
    [
        (["parallel.tensor_model_parallel_size=3"], 3, r"num_attention_heads=32 is not divisible by tensor_model_parallel_size=3"),
        (["parallel.tensor_model_parallel_size=4"], 4, r"num_query_groups=2 is not divisible by tensor_model_parallel_size=4"),
        (["parallel.tensor_model_parallel_size=16"], 16, r"mamba_num_groups=8 is not divisible by tensor_model_parallel_size=16"),
        (["parallel.expert_model_parallel_size=3"], 3, r"num_moe_experts=128 is not divisible by expert_model_parallel_size=3"),
        (["parallel.pipeline_model_parallel_size=3"], 3, r"52 layers .* not divisible by pipeline_model_parallel_size=3"),
        (["parallel.tensor_model_parallel_size=2"], 3, r"world_size=3 is not divisible by TP\*PP\*CP = 2\*1\*1 = 2"),
        (["parallel.expert_model_parallel_size=4"], 2, r"world_size=2 is not divisible by ETP\*EP\*PP = 1\*4\*1 = 4"),
        (["parallel.sequence_parallel=true"], 1, r"sequence_parallel=true needs tensor_model_parallel_size > 1"),
        (["parallel.context_parallel_size=2"], 2, r"context_parallel_size=2"),
        (["parallel.expert_tensor_parallel_size=3"], 3, r"moe_ffn_hidden_size=1856 is not divisible by expert_tensor_parallel_size=3"),
        (["parallel.tensor_model_parallel_size=0"], 1, r"parallel.tensor_model_parallel_size=0 must be an integer >= 1"),
    ],
)
def test_validation_errors_name_the_numbers(overrides, world, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _dims(_cfg(*overrides), world)


def test_several_errors_reported_together():
    with pytest.raises(ConfigError) as e:
        _dims(_cfg("parallel.tensor_model_parallel_size=3", "parallel.expert_model_parallel_size=5"), 15)
    msg = str(e.value)
    assert "num_attention_heads=32" in msg and "num_moe_experts=128" in msg


def test_unknown_parallel_key_rejected():
    with pytest.raises(ConfigError, match="unknown key"):
        _dims(_cfg("+parallel.data_parallel_size=2"), 2)


def test_sequence_parallel_checks_the_runs_sequence_length():
    msg = r"train.seq_length=255 is not divisible by tensor_model_parallel_size=2 \(sequence parallel\)"
    with pytest.raises(ConfigError, match=msg):
        _dims(compose(["model=tiny", "parallel=tp2", "model.seq_length=255"]), 2)
    with pytest.raises(ConfigError, match=msg):  # the model allows 256, the run splits 255 tokens
        _dims(compose(["model=tiny", "parallel=tp2", "model.seq_length=256", "train.seq_length=255"]), 2)
    # the run's 254 tokens split evenly even though the model's maximum (255) would not
    assert _dims(compose(["model=tiny", "parallel=tp2", "model.seq_length=255", "train.seq_length=254"]), 2).dp == 1


def test_initialize_single_process():
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as tpr

    created = not ps.model_parallel_is_initialized()
    info = initialize_parallel(compose(["model=tiny", "parallel=single"]))
    try:
        assert isinstance(info, ParallelDims)
        assert (info.world_size, info.rank, info.tp, info.dp, info.dp_rank) == (1, 0, 1, 1, 0)
        import torch.distributed as dist

        assert dist.get_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
        states = tpr.get_cuda_rng_tracker().get_states()
        assert {tpr._DATA_PARALLEL_RNG_TRACKER_NAME, tpr._MODEL_PARALLEL_RNG_TRACKER_NAME,
                tpr._EXPERT_PARALLEL_RNG_TRACKER_NAME} <= set(states)
        # the model-parallel stream is distinct from the default generator
        with tpr.get_cuda_rng_tracker().fork():
            a = torch.rand(3)
        b = torch.rand(3)
        assert not torch.equal(a, b)
    finally:
        if created:
            destroy_parallel()


# ------------------------------------------------------------------ two gloo ranks (CPU), tiny model
def _worker(rank, world, layouts, out_dir):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    from nano_hybrid.model import build_model

    for layout in layouts:  # one spawn for all layouts: process start-up (imports) dominates
        cfg = compose(["model=tiny", f"parallel={layout}", "model.seq_length=32"])
        initialize_parallel(cfg)
        model = build_model(cfg)
        s, b = 32, 2
        g = torch.Generator().manual_seed(5)
        tok = torch.randint(0, 256, (b, s), generator=g)
        pos = torch.arange(s)[None].expand(b, s)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
        loss = model(tok, pos, mask, labels=tok).mean()
        loss.backward()
        ok = all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        if rank == 0:
            torch.save({"loss": loss.item(), "grads_ok": ok, "tp": ps.get_tensor_model_parallel_world_size(),
                        "ep": ps.get_expert_model_parallel_world_size(),
                        "sp": bool(model.config.sequence_parallel)}, os.path.join(out_dir, f"{layout}.pt"))
        ps.destroy_model_parallel()  # keep the gloo world; initialize_parallel reuses it
    destroy_parallel()


def test_two_gloo_ranks_build_and_run_tiny_tp2_and_ep2(tmp_path):
    """tiny model forward/backward on 2 CPU ranks (gloo) with TP=2+SP and with EP=2."""
    layouts = ["tp2", "ep2"]
    spawn_ranks(_worker, 2, layouts, str(tmp_path))
    expect = {"tp2": (2, 1, True), "ep2": (1, 2, False)}
    for layout in layouts:
        res = torch.load(tmp_path / f"{layout}.pt")
        assert res["grads_ok"], layout
        assert abs(res["loss"] - torch.log(torch.tensor(512.0)).item()) < 1.0, (layout, res)
        assert (res["tp"], res["ep"], res["sp"]) == expect[layout]


@pytest.mark.parametrize("launched", [True, False])
def test_nccl_process_group_is_bound_to_the_ranks_device_and_gloo_to_none(monkeypatch, launched):
    """With CUDA the NCCL group is created for LOCAL_RANK's device (``device_id``: no collective guesses the device
    from the rank); a gloo group gets no device. torch.distributed's init is recorded, not run."""
    import torch.distributed as dist

    from nano_hybrid import parallel

    dims = ParallelDims(tp=1, pp=1, cp=1, ep=1, etp=1, sp=False, dist_opt=False, world_size=2 if launched else 1,
                        rank=1 if launched else 0, local_rank=1 if launched else 0, launched=launched)
    calls, devices = [], []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    parallel._init_process_group(dims, "nccl")
    parallel._init_process_group(dims, "gloo")
    (nccl, kw_nccl), (gloo, kw_gloo) = calls
    assert devices == [dims.local_rank] * 2
    assert nccl == "nccl" and kw_nccl["device_id"] == torch.device("cuda", dims.local_rank)
    assert gloo == "gloo" and kw_gloo["device_id"] is None
    assert kw_nccl["rank"] == dims.rank and kw_nccl["world_size"] == dims.world_size
    if launched:
        assert kw_nccl["init_method"] == "env://" and "store" not in kw_nccl
    else:  # one process: an in-process store, no port
        assert "init_method" not in kw_nccl and isinstance(kw_nccl["store"], dist.HashStore)
