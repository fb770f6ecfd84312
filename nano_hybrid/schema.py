"""The run-config schema: every key of the ``model``, ``data``, ``train``, ``optim``, ``checkpoint``, ``logger``,
``parallel``, ``kernels`` and ``plan`` groups with its type, default and a one-line doc. This is the one place these defaults live.

Each group's schema is registered in Hydra's ConfigStore as ``<group>/schema`` (a plain node: the values are
checked by the checks below and ``nano_hybrid.runconfig``, with one-line errors naming the key, not by OmegaConf's
type conversion), and each YAML file of the group starts from it (``defaults: [schema, _self_]``), holding only what
differs.

    register()                  # before composing (nano_hybrid.config.compose does it)
    check_keys(cfg)             # a key the schema does not know: ConfigError with the closest known one;
                                # a required key (REQUIRED, ``???``) left unset: ConfigError naming it
    check_numbers(cfg)          # a number key that is not a number of its kind (NUMERIC_KEYS)
    check_values(cfg)           # a yes/no key that is not true/false, a number key that is not finite
    positive_int(cfg, key)      # the key's value, or ConfigError unless it is a positive integer
    run = RunConfig.from_cfg(cfg)   # after validation: typed, frozen (run.train.micro_batch_size is an int)
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from kernels.settings import HelionSettings
from nano_hybrid.errors import ConfigError


def doc(text: str, default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING):
    """A schema field with its one-line doc."""
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})

REQUIRED = "???"  # a key every config of its group must state (OmegaConf's missing value)


@dataclass(frozen=True)
class ModelSchema:
    """Keys are megatron-core TransformerConfig / MambaModel names where one exists (nano_hybrid/model/config.py)."""

    name: str = doc("the model's name (run directory, checkpoints)", REQUIRED)
    hybrid_override_pattern: str = doc("one symbol per layer: M Mamba-2, E MoE, * attention, - dense MLP", REQUIRED)
    hidden_size: int = doc("model width", REQUIRED)
    ffn_hidden_size: Optional[int] = doc("dense '-' layers' MLP width (and the experts' when moe_ffn_hidden_size "
                                         "is null)", None)
    vocab_size: int = doc("vocabulary entries (padded as megatron pads it)", REQUIRED)
    make_vocab_size_divisible_by: int = doc("pad the vocabulary to a multiple of this x TP", 128)
    seq_length: int = doc("longest sequence the model is built for (>= train.seq_length)", REQUIRED)
    untie_embeddings_and_output_weights: bool = doc("separate input embedding and LM head", True)
    position_embedding_type: str = doc("none | rope | learned_absolute", "none")
    norm_epsilon: float = doc("RMSNorm epsilon", 1.0e-5)
    init_method_std: float = doc("std of the normal weight init", 0.02)
    hidden_dropout: float = doc("dropout after each layer", 0.0)
    attention_dropout: float = doc("dropout of the attention probabilities", 0.0)
    mamba_num_heads: Optional[int] = doc("Mamba-2 heads (null: 2 x hidden_size / mamba_head_dim)", None)
    mamba_head_dim: int = doc("Mamba-2 head dim", 64)
    mamba_state_dim: int = doc("Mamba-2 SSM state size", 128)
    mamba_num_groups: int = doc("Mamba-2 B/C groups", 8)
    mamba_chunk_size: int = doc("Mamba-2 SSD chunk length", 128)
    mamba_conv_width: int = doc("Mamba-2 causal conv1d width", 4)
    mamba_fused_norm: bool = doc("the Mamba mixer's gated RMSNorm inside the fused split-conv1d-scan op (mamba-ssm's "
                                 "rmsnorm_weight path: the SSD output stays ungated and the norm applies the gate); "
                                 "false: megatron's separate norm module after the gated op", False)
    num_attention_heads: int = doc("attention query heads", REQUIRED)
    num_query_groups: Optional[int] = doc("GQA KV heads (null: num_attention_heads)", None)
    kv_channels: Optional[int] = doc("attention head dim (null: hidden_size / num_attention_heads)", None)
    num_moe_experts: Optional[int] = doc("routed experts of each E layer (null: no MoE)", None)
    moe_router_topk: int = doc("experts per token", 2)
    moe_ffn_hidden_size: Optional[int] = doc("routed expert width (null: ffn_hidden_size)", None)
    moe_shared_expert_intermediate_size: Optional[int] = doc("shared expert width (null: none)", None)
    squared_relu: bool = doc("squared-ReLU MLPs/experts (false: GELU)", False)
    moe_router_score_function: str = doc("softmax | sigmoid", "softmax")
    moe_router_enable_expert_bias: bool = doc("aux-loss-free balancing bias", False)
    moe_router_bias_update_rate: float = doc("update rate of the expert bias", 1.0e-3)
    moe_router_topk_scaling_factor: Optional[float] = doc("scale of the top-k routing weights (null: none)", None)
    moe_router_dtype: Optional[str] = doc("router compute dtype: fp32 | fp64 (null: the model's)", None)
    moe_router_load_balancing_type: str = doc("aux_loss | seq_aux_loss | global_aux_loss | sinkhorn | none", "aux_loss")
    moe_aux_loss_coeff: float = doc("load-balancing loss coefficient", 0.0)
    moe_token_dispatcher_type: str = doc("allgather | alltoall (alltoall builds a CUDA stream: GPU only)", "allgather")
    attention_impl: str = doc("sdpa (torch scaled_dot_product_attention) | unfused (megatron DotProductAttention)",
                              "sdpa")
    moe_experts_impl: str = doc("grouped (torch._grouped_mm) | sequential (megatron SequentialMLP)", "grouped")
    use_cpu_initialization: bool = doc("draw every weight on the host from the seed alone (layout-invariant init)",
                                       False)
    recompute: str = doc("activation recompute: none | selective | full", "none")
    recompute_modules: list = doc("selective: core_attn, layernorm, moe, shared_experts, mlp, ssd",
                                  factory=lambda: ["moe", "layernorm"])
    lm_head_loss: str = doc("LM head + loss: plain | chunked | chunked_compiled (nano_hybrid/model/lm_loss.py)",
                            "plain")
    lm_loss_chunk_tokens: int = doc("tokens per chunk of the chunked LM head + loss", 4096)


@dataclass(frozen=True)
class TokenizerSchema:
    type: str = doc("byte (256 bytes + eod + pad) | tiktoken (Megatron TikTokenizer JSON) | hf (HF tokenizer)", "byte")
    path: Optional[str] = doc("tiktoken: the .json file; hf: a tokenizer folder or tokenizer.json", None)
    vocab_size: Optional[int] = doc("tiktoken: ids in all, special ones included (Megatron --vocab-size)", None)
    num_special_tokens: int = doc("tiktoken: leading special ids (Megatron --tiktoken-num-special-tokens)", 1000)
    pattern: str = doc("tiktoken: split regex v1 | v2 (Megatron --tiktoken-pattern)", "v2")


@dataclass(frozen=True)
class DataSchema:
    kind: str = doc("indexed: Megatron .bin/.idx prefixes | mock: megatron MockGPTDataset", "indexed")
    paths: list = doc("indexed-dataset prefixes (no .bin/.idx), relative to the working directory",
                      factory=lambda: ["data/stdlib/stdlib"])
    weights: Optional[list] = doc("blend weights, one per path (null: proportional to size)", None)
    split: Optional[str] = doc("Megatron's train,valid,test split of each prefix's documents (null: all train)",
                               "969,30,1")
    valid_paths: Optional[list] = doc("separate validation prefixes (megatron blend_per_split); null: data.split",
                                      None)
    valid_seed: Optional[int] = doc("shuffle seed of the validation samples (null: the run's seed)", None)
    tokenizer: TokenizerSchema = doc("the tokenizer", factory=TokenizerSchema)
    prepare_if_missing: Optional[str] = doc("a missing path: stdlib = build the stdlib corpus there; null = fail",
                                            "stdlib")
    prepare_workers: int = doc("tokenizer processes when building a missing corpus", 1)
    cache_dir: Optional[str] = doc("GPTDataset index cache (null: <dir of first path>/cache), in a subfolder keyed by "
                                   "the data files' sizes and times (a corpus written again gets new indices)", None)
    num_workers: int = doc("DataLoader workers per rank", 0)
    corpus_dir: Optional[str] = doc("data=corpus: the scripts/prepare_corpus.py folder its paths point into", None)


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
    deterministic: bool = doc("bitwise-repeatable steps: torch's deterministic algorithms, process-wide (cuDNN attention's "
                              "deterministic backward, CUBLAS_WORKSPACE_CONFIG=:4096:8); needs kernels.deterministic",
                              False)
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
    lr_decay_iters: Optional[int] = doc("steps the schedule decays over (WSD: its final wsd_decay_fraction of them); "
                                        "null: train.train_iters. Steps past it stay at min_lr, so a run extended "
                                        "with a larger train.train_iters keeps its schedule when this is pinned", None)
    decay_style: str = doc("WSD | cosine | linear | constant", "WSD")
    wsd_decay_fraction: Optional[float] = doc("WSD: final fraction of train_iters spent decaying", 0.2)
    wsd_decay_style: Optional[str] = doc("WSD decay shape: linear | cosine | exponential | minus_sqrt", "linear")
    init_lr: float = doc("lr at step 0 of the warmup", 0.0)
    override_scheduler: bool = doc("resume: follow this config's LR / weight-decay schedule from the checkpoint's "
                                   "step; false: a checkpoint saved under another schedule is refused with one line "
                                   "naming the differences (Megatron's --override-opt_param-scheduler)", False)
    fused: bool = doc("torch's fused AdamW kernel (one launch per dtype group); false: torch's default", True)
    multi_tensor: str = doc("megatron's multi-tensor ops where neither apex nor transformer-engine provides them "
                            "(gradient norm, clipping, main-to-model parameter copies): foreach (torch._foreach_*: a "
                            "few launches per step) | loop (megatron's local fallback: one op per tensor, and one "
                            "host sync per tensor for the norm)", "foreach")


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
    allow_data_change: bool = doc("resume: continue at the checkpoint's consumed samples although the training data "
                                  "differs from the checkpoint's run (train.seq_length, seed, data.kind / paths / "
                                  "weights / split / tokenizer), said in one line; false: refuse with one line "
                                  "naming the differences", False)


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
    "model": ModelSchema, "data": DataSchema, "train": TrainSchema, "optim": OptimSchema, "checkpoint": CheckpointSchema, "logger": LoggerSchema,
    "parallel": ParallelSchema, "kernels": KernelsSchema, "plan": PlanSchema,
}


@dataclass(frozen=True)
class RunConfig:
    """The validated run config, typed and frozen: what the trainer reads. Not here: ``checkpoint`` (its ``dir``
    follows ``run_dir``, resolved at start-up; ``nano_hybrid.checkpoint`` reads ``cfg``) and ``logger`` (a resumed
    run continues the checkpoint's W&B id, set at start-up)."""

    model: ModelSchema
    data: DataSchema
    train: TrainSchema
    optim: OptimSchema
    parallel: ParallelSchema
    kernels: KernelsSchema
    plan: PlanSchema

    @classmethod
    def from_cfg(cls, cfg) -> "RunConfig":
        """From a composed config that ``nano_hybrid.runconfig.validate`` has checked (values converted to the
        schema's types; a number YAML read as a string, such as 3e-3, becomes a float)."""
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


def required(schema: type) -> tuple[str, ...]:
    """The keys of ``schema`` every config must state (default ``???``)."""
    return tuple(f.name for f in dataclasses.fields(schema) if f.default == REQUIRED)


def optional_defaults(schema: type) -> dict[str, Any]:
    """The schema's defaults of the keys that have one (what a reader of a plain mapping fills in)."""
    return {k: v for k, v in defaults(schema).items() if k not in required(schema)}


def check_keys(cfg) -> None:
    """ConfigError naming the first key of a schema group that the schema does not know (one added with
    ``+group.key=...``), with the closest known key; then the first required key left unset."""
    def walk(node, schema: type, prefix: str) -> None:
        fields = {f.name: f for f in dataclasses.fields(schema)}
        for k in node.keys():
            if OmegaConf.is_missing(node, k):
                continue
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
    for group, schema in GROUPS.items():
        for key in required(schema) if group in cfg else ():
            if key not in cfg[group] or OmegaConf.is_missing(cfg[group], key):
                raise ConfigError(f"{group}.{key} is required: set it in configs/{group}/<name>.yaml or with "
                                  f"{group}.{key}=...")


# Keys read as numbers: a value that is not one (``optim.lr=abc``) is one line naming the key before any work.
# (key, kind, nullable); kind "int" takes whole numbers only.
NUMERIC_KEYS = (
    ("seed", "int", False), ("model.seq_length", "int", False), ("model.vocab_size", "int", False),
    ("optim.lr", "float", False), ("optim.min_lr", "float", False), ("optim.init_lr", "float", False),
    ("optim.weight_decay", "float", False), ("optim.clip_grad", "float", False), ("optim.adam_beta1", "float", False),
    ("optim.adam_beta2", "float", False), ("optim.adam_eps", "float", False), ("optim.warmup_iters", "int", False),
    ("optim.lr_decay_iters", "int", True), ("optim.wsd_decay_fraction", "float", True), ("train.exit_after_minutes", "float", True),
    ("train.torch_threads", "int", True),
    ("data.num_workers", "int", True), ("data.prepare_workers", "int", True),
    ("data.tokenizer.vocab_size", "int", True), ("data.tokenizer.num_special_tokens", "int", True),
)


def check_numbers(cfg: DictConfig) -> None:
    """ConfigError naming the first key of NUMERIC_KEYS whose value is not a number of its kind."""
    for key, kind, nullable in NUMERIC_KEYS:
        v = OmegaConf.select(cfg, key, default=None)
        if v is None and nullable:
            continue
        ok = not isinstance(v, bool) and (isinstance(v, int) if kind == "int" else isinstance(v, (int, float)))
        if not ok and isinstance(v, str) and kind == "float":  # YAML reads 3e-3 (no dot) as a string
            try:
                float(v)
                ok = True
            except ValueError:
                pass
        if not ok:
            what = "a whole number" if kind == "int" else "a number"
            raise ConfigError(f"{key}={v!r} must be {what}" + (" or null" if nullable else ""))


def check_values(cfg: DictConfig) -> None:
    """ConfigError naming the first schema key whose value its type does not allow: a yes/no key that is not true
    or false, a number key that is not finite (nan, inf)."""
    def walk(node, schema: type, prefix: str) -> None:
        for f in dataclasses.fields(schema):
            if f.name not in node:
                continue
            key, kind = f"{prefix}.{f.name}", str(f.type).removeprefix("Optional[").removesuffix("]")
            v = OmegaConf.select(node, f.name, default=None)
            if dataclasses.is_dataclass(f.default_factory) and v is not None:
                walk(node[f.name], f.default_factory, key)
            elif v is None:
                continue
            elif kind == "bool" and not isinstance(v, bool):
                raise ConfigError(f"{key}={v!r} must be true or false")
            elif kind == "float" and not isinstance(v, bool):
                try:
                    finite = math.isfinite(float(v))
                except (TypeError, ValueError):
                    continue  # not a number: check_numbers names it
                if not finite:
                    raise ConfigError(f"{key}={v!r} must be a finite number")

    for group, schema in GROUPS.items():
        if group in cfg and cfg[group] is not None:
            walk(cfg[group], schema, group)


def positive_int(cfg: DictConfig, key: str) -> int:
    """The key's value; ConfigError naming the key unless it is a positive integer."""
    v = OmegaConf.select(cfg, key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"{key}={v!r} must be a positive integer")
    return v
