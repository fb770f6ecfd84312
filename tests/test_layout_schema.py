"""The parallel-layout record (nano_hybrid.layout) and the run-config schema (nano_hybrid.schema): no process group."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from nano_hybrid.config import CONFIG_DIR, ConfigError, compose
from nano_hybrid.layout import LaunchEnv, ParallelDims
from nano_hybrid.schema import GROUPS, RunConfig, check_keys, defaults


def test_launch_env_reads_the_launcher_variables_once():
    env = LaunchEnv.read({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"})
    assert (env.world_size, env.rank, env.local_rank, env.launched) == (4, 3, 1, True)
    assert LaunchEnv.read({}) == LaunchEnv(world_size=1, rank=0, local_rank=0, launched=False)
    assert not LaunchEnv.read({"WORLD_SIZE": "2"}).launched  # RANK missing: not under a launcher
    with pytest.raises(ConfigError, match="environment variable RANK='x' is not an integer"):
        LaunchEnv.read({"RANK": "x"})


@pytest.mark.parametrize("layout, world", [("tp2", 8), ("ep2", 8), ("dp2", 4)])
def test_ranks_follow_megatrons_tp_cp_ep_dp_pp_order(layout, world):
    cfg = compose(["model=nano30b", f"parallel={layout}"])
    for rank in range(world):
        d = ParallelDims.build(cfg, LaunchEnv(world_size=world, rank=rank, launched=True))
        assert d.tp_rank == rank % d.tp and d.dp_rank == (rank // d.tp) % d.dp and d.pp_rank == 0
        assert d.dp * d.tp * d.pp * d.cp == world and d.is_main == (rank == 0)
    assert d.as_dict() == {"world_size": world, "tp": d.tp, "pp": 1, "cp": 1, "ep": d.ep, "etp": 1, "dp": d.dp}


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(ConfigError, match="RANK=2 is outside the world of WORLD_SIZE=2"):
        ParallelDims.build(compose(["model=tiny"]), LaunchEnv(world_size=2, rank=2))


def test_the_record_is_frozen():
    d = ParallelDims.build(compose(["model=tiny"]), LaunchEnv.planned(1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.tp = 2


@pytest.mark.parametrize("group", sorted(set(GROUPS) - {"model", "data"}))  # those two: test_model_data_schema.py
def test_group_files_hold_only_what_differs_from_the_schema(group):
    base = defaults(GROUPS[group])
    for path in sorted((CONFIG_DIR / group).glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        assert data.pop("defaults") == ["schema", "_self_"], path
        same = sorted(k for k, v in data.items() if k in base and base[k] == v and k != "backend")
        assert not same, f"{path} restates schema defaults {same}"
        assert set(data) <= set(base), f"{path} has keys the schema lacks: {sorted(set(data) - set(base))}"


def test_unknown_keys_name_the_closest_known_one():
    with pytest.raises(ConfigError, match=r"train\.train_iter is not a key; did you mean train\.train_iters\?"):
        check_keys(compose(["+train.train_iter=3"]))
    with pytest.raises(ConfigError, match=r"no such key; did you mean optim\.warmup_iters\?"):
        compose(["optim.warmup_iter=3"])
    with pytest.raises(ConfigError, match=r"Could not find 'kernels/nosuch'; options: helion, mamba_ssm, torch"):
        compose(["kernels=nosuch"])
    check_keys(compose([]))  # the shipped config: every key known


def test_run_config_is_typed_and_frozen():
    run = RunConfig.from_cfg(compose(["optim.lr=3e-3", "train.seq_length=64"]))
    assert run.optim.lr == 3e-3 and isinstance(run.optim.lr, float)
    assert run.train.seq_length == 64 and run.kernels.backend == "torch" and run.parallel.tensor_model_parallel_size == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.train.train_iters = 1


def test_both_ways_to_pick_a_backend_compose_the_same_config():
    assert compose(["kernels=helion"]) == compose(["kernels.backend=helion"])


def test_checkpoint_package_reads_the_jobs_layout_record(monkeypatch):
    """The checkpoint manifest's ``parallel`` record and the save/load ranks come from the one layout record that
    megatron was set up from; without one (no process group) a single process, rank 0 of 1."""
    from nano_hybrid import parallel
    from nano_hybrid.checkpoint import run_layout
    from nano_hybrid.layout import ParallelDims

    dims = ParallelDims(tp=2, pp=1, cp=1, ep=2, etp=1, sp=False, dist_opt=True, world_size=4, rank=3, local_rank=3,
                        launched=True)
    monkeypatch.setattr(parallel, "_ACTIVE", dims)
    assert run_layout() is dims
    assert run_layout().as_dict() == {"world_size": 4, "tp": 2, "pp": 1, "cp": 1, "ep": 2, "etp": 1, "dp": 2}
    monkeypatch.setattr(parallel, "_ACTIVE", None)
    assert run_layout() == ParallelDims.single() and run_layout().rank == 0 and run_layout().world_size == 1
