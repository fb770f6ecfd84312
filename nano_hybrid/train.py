"""Pretrain the Nemotron-3 Nano hybrid (or a slice / tiny variant) with megatron-core.

    python -m nano_hybrid.train                                   # model=tiny on CPU, stdlib corpus
    python -m nano_hybrid.train recipe=tiny_cpu train.train_iters=50
    torchrun --nproc-per-node 2 -m nano_hybrid.train parallel=dp2 kernels.backend=mamba_ssm

Flow: compose the config -> validate everything (config values, data, kernel backend, parallel sizes)
-> init process groups -> model, Megatron DDP, Megatron optimizer, LR schedule, data -> [checkpoint
load] -> loop: step, log, [checkpoint save] -> shutdown. Any bad input stops before work with one
``error: ...`` line and exit code 2.

One step = ``global_batch_size`` samples: megatron's ``get_forward_backward_func`` runs the
micro-batches (grad accumulation, pipeline schedule when PP > 1) with ``finalize_model_grads`` (DP
grad reduction, MoE router expert-bias update), then the optimizer step (grad clipping inside), then
the scheduler step.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

from nano_hybrid.errors import RunError, decided_on_rank0, filter_startup_warnings, report_error  # noqa: E402

filter_startup_warnings()  # known harmless megatron-core start-up warnings (no TE/Apex): nano_hybrid/errors.py

import torch  # noqa: E402
from omegaconf import DictConfig, OmegaConf, open_dict  # noqa: E402

from nano_hybrid.checkpoint import Checkpointer, check_settings as check_checkpoint_settings  # noqa: E402
from nano_hybrid.config import ConfigError, compose, overrides_from_argv  # noqa: E402
from nano_hybrid.data import (  # noqa: E402
    DataConfigError,
    DataPreparationError,
    DataSpec,
    TokenizerError,
    TokenizerSpec,
    build_data_iterator,
    build_datasets,
    build_tokenizer,
    corpus_tokenizer_type,
    ensure_corpus,
    missing_paths,
    padded_vocab_size,
)
from nano_hybrid.data.check import CorpusCheckError, check_corpus  # noqa: E402
from nano_hybrid.signals import ExitRequest  # noqa: E402

EXIT_BAD_INPUT = 2
# The only places data.prepare_if_missing=stdlib builds the stdlib corpus: byte tokens (data=default) and the
# 131k Tekken BPE (data=stdlib_bpe131k, the Nano default), each with the configured data.tokenizer.
DEFAULT_CORPORA = ("data/stdlib/stdlib", "data/stdlib_bpe131k/stdlib")
DEFAULT_CORPUS = DEFAULT_CORPORA[0]


@dataclass
class TrainState:
    """Loop position; the checkpointer saves and restores it (and the data position follows from it)."""

    step: int = 0  # optimizer steps completed
    consumed_samples: int = 0  # global samples consumed (= data position)
    consumed_tokens: int = 0  # global tokens consumed (W&B x-axis)

    def advance(self, samples: int, seq_length: int) -> None:
        self.step += 1
        self.consumed_samples += samples
        self.consumed_tokens += samples * seq_length

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class RunPlan:
    """Everything derived from the config during validation (before any process group or model exists)."""

    world_size: int
    rank: int
    local_rank: int
    device: torch.device
    dtype: torch.dtype
    dp_size: int
    num_microbatches: int
    backend_name: str
    data: DataSpec
    seq_length: int
    tokenizer: Any
    tokenizer_spec: Any = None  # nano_hybrid.data.TokenizerSpec (workers of a corpus build rebuild it)
    eval_interval: int = 0  # validation every N steps (0: none)
    eval_iters: int = 0  # global batches per validation
    backend: Any = None  # the kernels.registry.KernelBackend validation resolved (build_model reuses it)


# ------------------------------------------------------------------------------------- validation
def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise ConfigError(f"environment variable {name}={os.environ[name]!r} is not an integer") from None


# Keys read as numbers: a value that is not one (``optim.lr=abc``) is one line naming the key before any work.
# (key, kind, nullable); kind "int" takes whole numbers only.
NUMERIC_KEYS = (
    ("seed", "int", False), ("model.seq_length", "int", False), ("model.vocab_size", "int", False),
    ("optim.lr", "float", False), ("optim.min_lr", "float", False), ("optim.init_lr", "float", False),
    ("optim.weight_decay", "float", False), ("optim.clip_grad", "float", False), ("optim.adam_beta1", "float", False),
    ("optim.adam_beta2", "float", False), ("optim.adam_eps", "float", False), ("optim.warmup_iters", "int", False),
    ("optim.wsd_decay_fraction", "float", True), ("train.exit_after_minutes", "float", True),
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


def _positive_int(cfg: DictConfig, key: str) -> int:
    v = OmegaConf.select(cfg, key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"{key}={v!r} must be a positive integer")
    return v


def resolve_device(name: str, local_rank: int) -> torch.device:
    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"train.device={name!r}; choose auto, cpu or cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but torch sees no CUDA GPU (use train.device=cpu or auto)")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name, local_rank) if name == "cuda" else torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"train.precision={name!r}; choose auto, bf16 or fp32")
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "bf16" and device.type != "cuda":
        raise ConfigError("train.precision=bf16 needs a CUDA device; CPU training runs in fp32")
    return torch.bfloat16 if name == "bf16" else torch.float32


def validate_optim(o: DictConfig, train_iters: int) -> None:
    if str(o.optimizer) != "adam":
        raise ConfigError(f"optim.optimizer={o.optimizer!r}; supported: adam (AdamW, decoupled weight decay)")
    if not isinstance(o.get("fused", False), bool):
        raise ConfigError(f"optim.fused={o.get('fused')!r} must be true or false")
    for key in ("lr", "adam_beta1", "adam_beta2", "adam_eps"):
        if not float(o[key]) > 0:
            raise ConfigError(f"optim.{key}={o[key]} must be > 0")
    if not 0 <= float(o.min_lr) <= float(o.lr):
        raise ConfigError(f"optim.min_lr={o.min_lr} must be in [0, optim.lr={o.lr}]")
    if not 0 <= float(o.init_lr) <= float(o.lr):
        raise ConfigError(f"optim.init_lr={o.init_lr} must be in [0, optim.lr={o.lr}]")
    if float(o.weight_decay) < 0 or float(o.clip_grad) < 0:
        raise ConfigError(f"optim.weight_decay={o.weight_decay} and optim.clip_grad={o.clip_grad} must be >= 0")
    if not 0 <= int(o.warmup_iters) < train_iters:
        raise ConfigError(f"optim.warmup_iters={o.warmup_iters} must be in [0, train.train_iters={train_iters})")
    style = str(o.decay_style)
    if style not in ("WSD", "cosine", "linear", "constant"):
        raise ConfigError(f"optim.decay_style={style!r}; choose WSD, cosine, linear or constant")
    if style == "WSD":
        frac = o.wsd_decay_fraction
        if frac is None or not 0 < float(frac) <= 1:
            raise ConfigError(f"optim.wsd_decay_fraction={frac} must be in (0, 1] for decay_style=WSD")
        if str(o.wsd_decay_style) not in ("linear", "cosine", "exponential", "minus_sqrt"):
            raise ConfigError(f"optim.wsd_decay_style={o.wsd_decay_style!r}; choose linear, cosine, exponential or minus_sqrt")


def validate(cfg: DictConfig) -> RunPlan:
    """Check every setting that can be checked without doing work; raise one clear error."""
    from nano_hybrid.metrics import WANDB_MODES
    from nano_hybrid.model.build import resolve_backend
    from nano_hybrid.model.lm_loss import check_lm_head_parallel
    from nano_hybrid.parallel import validate_parallel

    world_size, rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    t = cfg.train
    check_numbers(cfg)
    mbs, gbs = _positive_int(cfg, "train.micro_batch_size"), _positive_int(cfg, "train.global_batch_size")
    seq = _positive_int(cfg, "train.seq_length")
    iters = _positive_int(cfg, "train.train_iters")
    _positive_int(cfg, "train.log_interval")
    if seq > int(cfg.model.seq_length):
        raise ConfigError(f"train.seq_length={seq} exceeds model.seq_length={cfg.model.seq_length}")
    if t.exit_after_minutes is not None and not float(t.exit_after_minutes) > 0:
        raise ConfigError(f"train.exit_after_minutes={t.exit_after_minutes} must be > 0 or null")
    if t.torch_threads is not None and int(t.torch_threads) <= 0:
        raise ConfigError(f"train.torch_threads={t.torch_threads} must be a positive integer or null")
    mss = t.get("max_skipped_steps")
    if mss is not None and (not isinstance(mss, int) or isinstance(mss, bool) or mss <= 0):
        raise ConfigError(f"train.max_skipped_steps={mss!r} must be a positive integer or null")
    check_checkpoint_settings(cfg.checkpoint)
    device = resolve_device(str(t.device), local_rank)
    dtype = resolve_dtype(str(t.precision), device)
    validate_optim(cfg.optim, iters)

    # Parallel layout against the model and the world size (names the offending numbers).
    dp = validate_parallel(cfg, world_size)["dp"]
    try:  # the chunked LM head + loss has no vocab-parallel form
        check_lm_head_parallel(OmegaConf.to_container(cfg.model, resolve=True),
                               int(cfg.parallel.tensor_model_parallel_size))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if gbs % (mbs * dp):
        raise ConfigError(
            f"train.global_batch_size={gbs} must be a multiple of train.micro_batch_size={mbs} x data-parallel size {dp}"
        )
    # The memory planner (nano_hybrid.plan) against this GPU: refuse a run that cannot fit.
    memory_check = t.get("memory_check", True)
    if not isinstance(memory_check, bool):
        raise ConfigError(f"train.memory_check={memory_check!r} must be true or false")
    if memory_check and device.type == "cuda":
        from nano_hybrid.plan import check_memory

        check_memory(cfg, world_size, torch.cuda.get_device_properties(device).total_memory)

    # Data and tokenizer: the tokenizer's ids must fit the model's embedding, padded as Megatron pads it.
    try:
        tok_spec = TokenizerSpec.from_cfg(cfg.data.tokenizer)
        tokenizer = build_tokenizer(tok_spec)
    except TokenizerError as e:
        raise ConfigError(str(e)) from None
    tp = int(cfg.parallel.get("tensor_model_parallel_size", 1))
    divisible_by = int(cfg.model.get("make_vocab_size_divisible_by", 128))
    model_vocab = padded_vocab_size(int(cfg.model.vocab_size), divisible_by, tp)
    if tokenizer.vocab_size > model_vocab:
        raise ConfigError(
            f"the {tok_spec.type} tokenizer has {tokenizer.vocab_size:,} ids but the model's embedding has {model_vocab:,} "
            f"(model.vocab_size={cfg.model.vocab_size} padded to a multiple of make_vocab_size_divisible_by={divisible_by} "
            f"x TP={tp}); raise model.vocab_size or pick a smaller tokenizer"
        )
    eval_interval = OmegaConf.select(cfg, "train.eval_interval", default=0)
    if not isinstance(eval_interval, int) or isinstance(eval_interval, bool) or eval_interval < 0:
        raise ConfigError(f"train.eval_interval={eval_interval!r} must be an integer >= 0 (0: no validation)")
    eval_iters = _positive_int(cfg, "train.eval_iters") if eval_interval else 0
    spec = DataSpec.from_cfg(cfg.data)
    missing = missing_paths(spec) if spec.kind == "indexed" else []
    prepare = cfg.data.get("prepare_if_missing")
    if missing and (prepare is None or len(spec.paths) != 1):
        raise DataConfigError(
            f"data path not found: {', '.join(m + '.bin/.idx' for m in missing)}"
            + ("" if prepare is None else " (data.prepare_if_missing builds a single-path corpus only)")
        )
    if missing and str(prepare) != "stdlib":
        raise DataConfigError(f"data.prepare_if_missing={prepare!r}; supported: stdlib or null")
    if eval_interval and spec.kind == "mock":
        raise DataConfigError("data=mock has no validation data (synthetic tokens); set train.eval_interval=0")
    if eval_interval and spec.kind == "indexed" and not spec.valid_paths and not spec.split_has_valid:
        raise DataConfigError(
            f"train.eval_interval={eval_interval} but data.split={spec.split!r} leaves no validation documents "
            "(e.g. data.split=\"969,30,1\", or set data.valid_paths)"
        )
    if missing and os.path.abspath(spec.paths[0]) not in {os.path.abspath(p) for p in DEFAULT_CORPORA}:
        raise DataConfigError(
            f"data path not found: {spec.paths[0]}.bin/.idx (data.prepare_if_missing=stdlib builds the default "
            f"corpus only at its default locations {', '.join(DEFAULT_CORPORA)}; build other corpora with "
            "scripts/prepare_data.py)"
        )
    for p in spec.paths + spec.valid_paths:
        if p not in missing:  # .idx and .bin agree (sizes) and match the fingerprint preparation recorded
            try:
                check_corpus(p)
            except CorpusCheckError as e:
                raise DataConfigError(str(e)) from None
        written_with = corpus_tokenizer_type(p)  # a corpus written by prepare_data records its tokenizer
        if written_with is not None and written_with != tok_spec.type:
            raise DataConfigError(
                f"{p} was tokenized with the {written_with} tokenizer but data.tokenizer.type={tok_spec.type}"
            )

    # unknown / unavailable backends raise their own one-line errors, bad switches / settings a ConfigError
    backend = resolve_backend(cfg)
    if str(cfg.logger.wandb.mode) not in WANDB_MODES:
        raise ConfigError(f"logger.wandb.mode={cfg.logger.wandb.mode!r}; choose one of {', '.join(WANDB_MODES)}")
    init_hf = OmegaConf.select(cfg, "checkpoint.init_from_hf")
    if init_hf not in (None, ""):  # the folder's config.json must describe this model (first mismatch named)
        from nano_hybrid.hf import HFBridgeError, MappingError, check_init_from_hf

        try:
            check_init_from_hf(cfg, str(init_hf))
        except (HFBridgeError, MappingError) as e:
            raise ConfigError(str(e)) from None
    return RunPlan(
        world_size=world_size,
        rank=rank,
        local_rank=local_rank,
        device=device,
        dtype=dtype,
        dp_size=dp,
        num_microbatches=gbs // (mbs * dp),
        backend_name=backend.name,
        backend=backend,
        data=spec,
        seq_length=seq,
        tokenizer=tokenizer,
        tokenizer_spec=tok_spec,
        eval_interval=eval_interval,
        eval_iters=eval_iters,
    )


# ------------------------------------------------------------------------------------------ setup
def init_distributed(plan: RunPlan, cfg: DictConfig) -> None:
    """Process group (NCCL on GPU, gloo on CPU), megatron's model-parallel groups and RNG streams."""
    from nano_hybrid.parallel import initialize_parallel

    initialize_parallel(cfg, backend="nccl" if plan.device.type == "cuda" else "gloo")


def resolve_run_dir(cfg: DictConfig, plan: RunPlan) -> Path:
    """``cfg.run_dir`` or runs/<model>-<backend>-<UTC time>, taken from rank 0 so all ranks agree."""
    import torch.distributed as dist

    if cfg.run_dir is not None:
        run_dir = str(cfg.run_dir)
    else:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        box = [f"runs/{cfg.model.name}-{plan.backend_name}-{stamp}"]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        run_dir = box[0]
    with open_dict(cfg):
        cfg.run_dir = run_dir  # later interpolations (e.g. checkpoint.dir) see the resolved path
    return Path(run_dir)


_RUN_LOCK: list = []  # rank 0's lock on run_dir, held until the process exits
_CLAIMED_DIRS: list[Path] = []  # directories claim_run_dir created (removed again when the start is refused)


def claim_run_dir(run_dir: Path, ckpt_dir: Path) -> None:
    """Rank 0: write probes in run_dir and checkpoint.dir, then the exclusive run-dir lock (one line if not)."""
    from nano_hybrid.runlock import RunLock
    from nano_hybrid.storage import check_writable

    for d in (run_dir, ckpt_dir):
        new = [p for p in (d, *d.parents) if not p.exists()]
        _CLAIMED_DIRS.extend(p for p in reversed(new) if p not in _CLAIMED_DIRS)
    check_writable(run_dir, "run_dir")
    check_writable(ckpt_dir, "checkpoint.dir")
    _RUN_LOCK.append(RunLock(run_dir).acquire())


def release_refused_start() -> None:
    """A start refused before its first step leaves the run directory as it found it: the lock goes, and the
    directories the claim created go again when they are still empty."""
    while _RUN_LOCK:
        _RUN_LOCK.pop().release()
    for d in sorted(_CLAIMED_DIRS, key=lambda p: len(p.parts), reverse=True):
        try:
            d.rmdir()
        except OSError:
            pass  # not empty (something was written there) or already gone
    _CLAIMED_DIRS.clear()


def prepare_data(plan: RunPlan, cfg: DictConfig, log) -> None:
    """Build a missing default corpus on rank 0 (others wait); fail loudly if that is impossible."""
    def build() -> None:
        try:
            ensure_corpus(plan.data.paths[0], cfg.data.get("prepare_if_missing"), log=log,
                          tokenizer=plan.tokenizer_spec, workers=int(cfg.data.get("prepare_workers") or 1))
        except DataPreparationError as e:  # shared with the waiting ranks, printed once
            raise RunError(str(e)) from None

    if plan.data.kind == "indexed":
        decided_on_rank0(build)
    missing = missing_paths(plan.data) if plan.data.kind == "indexed" else []
    if missing:  # e.g. rank 0 wrote to a node-local path this rank cannot see
        raise DataPreparationError(f"data path(s) not visible on rank {plan.rank}: {missing}")


def build_dataset(plan: RunPlan, cfg: DictConfig):
    """(train, valid) datasets, built on every rank at once: megatron's builder builds the index cache on rank 0
    first (its own barrier), then the others read it. ``valid`` holds ``eval_iters x global_batch_size`` samples
    (None without validation). A split too small for the run is the same DataConfigError on every rank."""
    gbs = int(cfg.train.global_batch_size)
    num_samples = int(cfg.train.train_iters) * gbs
    return build_datasets(plan.data, plan.tokenizer, plan.seq_length, num_samples, int(cfg.seed), plan.eval_iters * gbs)


def plan_for_backend(plan: RunPlan, cfg: DictConfig) -> RunPlan:
    """``plan`` with the kernel backend of ``cfg.kernels`` (for tools that run several backends in one process after
    changing ``cfg.kernels.backend``): validation resolves the backend once, this resolves it again for the new one."""
    import dataclasses

    from nano_hybrid.model.build import resolve_backend

    return dataclasses.replace(plan, backend=resolve_backend(cfg), backend_name=str(cfg.kernels.backend))


def build_model_and_optimizer(plan: RunPlan, cfg: DictConfig, *, init_from_hf: str | None = None,
                              with_optimizer: bool = True):
    """Model -> (Float16Module on bf16) -> Megatron DDP; Megatron optimizer; OptimizerParamScheduler.

    ``init_from_hf``: a Hugging Face Nemotron-H folder whose weights replace the initial ones (each rank
    its own slice), before the optimizer takes its copy of them. ``with_optimizer=False`` (forward+backward
    measurements of models whose optimizer states do not fit) returns ``(ddp, None, None)``: no fp32 main
    weights, no Adam states."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module

    from nano_hybrid.model import build_model
    from nano_hybrid.optim import set_adam_fused

    if plan.backend is not None and plan.backend_name != str(cfg.kernels.backend):
        raise ValueError(f"the plan holds kernel backend {plan.backend_name!r} but cfg.kernels.backend is "
                         f"{cfg.kernels.backend!r}: pass plan_for_backend(plan, cfg)")
    model = build_model(cfg, device=plan.device, dtype=plan.dtype, backend=plan.backend)
    if init_from_hf:
        from nano_hybrid.hf import load_hf_weights

        info = load_hf_weights(model, init_from_hf, cfg)
        if plan.rank == 0:
            print(f"init_from_hf: {info['tensors']} tensors from {init_from_hf} in {info['seconds']:.1f}s", flush=True)
    config = model.config
    if plan.dtype == torch.bfloat16:
        model = Float16Module(config, model)
    use_dist_opt = bool(cfg.parallel.use_distributed_optimizer)
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=use_dist_opt,
            check_for_nan_in_grad=False,
        ),
        model,
    )
    # What megatron's schedule calls around the micro-batches: DP no_sync for all but the last
    # micro-batch, then finalize_model_grads (grad all-reduce / reduce-scatter, MoE expert-bias update).
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    if not with_optimizer:
        return ddp, None, None
    o = cfg.optim
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=float(o.lr),
        min_lr=float(o.min_lr),
        weight_decay=float(o.weight_decay),
        adam_beta1=float(o.adam_beta1),
        adam_beta2=float(o.adam_beta2),
        adam_eps=float(o.adam_eps),
        clip_grad=float(o.clip_grad),
        bf16=plan.dtype == torch.bfloat16,
        params_dtype=plan.dtype,
        use_distributed_optimizer=use_dist_opt,
    )
    with cpu_compat_mode(plan):
        optimizer = get_megatron_optimizer(opt_config, [ddp])
    set_adam_fused(optimizer, bool(o.get("fused", False)))  # optim.fused: torch's fused AdamW kernel
    iters = int(cfg.train.train_iters)
    style = str(o.decay_style)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=float(o.init_lr),
        max_lr=float(o.lr),
        min_lr=float(o.min_lr),
        lr_warmup_steps=int(o.warmup_iters),
        lr_decay_steps=iters,
        lr_decay_style=style,
        start_wd=float(o.weight_decay),
        end_wd=float(o.weight_decay),
        wd_incr_steps=iters,
        wd_incr_style="constant",
        wsd_decay_steps=max(1, round(float(o.wsd_decay_fraction) * iters)) if style == "WSD" else None,
        lr_wsd_decay_style=str(o.wsd_decay_style) if style == "WSD" else None,
    )
    config.grad_scale_func = optimizer.scale_loss
    return ddp, optimizer, scheduler


def cpu_compat_mode(plan: RunPlan):
    """megatron's optimizer and schedules hard-code device='cuda' in places; on CPU run them under CudaToCpuMode."""
    import contextlib

    if plan.device.type == "cuda":
        return contextlib.nullcontext()
    from nano_hybrid.mcore_compat import CudaToCpuMode

    return CudaToCpuMode()


# ------------------------------------------------------------------------------------------- step
def _forward_step(data_iterator, model, *, device: torch.device, attention_mask):
    batch = next(data_iterator)
    tokens = batch["tokens"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    position_ids = batch["position_ids"].to(device, non_blocking=True)
    loss_mask = batch["loss_mask"].to(device, non_blocking=True)
    output = model(tokens, position_ids, attention_mask, labels=labels)  # per-token loss [b, s]
    return output, partial(_loss_func, loss_mask)


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    losses = output.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    # (loss summed over the micro-batch, its token count, values to report)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), mask.sum()])}


def causal_mask_for(cfg: DictConfig, seq_length: int, device: torch.device):
    """None when core attention applies causal masking itself (sdpa); else megatron's bool mask (True = masked)."""
    if str(cfg.model.get("attention_impl", "sdpa")) == "sdpa" or "*" not in str(cfg.model.hybrid_override_pattern):
        return None
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool, device=device), diagonal=1)[None, None]


def forward_backward(ctx: "Trainer") -> list:
    """Zeroed gradients, then forward and backward over one global batch (``num_microbatches`` micro-batches
    from ``ctx.data_iterator``); the gradients are left in megatron DDP's buffers (``param.main_grad``).
    Returns the schedule's per-micro-batch loss reports."""

    plan, cfg = ctx.plan, ctx.cfg
    ctx.model.zero_grad_buffer()
    if ctx.optimizer is not None:
        ctx.optimizer.zero_grad()
    # On CPU the schedule needs CudaToCpuMode too: schedules.py:596 allocates its token counter with
    # device="cuda" (forward_backward_no_pipelining; same in the pipelined schedules).
    with cpu_compat_mode(plan):
        return run_schedule(ctx, ctx.data_iterator, forward_only=False)


def run_schedule(ctx: "Trainer", data_iterator, *, forward_only: bool) -> list:
    """Megatron's forward(-backward) schedule over one global batch from ``data_iterator``: the per-micro-batch
    loss reports. The caller provides the context (``cpu_compat_mode``, ``no_grad`` for evaluation)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    plan = ctx.plan
    return get_forward_backward_func()(
        forward_step_func=partial(_forward_step, device=plan.device, attention_mask=ctx.attention_mask),
        data_iterator=data_iterator,
        model=[ctx.model],
        num_microbatches=plan.num_microbatches,
        seq_length=plan.seq_length,
        micro_batch_size=int(ctx.cfg.train.micro_batch_size),
        decoder_seq_length=plan.seq_length,
        forward_only=forward_only,
    )


def train_step(ctx: "Trainer") -> dict[str, float]:
    """One optimizer step over ``global_batch_size`` samples; returns loss, grad norm, lr and aux losses."""
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
    )

    from nano_hybrid.stepguard import guarded_step

    plan, cfg = ctx.plan, ctx.cfg
    reports = forward_backward(ctx)
    # Loss over the global batch: sum(loss), sum(tokens) over micro-batches, then over all ranks
    # (ratios are unchanged by TP replicas; PP stages other than the last contribute zeros).
    acc = torch.zeros(2, dtype=torch.float64, device=plan.device)
    for r in reports:
        acc += r["lm loss"].to(torch.float64)
    dist.all_reduce(acc)
    loss = (acc[0] / acc[1].clamp(min=1)).item()
    with cpu_compat_mode(plan):  # a non-finite loss or gradient norm skips the update (same on all ranks)
        update_ok, grad_norm = guarded_step(ctx.optimizer, loss)
    if update_ok:
        ctx.scheduler.step(increment=1)
    out = {
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": float(ctx.optimizer.param_groups[0]["lr"]),
        "skipped": 0 if update_ok else 1,
    }
    tracker = get_moe_layer_wise_logging_tracker()
    if tracker:
        reduce_aux_losses_tracker_across_ranks()
        n_moe = max(1, str(cfg.model.hybrid_override_pattern).count("E"))
        for name, entry in tracker.items():
            # summed over layers and micro-batches -> mean per MoE layer and micro-batch
            out[name.replace(" ", "_")] = entry["values"].float().sum().item() / n_moe / plan.num_microbatches
        clear_aux_losses_tracker()
    return out


def evaluate(ctx: "Trainer") -> dict[str, float]:
    """Validation loss over the first ``eval_iters`` global batches of the validation split, the same batches
    at every evaluation (so the curve compares like with like and a resumed run sees what the uninterrupted
    one saw). Forward only through megatron's schedule (any DP/TP/PP/EP layout; this rank's DP slice of each
    global batch), under no_grad (the MoE router keeps no token counts), the model in eval mode, and the RNG
    state (DataLoader seeds) restored afterwards so training draws the same numbers with or without it."""
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    plan, cfg = ctx.plan, ctx.cfg
    t0 = time.perf_counter()
    devices = [plan.device] if plan.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        iterator = build_data_iterator(ctx.valid_dataset, 0, int(cfg.train.micro_batch_size), ctx.dp_rank, plan.dp_size, 0)
        ctx.model.eval()
        acc = torch.zeros(2, dtype=torch.float64, device=plan.device)
        try:
            with torch.no_grad(), cpu_compat_mode(plan):
                for _ in range(plan.eval_iters):
                    reports = run_schedule(ctx, iterator, forward_only=True)
                    for r in reports:
                        acc += r["lm loss"].to(torch.float64)
        finally:
            ctx.model.train()
            clear_aux_losses_tracker()
    dist.all_reduce(acc)  # ratios are unchanged by TP replicas; PP stages other than the last add zeros
    val_loss = (acc[0] / acc[1].clamp(min=1)).item()
    _sync(plan.device)
    return {
        "val_loss": val_loss,
        "val_ppl": math.exp(min(val_loss, 700.0)),
        "val_tokens": plan.eval_iters * int(cfg.train.global_batch_size) * plan.seq_length,
        "eval_time_s": time.perf_counter() - t0,
    }


def eval_due(plan: RunPlan, step: int, train_iters: int) -> bool:
    return plan.eval_interval > 0 and (step % plan.eval_interval == 0 or step == train_iters)


# ------------------------------------------------------------------------------------------- loop
@dataclass
class Trainer:
    cfg: DictConfig
    plan: RunPlan
    run_dir: Path
    model: Any
    optimizer: Any
    scheduler: Any
    dataset: Any
    state: TrainState
    logger: Any
    flops_per_token: float
    attention_mask: Any = None
    data_iterator: Any = None
    checkpointer: Any = None  # nano_hybrid.checkpoint.Checkpointer
    valid_dataset: Any = None  # eval_iters global batches of the validation split (None: no validation)

    def start_data(self) -> None:
        """(Re)start the data stream at ``state.consumed_samples`` (call after a checkpoint load)."""
        self.data_iterator = build_data_iterator(
            self.dataset,
            self.state.consumed_samples,
            int(self.cfg.train.micro_batch_size),
            self.dp_rank,
            self.plan.dp_size,
            self.plan.data.num_workers,
        )

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()


def setup(cfg: DictConfig, plan: RunPlan, *, with_optimizer: bool = True, resume: bool = True) -> Trainer:
    """Distributed state, run folder, data, model (and, unless ``with_optimizer=False``, optimizer and schedule),
    then the checkpoint to resume (``resume``). Nothing is written into the run directory before every check
    and the resume have passed: ``config.yaml``, ``metrics.jsonl`` and W&B start last."""
    from nano_hybrid.arch import HybridArch
    from nano_hybrid.flops import training_flops_per_token
    from nano_hybrid.metrics import MetricsLogger

    if cfg.train.torch_threads is not None:
        torch.set_num_threads(int(cfg.train.torch_threads))
    init_distributed(plan, cfg)
    run_dir = resolve_run_dir(cfg, plan)
    # Before any work: run_dir and checkpoint.dir take a write, and no other trainer uses run_dir.
    decided_on_rank0(claim_run_dir, run_dir, Path(str(cfg.checkpoint.dir)))
    # Find the checkpoint to resume now (a bad checkpoint.load fails before any work) and continue its W&B run.
    checkpointer = Checkpointer(cfg)
    if checkpointer.locate() is not None and cfg.logger.wandb.id is None:
        with open_dict(cfg):
            cfg.logger.wandb.id = checkpointer.resume_wandb_run_id
    say = (lambda msg: print(msg, flush=True)) if plan.rank == 0 else (lambda msg: None)
    prepare_data(plan, cfg, say)
    dataset, valid_dataset = build_dataset(plan, cfg)
    # checkpoint.init_from_hf starts a fresh run only; a run that resumes loads its own checkpoint
    init_hf = OmegaConf.select(cfg, "checkpoint.init_from_hf") if checkpointer.load_path is None else None
    model, optimizer, scheduler = build_model_and_optimizer(plan, cfg, init_from_hf=str(init_hf) if init_hf else None,
                                                            with_optimizer=with_optimizer)
    if (with_optimizer and bool(cfg.checkpoint.check_free_space)
            and (checkpointer.interval or checkpointer.save_on_exit)):
        decided_on_rank0(checkpointer.check_free_space, model, optimizer, int(cfg.train.train_iters))
    state = TrainState()
    if resume:  # a checkpoint this model cannot load is refused here, before the run directory changes
        checkpointer.resume(model, optimizer, scheduler, state, init_from_hf=str(init_hf) if init_hf else None)
    unwrapped = model.module.module if plan.dtype == torch.bfloat16 else model.module
    flops = training_flops_per_token(HybridArch.from_megatron(unwrapped), plan.seq_length)
    if plan.rank == 0:
        report_data_epochs(dataset, int(cfg.train.train_iters) * int(cfg.train.global_batch_size), plan.seq_length,
                           state.consumed_samples, say)
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    logger = MetricsLogger(
        run_dir,
        rank=plan.rank,
        train_iters=int(cfg.train.train_iters),
        backend=plan.backend_name,
        wandb_cfg=cfg.logger.wandb,
        run_config=OmegaConf.to_container(cfg, resolve=True),
        start_step=checkpointer.resume_step,  # records after it (a crashed segment's) are re-run: dropped
    )
    n_params = sum(p.numel() for p in unwrapped.parameters())
    logger.print(
        f"nano-hybrid: model={cfg.model.name} ({n_params / 1e6:.2f}M params on rank 0) backend={plan.backend_name} "
        f"device={plan.device.type} dtype={str(plan.dtype).removeprefix('torch.')} world={plan.world_size} "
        f"dp={plan.dp_size} mbs={cfg.train.micro_batch_size} gbs={cfg.train.global_batch_size} "
        f"seq={plan.seq_length} run_dir={run_dir}"
    )
    return Trainer(
        cfg=cfg,
        plan=plan,
        run_dir=run_dir,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        dataset=dataset,
        valid_dataset=valid_dataset,
        state=state,
        logger=logger,
        flops_per_token=flops,
        attention_mask=causal_mask_for(cfg, plan.seq_length, plan.device),
        checkpointer=checkpointer,
    )


def report_data_epochs(dataset, num_samples: int, seq_length: int, consumed_samples: int, say) -> float | None:
    """Say how many passes over the training split the run reads (and warn when it repeats data); returns it."""
    from nano_hybrid.data import train_split_tokens

    tokens = train_split_tokens(dataset)
    if not tokens:
        return None  # synthetic data (data=mock)
    epochs = num_samples * seq_length / tokens
    left = (num_samples - consumed_samples) * seq_length / tokens
    say(f"data: the training split holds {tokens:,} tokens; the run reads {num_samples:,} samples x {seq_length} "
        f"tokens = {epochs:.3g} epochs" + (f" ({left:.3g} from this start)" if consumed_samples else ""))
    if epochs > 1:
        say(f"warning: the run repeats its training data ({epochs:.1f} epochs): the loss then measures memorisation; "
            "use a larger corpus or fewer train.train_iters for a pretraining curve")
    return epochs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_loop(ctx: Trainer, stop=None) -> str | None:
    """Train until ``train.train_iters``, or until ``stop`` (an ExitRequest) asks; returns the stop reason."""
    from nano_hybrid.metrics import peak_memory_gb
    from nano_hybrid.stepguard import SkipCounter

    cfg, plan, state = ctx.cfg, ctx.plan, ctx.state
    iters, gbs = int(cfg.train.train_iters), int(cfg.train.global_batch_size)
    log_every = int(cfg.train.log_interval)
    tokens_per_step = gbs * plan.seq_length
    skips = SkipCounter(cfg.train.get("max_skipped_steps"))
    while state.step < iters:
        _sync(plan.device)
        t0 = time.perf_counter()
        out = train_step(ctx)  # .item() inside syncs with the device
        _sync(plan.device)
        dt = time.perf_counter() - t0
        state.advance(gbs, plan.seq_length)
        tps = tokens_per_step / dt
        rec = {
            "step": state.step,
            "tokens": state.consumed_tokens,
            "consumed_samples": state.consumed_samples,
            "loss": out.pop("loss"),
            "lr": out.pop("lr"),
            "grad_norm": out.pop("grad_norm"),
            "step_time_s": dt,
            "tokens_per_step": tokens_per_step,
            "tokens_per_s": tps,
            "tokens_per_s_per_gpu": tps / plan.world_size,
            "tflops_per_gpu": ctx.flops_per_token * tps / plan.world_size / 1e12,
            "mem_gb": peak_memory_gb(),
            "world_size": plan.world_size,
            **out,
        }
        if eval_due(plan, state.step, iters):  # validation keys join this step's record (and console line)
            rec.update(evaluate(ctx))
        ctx.logger.log_step(rec, console=state.step % log_every == 0 or state.step in (1, iters) or "val_loss" in rec)
        skips.update(bool(rec["skipped"]), state.step, rec)  # too many in a row: TrainingDivergedError
        if ctx.checkpointer is not None and not rec["skipped"]:  # a skipped step is never checkpointed
            ctx.checkpointer.maybe_save(state, ctx.model, ctx.optimizer, ctx.scheduler, wandb_run_id=ctx.logger.wandb_run_id)
        reason = stop.should_exit() if stop is not None else None  # collective: all ranks stop after the same step
        if reason is not None:
            ctx.logger.print(f"stopping after step {state.step} ({reason})")
            return reason
    return None


def shutdown(ctx: Trainer | None) -> None:
    from nano_hybrid.parallel import destroy_parallel

    if ctx is not None:
        ctx.logger.close()
    destroy_parallel()


def main(argv: list[str] | None = None) -> int:
    from kernels.registry import BackendUnavailableError, UnknownBackendError

    t_start = time.monotonic()  # train.exit_after_minutes counts from here (start-up included)
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = compose(overrides_from_argv(argv))
        plan = validate(cfg)
    except (ConfigError, DataConfigError, UnknownBackendError, BackendUnavailableError) as e:
        # every rank validates the same config and finds the same error: rank 0 prints it, once per job; the
        # others give it a moment to, as torchrun stops the job at the first rank that exits
        if not report_error(str(e), collective=True):
            time.sleep(5.0)
        return EXIT_BAD_INPUT
    ctx = None
    started = False  # a start refused before the first step leaves the run directory as it was
    try:
        ctx = setup(cfg, plan)  # resumes from the located checkpoint (a no-op on a fresh start)
        ctx.start_data()
        ctx.checkpointer.restore_rng()  # after start_data: creating the DataLoader iterator draws from the RNG
        started = True
        with ExitRequest(cfg.train.exit_after_minutes, start_time=t_start) as stop:  # SIGTERM/SIGINT -> stop
            train_loop(ctx, stop)
            ctx.checkpointer.save_final(ctx.state, ctx.model, ctx.optimizer, ctx.scheduler,
                                        wandb_run_id=ctx.logger.wandb_run_id)
        if plan.rank == 0:
            ctx.logger.print(f"done: {ctx.state.step} steps, {ctx.state.consumed_tokens:,} tokens; metrics in {ctx.run_dir}/metrics.jsonl")
    except (DataPreparationError, DataConfigError) as e:
        report_error(str(e), collective=plan.world_size > 1)
        return EXIT_BAD_INPUT
    except RunError as e:  # checkpoint, storage, run-dir lock, divergence: one line (once per job if collective)
        report_error(str(e), collective=e.collective)
        return e.exit_code
    finally:
        if not started:
            release_refused_start()
        shutdown(ctx)
        while _RUN_LOCK:  # the run is over: the next trainer (also in this process) may take run_dir
            _RUN_LOCK.pop().release()
        _CLAIMED_DIRS.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
