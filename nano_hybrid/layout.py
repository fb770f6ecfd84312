"""The parallel layout of a run: one frozen record, built once from the run config and the launcher's environment.

    env = LaunchEnv.read()                     # the only reader of RANK / WORLD_SIZE / LOCAL_RANK
    dims = ParallelDims.build(cfg, env)        # ConfigError naming the offending numbers
    dims.dp, dims.dp_rank, dims.is_main, dims.as_dict()

``cfg.parallel`` uses megatron's names: tensor_model_parallel_size (TP), pipeline_model_parallel_size (PP),
expert_model_parallel_size (EP), expert_tensor_parallel_size (ETP), context_parallel_size (CP),
sequence_parallel, use_distributed_optimizer. Data parallel size = world_size / (TP*PP*CP); the expert grid is
ETP*EP*(expert DP)*PP = world_size, as in megatron's ``initialize_model_parallel``. Ranks follow megatron's
default order ``tp-cp-ep-dp-pp`` (``nano_hybrid.parallel.initialize_parallel`` checks megatron agrees).

This module imports neither torch nor megatron (``nano_hybrid.errors`` reads the rank through it).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Mapping

from nano_hybrid.errors import ConfigError
from nano_hybrid.schema import ParallelSchema

PARALLEL_KEYS = tuple(f.name for f in dataclasses.fields(ParallelSchema))
_SIZE_KEYS = tuple(f.name for f in dataclasses.fields(ParallelSchema) if f.type == "int")


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher (torchrun, srun wrapper) says about this process. ``launched``: both ``RANK`` and
    ``WORLD_SIZE`` are set (the process group then initialises from ``env://``)."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    launched: bool = False

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> "LaunchEnv":
        """``WORLD_SIZE`` (default 1), ``RANK`` (0), ``LOCAL_RANK`` (0); a value that is not an integer is a
        ConfigError naming the variable."""
        env = os.environ if environ is None else environ

        def read_int(name: str, default: int) -> int:
            try:
                return int(env.get(name, default))
            except ValueError:
                raise ConfigError(f"environment variable {name}={env[name]!r} is not an integer") from None

        return cls(world_size=read_int("WORLD_SIZE", 1), rank=read_int("RANK", 0),
                   local_rank=read_int("LOCAL_RANK", 0), launched="RANK" in env and "WORLD_SIZE" in env)

    @classmethod
    def planned(cls, world_size: int) -> "LaunchEnv":
        """Rank 0 of a job of ``world_size`` processes that does not run here (the memory planner, the launcher's
        pre-flight check)."""
        return cls(world_size=world_size)


@dataclass(frozen=True)
class ParallelDims:
    """Where this process sits in the run's parallel layout; every size and rank the run uses comes from here."""

    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    sp: bool  # parallel.sequence_parallel
    dist_opt: bool  # parallel.use_distributed_optimizer
    world_size: int
    rank: int = 0
    local_rank: int = 0
    launched: bool = False  # under a launcher (RANK and WORLD_SIZE set): env:// initialisation

    @classmethod
    def build(cls, cfg, env: LaunchEnv | None = None) -> "ParallelDims":
        """The layout of ``cfg.parallel`` in the world of ``env`` (default: ``LaunchEnv.read()``), checked against
        the model and the world size before any work; ConfigError naming the offending numbers."""
        env = LaunchEnv.read() if env is None else env
        if not isinstance(env.world_size, int) or env.world_size < 1:
            raise ConfigError(f"world_size={env.world_size!r} must be an integer >= 1")
        if not 0 <= env.rank < env.world_size:
            raise ConfigError(f"RANK={env.rank} is outside the world of WORLD_SIZE={env.world_size} processes")
        s, flags = _read_parallel(cfg)
        dims = cls(tp=s["tensor_model_parallel_size"], pp=s["pipeline_model_parallel_size"],
                   cp=s["context_parallel_size"], ep=s["expert_model_parallel_size"],
                   etp=s["expert_tensor_parallel_size"], sp=flags["sequence_parallel"],
                   dist_opt=flags["use_distributed_optimizer"], world_size=env.world_size, rank=env.rank,
                   local_rank=env.local_rank, launched=env.launched)
        errors = dims._grid_errors() + _model_errors(cfg, dims)
        if errors:
            raise ConfigError("invalid parallel layout: " + "; ".join(errors))
        return dims

    @classmethod
    def single(cls) -> "ParallelDims":
        """One process, no model parallelism: rank 0 of 1."""
        return cls(tp=1, pp=1, cp=1, ep=1, etp=1, sp=False, dist_opt=False, world_size=1)

    def _grid_errors(self) -> list[str]:
        tp, pp, cp, ep, etp, world = self.tp, self.pp, self.cp, self.ep, self.etp, self.world_size
        errors = []
        if world % (tp * pp * cp):
            errors.append(f"world_size={world} is not divisible by TP*PP*CP = {tp}*{pp}*{cp} = {tp * pp * cp}")
        if world % (etp * ep * pp):
            errors.append(f"world_size={world} is not divisible by ETP*EP*PP = {etp}*{ep}*{pp} = {etp * ep * pp} "
                          "(the expert grid)")
        if self.sp and tp == 1:
            errors.append("parallel.sequence_parallel=true needs tensor_model_parallel_size > 1 (got 1)")
        if cp > 1:
            errors.append(f"context_parallel_size={cp}: the local attention modules (attention_impl=sdpa|unfused) "
                          "support only context_parallel_size=1 (CP needs transformer-engine attention)")
        return errors

    @property
    def dp(self) -> int:
        """The (non-expert) data-parallel size."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        """The expert data-parallel size."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return (self.rank // (self.tp * self.cp)) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.cp * self.dp)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def multi_process(self) -> bool:
        return self.world_size > 1

    def as_dict(self) -> dict[str, int]:
        """The sizes a checkpoint records (``meta.json`` ``parallel``)."""
        return {"world_size": self.world_size, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep,
                "etp": self.etp, "dp": self.dp}


def _read_parallel(cfg) -> tuple[dict[str, int], dict[str, bool]]:
    p = cfg.parallel
    missing = [k for k in PARALLEL_KEYS if k not in p]
    if missing:
        raise ConfigError(f"parallel config is missing {', '.join(missing)}")
    unknown = sorted(set(p.keys()) - set(PARALLEL_KEYS))
    if unknown:
        raise ConfigError(f"parallel config has unknown key(s) {unknown}; known: {', '.join(PARALLEL_KEYS)}")
    sizes = {}
    for k in _SIZE_KEYS:
        v = p[k]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"parallel.{k}={v!r} must be an integer >= 1")
        sizes[k] = v
    flags = {}
    for k in ("sequence_parallel", "use_distributed_optimizer"):
        if not isinstance(p[k], bool):
            raise ConfigError(f"parallel.{k}={p[k]!r} must be true or false")
        flags[k] = p[k]
    return sizes, flags


def _model_errors(cfg, d: ParallelDims) -> list[str]:
    """The model's widths, heads, experts and layers against the layout (and the run's sequence under SP)."""
    from nano_hybrid.model.config import check_model_cfg, model_dict

    m = model_dict(cfg.model)
    check_model_cfg(m)
    errors: list[str] = []

    def div(key: str, value, by: int, by_name: str):
        if value is not None and value % by:
            errors.append(f"model.{key}={value} is not divisible by {by_name}={by}")

    pattern = m["hybrid_override_pattern"]
    tp_name = "tensor_model_parallel_size"
    if len(pattern) % d.pp:
        errors.append(f"{len(pattern)} layers (len(model.hybrid_override_pattern)) are not divisible by "
                      f"pipeline_model_parallel_size={d.pp} (MambaStack splits layers evenly)")
    if "*" in pattern:
        div("num_attention_heads", m.get("num_attention_heads"), d.tp, tp_name)
        div("num_query_groups", m.get("num_query_groups") or m.get("num_attention_heads"), d.tp, tp_name)
    if "M" in pattern:
        div("mamba_num_heads", m.get("mamba_num_heads"), d.tp, tp_name)
        div("mamba_num_groups", m["mamba_num_groups"], d.tp, tp_name)
    if "-" in pattern:
        div("ffn_hidden_size", m.get("ffn_hidden_size"), d.tp, tp_name)
    if "E" in pattern:
        div("num_moe_experts", m.get("num_moe_experts"), d.ep, "expert_model_parallel_size")
        div("moe_ffn_hidden_size", m.get("moe_ffn_hidden_size"), d.etp, "expert_tensor_parallel_size")
        div("moe_shared_expert_intermediate_size", m.get("moe_shared_expert_intermediate_size"), d.tp, tp_name)
    elif d.ep > 1 or d.etp > 1:
        errors.append(f"expert_model_parallel_size={d.ep} / expert_tensor_parallel_size={d.etp} but the model has "
                      "no MoE layers")
    if d.sp:  # the run's sequence length (train.seq_length, at most model.seq_length) is what gets split
        train_cfg = cfg.get("train")
        seq = train_cfg.get("seq_length") if train_cfg is not None else None
        if seq is None:
            div("seq_length", m["seq_length"], d.tp, "tensor_model_parallel_size (sequence parallel)")
        elif int(seq) % d.tp:
            errors.append(f"train.seq_length={seq} is not divisible by tensor_model_parallel_size={d.tp} "
                          "(sequence parallel)")
    return errors
