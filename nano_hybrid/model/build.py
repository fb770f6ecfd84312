"""``build_model(cfg)``: the megatron ``MambaModel`` for ``cfg.model`` with ``cfg.kernels.backend``."""

from __future__ import annotations

import contextlib

import torch
from omegaconf import DictConfig

from nano_hybrid import mcore_compat
from nano_hybrid.config import ConfigError
from nano_hybrid.model.config import make_transformer_config, model_dict, padded_vocab_size, recompute_settings


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def resolve_backend(cfg: DictConfig):
    """The ``KernelBackend`` of ``cfg.kernels``: the backend, its deterministic switch and, for
    ``kernels.backend=helion``, its typed settings ``kernels.helion.*`` (``kernels.settings.HelionSettings``; checked
    for every backend, so a typo fails whichever backend runs). Unknown/unavailable backends raise their own one-line
    errors; a bad switch or setting is a ConfigError. Validation calls it once and hands the backend on."""
    from kernels.registry import KernelSwitchError, configure_backend
    from kernels.settings import HelionSettings, HelionSettingsError

    kcfg = cfg.kernels
    name = str(kcfg.backend)
    try:
        helion = HelionSettings.from_mapping(kcfg.get("helion") or {})
        return configure_backend(name, deterministic=bool(kcfg.deterministic),
                                 helion=helion if name == "helion" else None)
    except (KernelSwitchError, HelionSettingsError) as e:
        raise ConfigError(str(e)) from None


def build_model(cfg: DictConfig, *, device=None, dtype=None, backend=None):
    """Build the hybrid ``MambaModel`` described by the composed config ``cfg``.

    Uses ``cfg.model`` (architecture, ``attention_impl``, ``moe_experts_impl``), ``cfg.kernels.backend``
    (``resolve_backend(cfg)`` unless ``backend``, the one validation resolved, is given; an unknown/unavailable
    backend raises its one-line error before anything is built) and ``cfg.parallel`` (TP/PP/EP/ETP/CP/SP sizes).

    Args:
        device: ``None`` -> the current CUDA device if there is one, else CPU; ``"meta"`` builds the
            module tree without allocating weights (parameter counting). On CUDA the device must be the
            current device (megatron allocates with ``torch.cuda.current_device()``).
        dtype: parameter dtype; ``None`` -> float32 (megatron keeps bf16 training as bf16 params with
            fp32 main weights in its optimizer: pass ``torch.bfloat16`` for that).

    Requires megatron's model-parallel state (``nano_hybrid.parallel.initialize_parallel(cfg)`` first).
    Returns an un-wrapped ``megatron.core.models.mamba.MambaModel`` (``nano_hybrid.model.lm_loss.LMLossMambaModel``:
    ``model.lm_head_loss`` picks the LM head + loss; no DDP / Float16Module).
    Its forward is megatron's: ``model(input_ids [b, s], position_ids [b, s], attention_mask, labels=...)``
    returning the per-token loss [b, s] when labels are given (logits [b, s, vocab] otherwise).
    ``attention_mask``: a bool [1|b, 1, s, s] mask, True = masked (as GPTDataset yields). It is ignored by
    ``attention_impl=sdpa`` (causal by construction) but required by ``unfused`` on CPU (megatron's
    default causal mask is allocated on ``"cuda"``).
    """
    from megatron.core import parallel_state
    from nano_hybrid.model.lm_loss import LMLossMambaModel, lm_head_settings
    from nano_hybrid.model.specs import hybrid_stack_spec

    if backend is None:
        backend = resolve_backend(cfg)
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_model needs megatron's parallel state: call nano_hybrid.parallel.initialize_parallel(cfg) first")
    mcore_compat.apply_mcore_compat()

    device = _build_device(device, backend)
    dtype = torch.float32 if dtype is None else dtype
    m = model_dict(cfg.model)
    lm_head_loss, lm_loss_chunk_tokens = lm_head_settings(m)
    tcfg = make_transformer_config(cfg, device=device, dtype=dtype)
    recompute, recompute_modules = recompute_settings(m)
    spec = hybrid_stack_spec(
        backend,
        attention_impl=m["attention_impl"],
        moe_experts_impl=m["moe_experts_impl"],
        num_experts=m["num_moe_experts"],
        mamba_chunk_size=int(m["mamba_chunk_size"]),
        mamba_conv_width=int(m["mamba_conv_width"]),
        mamba_fused_norm=m["mamba_fused_norm"],
        recompute=recompute,
        recompute_modules=recompute_modules,
    )
    vocab = padded_vocab_size(int(m["vocab_size"]), int(m["make_vocab_size_divisible_by"]),
                              int(cfg.parallel.tensor_model_parallel_size))
    ctx = (
        contextlib.ExitStack() if device.type != "meta"
        else _meta_context()
    )
    with ctx:
        model = LMLossMambaModel(
            config=tcfg,
            mamba_stack_spec=spec,
            vocab_size=vocab,
            max_sequence_length=int(m["seq_length"]),
            hybrid_override_pattern=m["hybrid_override_pattern"],
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=not m["untie_embeddings_and_output_weights"],
            position_embedding_type=m["position_embedding_type"],
            lm_head_loss=lm_head_loss,
            lm_loss_chunk_tokens=lm_loss_chunk_tokens,
        )
    return _finish_model(model, cfg, device)


def _finish_model(model, cfg: DictConfig, device: torch.device):
    """After megatron built ``model``: expert-parameter marks, the fp8 swap (``train.fp8``), the move to the GPU."""
    # megatron's SequentialMLP expert linears: reduce their grads over the expert-DP group whenever the
    # expert grid is not the dense one (e.g. TP2 with ETP1; see experts.experts_allreduce_with_dense)
    from nano_hybrid.model.experts import mark_expert_params
    from nano_hybrid.model.fp8 import apply_fp8, fp8_settings, transformer_engine_available

    mark_expert_params(model)
    fp8, fp8_kinds = fp8_settings(cfg)
    if fp8 != "none" and not transformer_engine_available():  # with TE: TransformerConfig.fp8 (model/config.py)
        apply_fp8(model, fp8, fp8_kinds)
    if device.type == "cuda":
        # Some megatron-core local modules (e.g. the torch-norm wrappers) allocate without a device
        # argument; like Megatron-LM's get_model(), move the whole module to the current GPU.
        model.cuda(torch.cuda.current_device())
    return model


def _build_device(device, backend) -> torch.device:
    """The device build_model builds on: ``None`` -> the default one; refused where megatron cannot build."""
    device = default_device() if device is None else torch.device(device)
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx != torch.cuda.current_device():
            raise ValueError(f"build_model(device={device}) but the current CUDA device is {torch.cuda.current_device()}; "
                             "call torch.cuda.set_device first")
    elif device.type == "cpu" and torch.cuda.is_available():
        raise ValueError("build_model(device='cpu') on a CUDA machine is not supported (megatron allocates on "
                         "torch.cuda.current_device()); use device='meta' or the GPU")
    if backend.name == "mamba_ssm" and device.type == "cpu":
        raise ConfigError("kernels.backend=mamba_ssm needs a CUDA device; use kernels.backend=torch on CPU")
    return device


@contextlib.contextmanager
def _meta_context():
    with torch.device("meta"), mcore_compat.DeviceRedirectMode("meta"):
        yield
