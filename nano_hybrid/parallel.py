"""Parallel layout: validation against the model, torch.distributed + megatron initialisation.

    validate_parallel(cfg, world_size)        # raises ConfigError naming the offending numbers
    info = initialize_parallel(cfg)           # torch.distributed, megatron parallel_state, RNG seeds
    ...
    destroy_parallel()

``cfg.parallel`` uses megatron's names: tensor_model_parallel_size (TP), pipeline_model_parallel_size
(PP), expert_model_parallel_size (EP), expert_tensor_parallel_size (ETP), context_parallel_size (CP),
sequence_parallel, use_distributed_optimizer. Data parallel size = world_size / (TP*PP*CP); the
expert grid is ETP*EP*(expert DP)*PP = world_size, as in megatron's ``initialize_model_parallel``.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import asdict, dataclass

import torch
from omegaconf import DictConfig

from nano_hybrid import mcore_compat
from nano_hybrid.config import ConfigError
from nano_hybrid.model.config import check_model_cfg, model_dict

PARALLEL_KEYS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "context_parallel_size", "sequence_parallel", "use_distributed_optimizer",
)
_SIZE_KEYS = PARALLEL_KEYS[:5]


@dataclass(frozen=True)
class ParallelInfo:
    """Where this process sits. ``dp`` is the (non-expert) data-parallel size; ``edp`` the expert one."""

    world_size: int
    rank: int
    local_rank: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    edp: int
    dp_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["device"] = str(self.device)
        return d


def _sizes(cfg: DictConfig) -> dict:
    p = cfg.parallel
    missing = [k for k in PARALLEL_KEYS if k not in p]
    if missing:
        raise ConfigError(f"parallel config is missing {', '.join(missing)}")
    unknown = sorted(set(p.keys()) - set(PARALLEL_KEYS))
    if unknown:
        raise ConfigError(f"parallel config has unknown key(s) {unknown}; known: {', '.join(PARALLEL_KEYS)}")
    out = {}
    for k in _SIZE_KEYS:
        v = p[k]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"parallel.{k}={v!r} must be an integer >= 1")
        out[k] = v
    for k in ("sequence_parallel", "use_distributed_optimizer"):
        if not isinstance(p[k], bool):
            raise ConfigError(f"parallel.{k}={p[k]!r} must be true or false")
    return out


def validate_parallel(cfg: DictConfig, world_size: int) -> dict:
    """Check the parallel layout against the model and the world size before any work.

    Raises ``ConfigError`` naming the offending numbers; returns the derived sizes
    (``dp``, ``edp`` plus the configured ones).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size={world_size!r} must be an integer >= 1")
    s = _sizes(cfg)
    tp, pp, ep = s["tensor_model_parallel_size"], s["pipeline_model_parallel_size"], s["expert_model_parallel_size"]
    etp, cp = s["expert_tensor_parallel_size"], s["context_parallel_size"]
    sp = bool(cfg.parallel.sequence_parallel)
    m = model_dict(cfg.model)
    check_model_cfg(m)
    errors: list[str] = []

    if world_size % (tp * pp * cp):
        errors.append(f"world_size={world_size} is not divisible by TP*PP*CP = {tp}*{pp}*{cp} = {tp * pp * cp}")
    if world_size % (etp * ep * pp):
        errors.append(f"world_size={world_size} is not divisible by ETP*EP*PP = {etp}*{ep}*{pp} = {etp * ep * pp} "
                      "(the expert grid)")
    if sp and tp == 1:
        errors.append("parallel.sequence_parallel=true needs tensor_model_parallel_size > 1 (got 1)")
    if cp > 1:
        errors.append(f"context_parallel_size={cp}: the local attention modules (attention_impl=sdpa|unfused) "
                      "support only context_parallel_size=1 (CP needs transformer-engine attention)")

    def div(key: str, value, by: int, by_name: str):
        if value is not None and value % by:
            errors.append(f"model.{key}={value} is not divisible by {by_name}={by}")

    pattern = m["hybrid_override_pattern"]
    n_layers = len(pattern)
    if n_layers % pp:
        errors.append(f"{n_layers} layers (len(model.hybrid_override_pattern)) are not divisible by "
                      f"pipeline_model_parallel_size={pp} (MambaStack splits layers evenly)")
    if "*" in pattern:
        div("num_attention_heads", m.get("num_attention_heads"), tp, "tensor_model_parallel_size")
        div("num_query_groups", m.get("num_query_groups") or m.get("num_attention_heads"), tp, "tensor_model_parallel_size")
    if "M" in pattern:
        div("mamba_num_heads", m.get("mamba_num_heads"), tp, "tensor_model_parallel_size")
        div("mamba_num_groups", m.get("mamba_num_groups", 8), tp, "tensor_model_parallel_size")
    if "-" in pattern:
        div("ffn_hidden_size", m.get("ffn_hidden_size"), tp, "tensor_model_parallel_size")
    if "E" in pattern:
        div("num_moe_experts", m.get("num_moe_experts"), ep, "expert_model_parallel_size")
        div("moe_ffn_hidden_size", m.get("moe_ffn_hidden_size"), etp, "expert_tensor_parallel_size")
        div("moe_shared_expert_intermediate_size", m.get("moe_shared_expert_intermediate_size"), tp,
            "tensor_model_parallel_size")
    elif ep > 1 or etp > 1:
        errors.append(f"expert_model_parallel_size={ep} / expert_tensor_parallel_size={etp} but the model has no MoE layers")
    if sp:  # the run's sequence length (train.seq_length, at most model.seq_length) is what gets split
        train_cfg = cfg.get("train")
        seq = train_cfg.get("seq_length") if train_cfg is not None else None
        if seq is None:
            div("seq_length", m["seq_length"], tp, "tensor_model_parallel_size (sequence parallel)")
        elif int(seq) % tp:
            errors.append(f"train.seq_length={seq} is not divisible by tensor_model_parallel_size={tp} "
                          "(sequence parallel)")
    if errors:
        raise ConfigError("invalid parallel layout: " + "; ".join(errors))
    dp = world_size // (tp * pp * cp)
    edp = world_size // (etp * ep * pp)
    return {**s, "sequence_parallel": sp, "dp": dp, "edp": edp, "world_size": world_size}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def initialize_parallel(cfg: DictConfig, *, backend: str | None = None) -> ParallelInfo:
    """Initialise torch.distributed, megatron's parallel_state and the model-parallel RNG seeds.

    Under torchrun (``RANK``/``WORLD_SIZE`` set) uses ``env://``; otherwise a single-process world on a
    free local port. ``backend``: ``None`` -> nccl with CUDA, gloo without. Validates the layout with
    ``validate_parallel`` first. Seeds: ``cfg.seed + 100 * pp_rank`` for torch/python RNGs (megatron's
    rule), then megatron's model-parallel streams (CUDA tracker on GPU, the CPU tracker on CPU).
    Idempotent for an already initialised megatron state of the same sizes.
    """
    import random

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if under_launcher else 1
    sizes = validate_parallel(cfg, world_size)
    mcore_compat.apply_mcore_compat()
    rank = int(os.environ.get("RANK", 0)) if under_launcher else 0
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if under_launcher else 0
    cuda = torch.cuda.is_available()
    if backend is None:
        backend = "nccl" if cuda else "gloo"
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA device(s) are visible")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=30)
        if under_launcher:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                                    timeout=timeout)
    elif dist.get_world_size() != world_size:
        raise RuntimeError(f"torch.distributed is already initialised with world size {dist.get_world_size()}, "
                           f"expected {world_size}")

    tp, pp = sizes["tensor_model_parallel_size"], sizes["pipeline_model_parallel_size"]
    ep, etp, cp = sizes["expert_model_parallel_size"], sizes["expert_tensor_parallel_size"], sizes["context_parallel_size"]
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(), ps.get_context_parallel_world_size())
        if have != (tp, pp, ep, cp):
            raise RuntimeError(f"megatron parallel state already initialised with TP/PP/EP/CP={have}, "
                               f"requested {(tp, pp, ep, cp)}; call destroy_parallel() first")
    else:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        )
    seed = int(cfg.get("seed", 1234)) + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    mcore_compat.model_parallel_manual_seed(seed)
    return ParallelInfo(
        world_size=world_size, rank=rank, local_rank=local_rank, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp,
        dp=sizes["dp"], edp=sizes["edp"], dp_rank=ps.get_data_parallel_rank(), device=device, backend=backend,
    )


def destroy_parallel() -> None:
    """Tear down megatron's parallel state and the torch.distributed process group (if any)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
