"""Run-config validation: every check that needs no work, before any process group, model or file exists.

    plan = validate(cfg)          # RunPlan, or one ConfigError / DataConfigError naming the key

Checks, in order: numeric keys, the train loop's sizes, device and precision, the optimizer, the parallel layout
against the model and the world size, the LM head's parallel form, the memory planner (on a GPU), tokenizer
against the model's embedding, validation and data paths (with their recorded tokenizer and fingerprint), the
kernel backend, the W&B mode and ``checkpoint.init_from_hf``, and with the helion backend the Mamba mixer's dims
against the kernels' shape space.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from nano_hybrid.checkpoint import check_settings as check_checkpoint_settings
from nano_hybrid.config import ConfigError
from nano_hybrid.data import (
    DataConfigError,
    DataSpec,
    TokenizerError,
    TokenizerSpec,
    build_tokenizer,
    corpus_tokenizer_type,
    missing_paths,
    padded_vocab_size,
)
from nano_hybrid.data.check import CorpusCheckError, check_corpus
from nano_hybrid.layout import LaunchEnv, ParallelDims
from nano_hybrid.model.fp8 import check_settings as check_fp8_settings
from nano_hybrid.schema import RunConfig, check_keys, check_numbers, check_values, positive_int

# The only places data.prepare_if_missing=stdlib builds the stdlib corpus: byte tokens (data=default) and the
# 131k Tekken BPE (data=stdlib_bpe131k, the Nano default), each with the configured data.tokenizer.
DEFAULT_CORPORA = ("data/stdlib/stdlib", "data/stdlib_bpe131k/stdlib")


@dataclass
class RunPlan:
    """Everything derived from the config during validation (before any process group or model exists)."""

    run: RunConfig  # the validated config, typed and frozen
    dims: ParallelDims  # the parallel layout and this process's place in it
    device: torch.device
    dtype: torch.dtype
    num_microbatches: int
    backend_name: str
    data: DataSpec
    seq_length: int
    tokenizer: Any
    eval_interval: int  # validation every N steps (0: none)
    eval_iters: int  # global batches per validation (0 without validation)
    tokenizer_spec: Any = None  # nano_hybrid.data.TokenizerSpec (workers of a corpus build rebuild it)
    backend: Any = None  # the kernels.registry.KernelBackend validation resolved (build_model reuses it)

    def for_backend(self, cfg: DictConfig) -> "RunPlan":
        """This plan with the kernel backend of ``cfg.kernels`` (for tools that run several backends in one process
        after changing ``cfg.kernels.backend``): validation resolves the backend once, this resolves the new one."""
        from nano_hybrid.model.build import resolve_backend

        return dataclasses.replace(self, backend=resolve_backend(cfg), backend_name=str(cfg.kernels.backend))


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
    if not isinstance(o.fused, bool):
        raise ConfigError(f"optim.fused={o.fused!r} must be true or false")
    from nano_hybrid.optim import MULTI_TENSOR_OPS

    if str(o.get("multi_tensor", "foreach")) not in MULTI_TENSOR_OPS:
        raise ConfigError(f"optim.multi_tensor={o.multi_tensor!r}; choose {' or '.join(MULTI_TENSOR_OPS)}")
    for key in ("lr", "adam_beta1", "adam_beta2", "adam_eps"):
        if not float(o[key]) > 0:
            raise ConfigError(f"optim.{key}={o[key]} must be > 0")
    for key in ("adam_beta1", "adam_beta2"):
        if not float(o[key]) < 1:
            raise ConfigError(f"optim.{key}={o[key]} must be < 1")
    if not 0 <= float(o.min_lr) <= float(o.lr):
        raise ConfigError(f"optim.min_lr={o.min_lr} must be in [0, optim.lr={o.lr}]")
    if not 0 <= float(o.init_lr) <= float(o.lr):
        raise ConfigError(f"optim.init_lr={o.init_lr} must be in [0, optim.lr={o.lr}]")
    if float(o.weight_decay) < 0 or float(o.clip_grad) < 0:
        raise ConfigError(f"optim.weight_decay={o.weight_decay} and optim.clip_grad={o.clip_grad} must be >= 0")
    if not isinstance(o.get("override_scheduler", False), bool):
        raise ConfigError(f"optim.override_scheduler={o.override_scheduler!r} must be true or false")
    decay = o.get("lr_decay_iters")
    if decay is None:
        if not 0 <= int(o.warmup_iters) < train_iters:
            raise ConfigError(f"optim.warmup_iters={o.warmup_iters} must be in [0, train.train_iters={train_iters})")
    elif not 0 <= int(o.warmup_iters) < int(decay):
        raise ConfigError(f"optim.warmup_iters={o.warmup_iters} must be in [0, optim.lr_decay_iters={decay})")
    style = str(o.decay_style)
    if style not in ("WSD", "cosine", "linear", "constant"):
        raise ConfigError(f"optim.decay_style={style!r}; choose WSD, cosine, linear or constant")
    if style == "WSD":
        frac = o.wsd_decay_fraction
        if frac is None or not 0 < float(frac) <= 1:
            raise ConfigError(f"optim.wsd_decay_fraction={frac} must be in (0, 1] for decay_style=WSD")
        if str(o.wsd_decay_style) not in ("linear", "cosine", "exponential", "minus_sqrt"):
            raise ConfigError(f"optim.wsd_decay_style={o.wsd_decay_style!r}; choose linear, cosine, exponential or minus_sqrt")


def _check_train(cfg: DictConfig) -> tuple[int, int, int, int]:
    """The loop's sizes and switches: (micro_batch_size, global_batch_size, seq_length, train_iters)."""
    t = cfg.train
    mbs, gbs = positive_int(cfg, "train.micro_batch_size"), positive_int(cfg, "train.global_batch_size")
    seq = positive_int(cfg, "train.seq_length")
    iters = positive_int(cfg, "train.train_iters")
    positive_int(cfg, "train.log_interval")
    if seq > int(cfg.model.seq_length):
        raise ConfigError(f"train.seq_length={seq} exceeds model.seq_length={cfg.model.seq_length}")
    if t.exit_after_minutes is not None and not float(t.exit_after_minutes) > 0:
        raise ConfigError(f"train.exit_after_minutes={t.exit_after_minutes} must be > 0 or null")
    if t.torch_threads is not None and int(t.torch_threads) <= 0:
        raise ConfigError(f"train.torch_threads={t.torch_threads} must be a positive integer or null")
    if not isinstance(t.deterministic, bool):
        raise ConfigError(f"train.deterministic={t.deterministic!r} must be true or false")
    if t.deterministic and not cfg.kernels.deterministic:
        raise ConfigError("train.deterministic=true needs kernels.deterministic=true (the kernel backend's own switch)")
    mss = t.max_skipped_steps
    if mss is not None and (not isinstance(mss, int) or isinstance(mss, bool) or mss <= 0):
        raise ConfigError(f"train.max_skipped_steps={mss!r} must be a positive integer or null")
    check_checkpoint_settings(cfg.checkpoint)
    return mbs, gbs, seq, iters


def _check_layout(cfg: DictConfig, env: LaunchEnv, mbs: int, gbs: int, device: torch.device) -> ParallelDims:
    """The parallel layout against the model, the world size, the batch and this GPU: the run's layout record."""
    from nano_hybrid.model.config import GROUPED_MM_ALIGN
    from nano_hybrid.model.lm_loss import check_lm_head_parallel

    dims = ParallelDims.build(cfg, env)  # names the offending numbers
    dp = dims.dp
    try:  # the chunked LM head + loss has no vocab-parallel form
        check_lm_head_parallel(OmegaConf.to_container(cfg.model, resolve=True),
                               int(cfg.parallel.tensor_model_parallel_size))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    etp = int(cfg.parallel.expert_tensor_parallel_size)
    width = cfg.model.get("moe_ffn_hidden_size") or cfg.model.get("ffn_hidden_size")
    if ("E" in str(cfg.model.hybrid_override_pattern) and str(cfg.model.moe_experts_impl) == "grouped" and width
            and etp > 1 and (int(width) // etp) % GROUPED_MM_ALIGN):
        raise ConfigError(
            f"model.moe_experts_impl=grouped (torch._grouped_mm) needs each expert-tensor-parallel rank's expert width "
            f"{width} / parallel.expert_tensor_parallel_size={etp} to be a multiple of {GROUPED_MM_ALIGN}; use "
            "model.moe_experts_impl=sequential or another expert_tensor_parallel_size")
    if gbs % (mbs * dp):
        raise ConfigError(
            f"train.global_batch_size={gbs} must be a multiple of train.micro_batch_size={mbs} x data-parallel size {dp}"
        )
    # The memory planner (nano_hybrid.plan) against this GPU: refuse a run that cannot fit.
    memory_check = cfg.train.memory_check
    if not isinstance(memory_check, bool):
        raise ConfigError(f"train.memory_check={memory_check!r} must be true or false")
    if memory_check and device.type == "cuda":
        from nano_hybrid.plan import check_memory

        check_memory(cfg, dims, torch.cuda.get_device_properties(device).total_memory)
    return dims


def _check_transformer_config(cfg: DictConfig, device: torch.device, dtype: torch.dtype) -> None:
    """The model's own checks, then megatron-core's TransformerConfig checks of the settings together (e.g. the
    expert bias only with the sigmoid router score), before any work."""
    from nano_hybrid.model.config import make_transformer_config

    make_transformer_config(cfg, device=device, dtype=dtype)


def _check_tokenizer(cfg: DictConfig):
    """(TokenizerSpec, tokenizer): the tokenizer's ids must fit the model's embedding, padded as Megatron pads it."""
    try:
        tok_spec = TokenizerSpec.from_cfg(cfg.data.tokenizer)
        tokenizer = build_tokenizer(tok_spec)
    except TokenizerError as e:
        raise ConfigError(str(e)) from None
    from nano_hybrid.model.config import model_dict

    tp = int(cfg.parallel.tensor_model_parallel_size)
    divisible_by = int(model_dict(cfg.model)["make_vocab_size_divisible_by"])
    model_vocab = padded_vocab_size(int(cfg.model.vocab_size), divisible_by, tp)
    if tokenizer.vocab_size > model_vocab:
        raise ConfigError(
            f"the {tok_spec.type} tokenizer has {tokenizer.vocab_size:,} ids but the model's embedding has {model_vocab:,} "
            f"(model.vocab_size={cfg.model.vocab_size} padded to a multiple of make_vocab_size_divisible_by={divisible_by} "
            f"x TP={tp}); raise model.vocab_size or pick a smaller tokenizer"
        )
    return tok_spec, tokenizer


def _check_eval(cfg: DictConfig) -> tuple[int, int]:
    """(eval_interval, eval_iters); both 0 without validation."""
    eval_interval = cfg.train.eval_interval
    if not isinstance(eval_interval, int) or isinstance(eval_interval, bool) or eval_interval < 0:
        raise ConfigError(f"train.eval_interval={eval_interval!r} must be an integer >= 0 (0: no validation)")
    eval_iters = positive_int(cfg, "train.eval_iters") if eval_interval else 0
    return eval_interval, eval_iters


def _check_data(cfg: DictConfig, tok_spec: TokenizerSpec, eval_interval: int) -> DataSpec:
    """The data paths: present (or buildable by data.prepare_if_missing), intact, written with this tokenizer."""
    spec = DataSpec.from_cfg(cfg.data)
    missing = missing_paths(spec) if spec.kind == "indexed" else []
    prepare = cfg.data.prepare_if_missing
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
    return spec


def _check_writable_dir(path: Path, key: str, why: str) -> None:
    """``path`` exists as a folder (made if missing) and a file can be created in it; else one ``ConfigError``."""
    import tempfile

    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as e:
        raise ConfigError(f"{key}: {path} is not a writable folder ({type(e).__name__}: {e.strerror or e}); {why}") \
            from None


def _mixer_dims_of_run(cfg: DictConfig) -> dict | None:
    """The Mamba mixer's kernel dims one rank calls (``mixer_dims``), or None for a model without Mamba layers."""
    from nano_hybrid.model.config import mixer_dims, model_dict

    if "M" not in str(model_dict(cfg.model)["hybrid_override_pattern"]):
        return None
    return mixer_dims(cfg)


def _check_mixer_shape(d: dict, dtype: torch.dtype) -> None:
    """helion backend: the Mamba mixer dims one rank calls (``mixer_dims``) in the run's dtype lie inside the
    kernels' shape space (``kernels/shapes.py``); anything else is one ConfigError naming the dim before any work."""
    from kernels.shapes import UnsupportedShapeError, check_supported

    try:
        check_supported(nheads=d["h"], headdim=d["p"], ngroups=d["g"], dstate=d["n"], chunk_size=d["c"],
                        dtype=dtype, conv_width=d["w"], batch=d["b"], seqlen=d["l"],
                        op="kernels.backend=helion (the Mamba mixer of one rank)")
    except UnsupportedShapeError as e:
        raise ConfigError(f"{e}; the model sets it through model.mamba_* (heads and groups per tensor-parallel rank), "
                          "train.precision and train.micro_batch_size / seq_length; or use kernels.backend=mamba_ssm"
                          ) from None


def _check_backend_limit(d: dict, backend) -> None:
    """The kernel backend can index the Mamba mixer's tensors at the dims one rank calls, ``d``
    (``KernelBackend.shape_refusal``: mamba_ssm's 32-bit offsets); else one ConfigError before any work."""
    why = backend.shape_refusal(**d)
    if why:
        raise ConfigError(f"{why}; use kernels.backend=helion, or a smaller train.micro_batch_size / seq_length "
                          "(or more parallel.context_parallel_size)")


def _check_run_io(cfg: DictConfig):
    """The kernel backend (resolved and returned), the W&B mode and the ``checkpoint.init_from_hf`` folder."""
    from nano_hybrid.metrics import WANDB_MODES
    from nano_hybrid.model.build import resolve_backend

    # unknown / unavailable backends raise their own one-line errors, bad switches / settings a ConfigError
    backend = resolve_backend(cfg)
    if backend.settings is not None:  # helion: its config files (committed, user cache) are read before any work
        from kernels.tuning import CONFIG_ROOT, ConfigFileError, check_config_files, user_cache_root

        cache = user_cache_root(backend.settings.cache_dir)
        try:
            check_config_files([CONFIG_ROOT, cache])
        except ConfigFileError as e:
            raise ConfigError(str(e)) from None
        if backend.settings.autotune:  # first-use tuning stores its winners (and its locks) there
            _check_writable_dir(cache, "kernels.helion.cache_dir", "kernels.helion.autotune=true stores the configs it "
                                "tunes there; set kernels.helion.cache_dir to a writable folder or autotune=false")
    if str(cfg.logger.wandb.mode) not in WANDB_MODES:
        raise ConfigError(f"logger.wandb.mode={cfg.logger.wandb.mode!r}; choose one of {', '.join(WANDB_MODES)}")
    init_hf = cfg.checkpoint.init_from_hf
    if init_hf not in (None, ""):  # the folder's config.json must describe this model (first mismatch named)
        from nano_hybrid.hf import HFBridgeError, MappingError, check_init_from_hf

        try:
            check_init_from_hf(cfg, str(init_hf))
        except (HFBridgeError, MappingError) as e:
            raise ConfigError(str(e)) from None
    return backend


def validate(cfg: DictConfig, env: LaunchEnv | None = None) -> RunPlan:
    """Check every setting that can be checked without doing work; raise one clear error. ``env``: the
    launcher's world this process is in (default: ``LaunchEnv.read()``, this process's environment)."""
    env = LaunchEnv.read() if env is None else env
    check_keys(cfg)
    check_numbers(cfg)
    check_values(cfg)
    # numpy takes seeds below 2**32; each rank adds its offsets (e.g. 100 x its pipeline rank) to the run's seed
    for key in ("seed", "data.valid_seed"):
        v = OmegaConf.select(cfg, key, default=None)
        if v is not None and not 0 <= int(v) < 2**31:
            raise ConfigError(f"{key}={v} must be in [0, 2**31)")
    if cfg.get("run_dir") is not None and not str(cfg.run_dir).strip():
        raise ConfigError("run_dir is empty: name a folder, or leave it null for runs/<model>-<backend>-<time>")
    mbs, gbs, seq, iters = _check_train(cfg)
    device = resolve_device(str(cfg.train.device), env.local_rank)
    dtype = resolve_dtype(str(cfg.train.precision), device)
    check_fp8_settings(cfg, device)
    validate_optim(cfg.optim, iters)
    dims = _check_layout(cfg, env, mbs, gbs, device)
    _check_transformer_config(cfg, device, dtype)
    tok_spec, tokenizer = _check_tokenizer(cfg)
    eval_interval, eval_iters = _check_eval(cfg)
    spec = _check_data(cfg, tok_spec, eval_interval)
    backend = _check_run_io(cfg)
    mixer = _mixer_dims_of_run(cfg)
    if mixer is not None:
        if backend.settings is not None:  # helion
            _check_mixer_shape(mixer, dtype)
        _check_backend_limit(mixer, backend)
    return RunPlan(
        run=RunConfig.from_cfg(cfg),
        dims=dims,
        device=device,
        dtype=dtype,
        num_microbatches=gbs // (mbs * dims.dp),
        backend_name=backend.name,
        backend=backend,
        data=spec,
        seq_length=seq,
        tokenizer=tokenizer,
        tokenizer_spec=tok_spec,
        eval_interval=eval_interval,
        eval_iters=eval_iters,
    )
