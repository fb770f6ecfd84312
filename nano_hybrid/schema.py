"""The run-config schema: every key of the ``train``, ``optim``, ``checkpoint``, ``logger``, ``parallel``, ``kernels``
and ``plan`` groups with its type, default and a one-line doc. This is the one place these defaults live.

Each group's schema is registered in Hydra's ConfigStore as ``<group>/schema`` (a plain node: the values are
checked by ``nano_hybrid.runconfig`` with one-line errors naming the key, not by OmegaConf's type conversion), and
each YAML file of the group starts from it (``defaults: [schema, _self_]``), holding only what differs.

    register()                  # before composing (nano_hybrid.config.compose does it)
    check_keys(cfg)             # a key the schema does not know: ConfigError with the closest known one
    run = RunConfig.from_cfg(cfg)   # after validation: typed, frozen (run.train.micro_batch_size is an int)
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Optional

from kernels.settings import HelionSettings


def doc(text: str, default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING):
    """A schema field with its one-line doc."""
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


@dataclass(frozen=True)
class TrainSchema:
    micro_batch_size: int = doc("samples per micro-batch and rank", 8)
    global_batch_size: int = doc("samples per optimizer step (micro-batches x DP size x accumulation)", 8)
    seq_length: int = doc("tokens per sample (<= model.seq_length)", "${model.seq_length}")
    train_iters: int = doc("optimizer steps of the run", 300)
    log_interval: int = doc("console line every N steps (metrics.jsonl always gets every step)", 1)
    memory_check: bool = doc("CUDA: refuse to start when the memory planner is sure the run cannot fit the GPU", True)
    eval_interval: int = doc("validation every N steps and at the last step (0: none)", 0)
    eval_iters: int = doc("global batches per validation (the same ones each time)", 10)
    device: str = doc("auto (cuda if available, else cpu) | cpu | cuda", "auto")
    precision: str = doc("auto (bf16 on cuda, fp32 on cpu) | bf16 | fp32", "auto")
    torch_threads: Optional[int] = doc("CPU intra-op threads (null: torch default)", None)
    exit_after_minutes: Optional[float] = doc("save and stop after this many minutes from start-up (null: never)", None)
    max_skipped_steps: Optional[int] = doc("non-finite steps in a row that stop the run as diverged (null: never)", 10)
    # FP8 training (nano_hybrid/model/fp8.py)
    fp8: str = doc("none | tensorwise | rowwise: torchao float8 matmuls (dynamic scaling) for fp8_modules; "
                   "parameters and checkpoints stay bf16/fp32", "none")
    fp8_modules: list = doc("module kinds in fp8: mamba_proj, attention, mlp, shared_expert, experts (the LM head "
                            "and the router always stay bf16)",
                            factory=lambda: ["mamba_proj", "attention", "mlp", "shared_expert"])


@dataclass(frozen=True)
class OptimSchema:
    optimizer: str = doc('megatron\'s "adam" with decoupled weight decay = AdamW', "adam")
    lr: float = doc("peak learning rate (after warmup)", 1.0e-3)
    min_lr: float = doc("learning rate at the end of the decay", 1.0e-5)
    weight_decay: float = doc("decoupled weight decay", 0.1)
    adam_beta1: float = doc("Adam beta1", 0.9)
    adam_beta2: float = doc("Adam beta2", 0.95)
    adam_eps: float = doc("Adam epsilon", 1.0e-8)
    clip_grad: float = doc("gradient-norm clip (0: none)", 1.0)
    warmup_iters: int = doc("linear warmup steps (Nano: 333 at GBS 3072)", 30)
    decay_style: str = doc("WSD | cosine | linear | constant", "WSD")
    wsd_decay_fraction: Optional[float] = doc("WSD: final fraction of train_iters spent decaying", 0.2)
    wsd_decay_style: Optional[str] = doc("WSD decay shape: linear | cosine | exponential | minus_sqrt", "linear")
    init_lr: float = doc("lr at step 0 of the warmup", 0.0)
    fused: bool = doc("torch's fused AdamW kernel (one launch per dtype group); false: torch's default", True)


@dataclass(frozen=True)
class CheckpointSchema:
    dir: str = doc("where checkpoints go", "${run_dir}/checkpoints")
    interval: Optional[int] = doc("save every N steps (0 or null: only on exit / at the end)", 100)
    keep_last: Optional[int] = doc("keep the newest N complete checkpoints (null or 0: keep all)", 2)
    load: Optional[str] = doc("auto: newest complete checkpoint in dir (fresh start if none) | a checkpoint (or "
                              "checkpoints) dir that must exist and be complete | none: never load", "auto")
    save_on_exit: bool = doc("save a final checkpoint on SIGTERM/SIGINT, train.exit_after_minutes or the end", True)
    init_from_hf: Optional[str] = doc("a Hugging Face Nemotron-H folder whose weights start a fresh run (any layout, "
                                      "fresh optimizer; its config.json must match model.*); null: own init", None)
    verify: bool = doc("verify a checkpoint's files against its CRC-32 checksums before loading (load=auto: a "
                       "failing one moves to <dir>/corrupt/ and the previous one loads)", True)
    check_free_space: bool = doc("before any work, refuse to start when dir's filesystem lacks room for "
                                 "(keep_last + 1) checkpoints", True)


@dataclass(frozen=True)
class WandbSchema:
    mode: str = doc("disabled | online | offline (offline runs land in <run_dir>/wandb)", "disabled")
    project: str = doc("W&B project", "nano-hybrid")
    group: Optional[str] = doc("e.g. the A/B experiment name; arms share it", None)
    name: Optional[str] = doc("null: the run directory's name", None)
    tags: list = doc("extra tags; backend, GPU name and git commit are always added", factory=list)
    id: Optional[str] = doc("set to resume an existing W&B run (a checkpoint restores it automatically)", None)


@dataclass(frozen=True)
class LoggerSchema:
    wandb: WandbSchema = doc("Weights & Biases (rank 0)", factory=WandbSchema)


@dataclass(frozen=True)
class ParallelSchema:
    tensor_model_parallel_size: int = doc("TP", 1)
    pipeline_model_parallel_size: int = doc("PP (1F1B schedule)", 1)
    expert_model_parallel_size: int = doc("EP", 1)
    expert_tensor_parallel_size: int = doc("ETP", 1)
    context_parallel_size: int = doc("CP (the local attention modules support 1 only)", 1)
    sequence_parallel: bool = doc("split the sequence over TP ranks outside the TP regions (needs TP > 1)", False)
    use_distributed_optimizer: bool = doc("shard the fp32 main weights and Adam states over DP ranks", False)


@dataclass(frozen=True)
class KernelsSchema:
    backend: str = doc("the Mamba-2 mixer's kernels: torch (pure-PyTorch reference, CPU default, correctness "
                       "oracle) | mamba_ssm (mamba-ssm Triton + causal-conv1d CUDA, GPU only) | helion (our Helion "
                       "kernels, per-GPU tuned configs from kernels/configs/<arch>/)", "torch")
    deterministic: bool = doc("bitwise-repeatable gradients in the helion backend (no atomics in reductions)", False)
    helion: dict = doc("kernels/settings.py HelionSettings, where each key is documented (helion backend only; "
                       "recorded in every run's config.yaml)",
                       factory=lambda: {f.name: f.default for f in dataclasses.fields(HelionSettings)})


@dataclass(frozen=True)
class PlanSchema:
    gpus: Optional[int] = doc("GPUs of the planned run; null: the smallest world the layout needs", None)
    format: str = doc("text | json", "text")
    optimizer: bool = doc("false: forward+backward only (no optimizer states or step)", True)


GROUPS: dict[str, type] = {
    "train": TrainSchema, "optim": OptimSchema, "checkpoint": CheckpointSchema, "logger": LoggerSchema,
    "parallel": ParallelSchema, "kernels": KernelsSchema, "plan": PlanSchema,
}


@dataclass(frozen=True)
class RunConfig:
    """The validated run config, typed and frozen: what the trainer reads. Not here: ``checkpoint`` (its ``dir``
    follows ``run_dir``, resolved at start-up; ``nano_hybrid.checkpoint`` reads ``cfg``) and ``logger`` (a resumed
    run continues the checkpoint's W&B id, set at start-up)."""

    train: TrainSchema
    optim: OptimSchema
    parallel: ParallelSchema
    kernels: KernelsSchema
    plan: PlanSchema

    @classmethod
    def from_cfg(cls, cfg) -> "RunConfig":
        """From a composed config that ``nano_hybrid.runconfig.validate`` has checked (values converted to the
        schema's types; a number YAML read as a string, such as 3e-3, becomes a float)."""
        from omegaconf import OmegaConf

        return cls(**{f.name: _typed(GROUPS[f.name], OmegaConf.to_container(cfg[f.name], resolve=True))
                      for f in dataclasses.fields(cls)})


def _typed(schema: type, values: dict):
    kwargs = {}
    for f in dataclasses.fields(schema):
        v, kind = values[f.name], str(f.type)
        if dataclasses.is_dataclass(f.default_factory):
            v = _typed(f.default_factory, v)
        elif v is not None and kind.removeprefix("Optional[").removesuffix("]") in ("int", "float"):
            v = int(v) if kind.endswith("int]") or kind == "int" else float(v)
        kwargs[f.name] = v
    return schema(**kwargs)


def defaults(schema: type) -> dict[str, Any]:
    """The schema's defaults as a plain nested dict (the ConfigStore node)."""
    out = {}
    for f in dataclasses.fields(schema):
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out[f.name] = defaults(type(value)) if dataclasses.is_dataclass(value) else value
    return out


def register() -> None:
    """Store each group's schema as ``<group>/schema`` in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for group, schema in GROUPS.items():
        cs.store(group=group, name="schema", node=defaults(schema))


def check_keys(cfg) -> None:
    """ConfigError naming the first key of a schema group that the schema does not know (one added with
    ``+group.key=...``), with the closest known key."""
    from nano_hybrid.errors import ConfigError

    def walk(node, schema: type, prefix: str) -> None:
        fields = {f.name: f for f in dataclasses.fields(schema)}
        for k in node.keys():
            f = fields.get(str(k))
            if f is None:
                match = difflib.get_close_matches(str(k), list(fields), n=1, cutoff=0.6)
                raise ConfigError(f"{prefix}.{k} is not a key" + (f"; did you mean {prefix}.{match[0]}?" if match
                                                                   else f"; known: {', '.join(fields)}"))
            if dataclasses.is_dataclass(f.default_factory) and node[k] is not None:
                walk(node[k], f.default_factory, f"{prefix}.{k}")

    for group, schema in GROUPS.items():
        if group in cfg:
            walk(cfg[group], schema, group)
