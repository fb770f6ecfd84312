"""Step-time A/B arms: an arm is a kernel backend plus settings that switch in place on the same model and
optimizer (``SWITCHABLE``), written ``backend[:key=value...]``; ``apply_arm`` switches a run to one
(``set_kernel_backend`` re-points every Mamba-2 mixer). The configs the step benchmarks start from."""

from __future__ import annotations

from dataclasses import dataclass

from nano_hybrid.bench import training


# a benchmark saves no checkpoint (and so needs no free space for one)
NO_CHECKPOINTS = ["checkpoint.interval=0", "checkpoint.save_on_exit=false"]
GPU_DEFAULTS = ["model=nano30b_slice", "data=mock", "train.micro_batch_size=2", "train.global_batch_size=2",
                "train.seq_length=8192", *NO_CHECKPOINTS]
CPU_DEFAULTS = ["model=nano30b_slice", "data=mock", *NO_CHECKPOINTS]


def set_kernel_backend(model, backend) -> int:
    """Point every Mamba-2 mixer in ``model`` (any wrapping: DDP, Float16Module) at ``backend``.

    ``backend`` is a ``kernels.registry.KernelBackend`` or its name. For each ``BackendMambaMixer``:
    ``kernel_backend`` (the fused split-conv1d-scan op) is replaced, and its gated-norm module is
    rebuilt as the backend's ``RMSNormGated`` class (with megatron's sharded_state_dict, as the layer
    spec builds it) around the SAME weight Parameter, so optimizer state, DDP grad buffers and hooks
    and checkpoint keys are unchanged. Returns the number of mixers switched; raises if there are none.
    """
    from kernels.registry import get_backend
    from nano_hybrid import mcore_compat
    from nano_hybrid.model.mixer import BackendMambaMixer

    if isinstance(backend, str):
        backend = get_backend(backend)
    norm_cls = mcore_compat.extended_rmsnorm_class(backend.RMSNormGated)
    n = 0
    for m in model.modules():
        if not isinstance(m, BackendMambaMixer):
            continue
        m.kernel_backend = backend
        old = getattr(m, "norm", None)
        if old is not None and type(old) is not norm_cls:
            w = old.weight
            new = norm_cls(w.numel(), eps=old.eps, group_size=old.group_size, norm_before_gate=old.norm_before_gate,
                           device=w.device, dtype=w.dtype)
            new.weight = w  # same Parameter object
            new.train(old.training)
            m.norm = new
        n += 1
    if n == 0:
        raise ValueError("set_kernel_backend: the model has no Mamba-2 mixers (BackendMambaMixer)")
    return n


FUSED_NORM = "model.mamba_fused_norm"
SWITCHABLE = ("model.lm_head_loss", "model.lm_loss_chunk_tokens", FUSED_NORM, "optim.fused", "train.fp8")


def set_fused_norm(model, on: bool) -> int:
    """``model.mamba_fused_norm`` in place: every Mamba-2 mixer of ``model`` passes its gated norm's weight to the fused
    op (True) or runs the norm module after it (False); the same weight Parameter either way. Returns the number of
    mixers; raises if there are none, or if a mixer has no gated norm."""
    from nano_hybrid.model.mixer import BackendMambaMixer

    if not isinstance(on, bool):
        raise ValueError(f"{FUSED_NORM}={on!r} must be true or false")
    mixers = [m for m in model.modules() if isinstance(m, BackendMambaMixer)]
    if not mixers:
        raise ValueError("set_fused_norm: the model has no Mamba-2 mixers (BackendMambaMixer)")
    for m in mixers:
        if on and (not m.rmsnorm or m.norm_before_gate):
            raise ValueError(f"{FUSED_NORM}=true needs the mixer's gated RMSNorm after the gate (rmsnorm=True, "
                             "norm_before_gate=False)")
        m.fused_norm = on
    return len(mixers)


# the helion backend's settings (kernels.settings.HelionSettings) as arm keys of helion arms: each such arm runs a
# backend configured with the composed config's kernels.helion plus these
HELION_PREFIX = "kernels.helion."


def compose_over_defaults(gpu_defaults: list[str], cpu_defaults: list[str], overrides: list[str]):
    """``(cfg, user_keys)``: the config composed from this host's defaults (``gpu_defaults`` with CUDA, else
    ``cpu_defaults``) then the user's ``overrides``, and the keys those overrides set."""
    import torch

    from nano_hybrid.config import compose

    cfg = compose((gpu_defaults if torch.cuda.is_available() else cpu_defaults) + list(overrides))
    return cfg, {o.split("=", 1)[0].lstrip("+~") for o in overrides}


@dataclass(frozen=True)
class Arm:
    """One A/B arm: a kernel backend plus settings that switch in place (``SWITCHABLE`` keys)."""

    backend: str
    overrides: tuple[tuple[str, object], ...] = ()

    @property
    def label(self) -> str:
        """'helion' or 'helion+lm_head_loss-chunked+fused-true' (file-name safe)."""
        return self.backend + "".join(f"+{k.rsplit('.', 1)[-1]}-{str(v).lower()}" for k, v in self.overrides)


def parse_arm(spec: str) -> Arm:
    """``backend[:key=value[:key=value...]]`` -> Arm; ``ValueError`` on a key that cannot switch in place. Keys:
    ``SWITCHABLE``, and for a helion arm ``kernels.helion.<setting>`` (any ``HelionSettings`` key)."""
    import yaml

    from kernels.settings import HelionSettings

    backend, *items = [x.strip() for x in spec.split(":")]
    if not backend:
        raise ValueError(f"arm {spec!r} has no backend")
    ov = {}
    helion_keys = tuple(HELION_PREFIX + k for k in HelionSettings.keys())
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in SWITCHABLE + helion_keys:
            raise ValueError(f"arm {spec!r}: {item!r} is not key=value with a key from {', '.join(SWITCHABLE)} or "
                             f"{HELION_PREFIX}<{'|'.join(HelionSettings.keys())}>")
        if key.startswith(HELION_PREFIX) and backend != "helion":
            raise ValueError(f"arm {spec!r}: {key} applies to helion arms only")
        ov[key] = yaml.safe_load(value)
        if key == FUSED_NORM and not isinstance(ov[key], bool):
            raise ValueError(f"arm {spec!r}: {key}={value} must be true or false")
    return Arm(backend, tuple(ov.items()))


def parse_op_arm(spec: str) -> Arm:
    """An arm of an op-level benchmark (no training config): ``backend[:kernels.helion.<setting>=value...]
    [:model.mamba_fused_norm=true|false]`` (the latter: the mixer's gated norm inside the op, ``op_fused_norm``);
    ``ValueError`` for any other key."""
    arm = parse_arm(spec)
    other = [k for k, _ in arm.overrides if not k.startswith(HELION_PREFIX) and k != FUSED_NORM]
    if other:
        raise ValueError(f"arm {spec!r}: only {HELION_PREFIX}<setting> and {FUSED_NORM} keys apply to an op "
                         f"benchmark (got {', '.join(other)})")
    return arm


def op_backend(arm: Arm):
    """An op-level arm's backend: its name with the default settings plus the arm's ``kernels.helion`` keys."""
    from kernels.registry import get_backend

    helion = {k[len(HELION_PREFIX):]: v for k, v in arm.overrides if k.startswith(HELION_PREFIX)}
    return get_backend(arm.backend, helion=helion or None)


def op_fused_norm(arm: Arm) -> bool:
    """An op-level arm's ``model.mamba_fused_norm`` (default false: the norm module after the gated op)."""
    return bool(dict(arm.overrides).get(FUSED_NORM, False))


def arm_config(cfg, arm: Arm):
    """A copy of ``cfg`` with the arm's backend and settings applied; keys the arm does not set keep the composed
    config's values."""
    import copy

    from omegaconf import OmegaConf, open_dict

    out = copy.deepcopy(cfg)
    with open_dict(out):
        out.kernels.backend = arm.backend
        for k, v in arm.overrides:
            OmegaConf.update(out, k, v, force_add=True)
    return out


def arm_record(cfg, arm: Arm) -> dict:
    """What a benchmark's JSON says of an arm: its backend, its own keys and, for helion, every resolved
    ``kernels.helion`` setting it ran with."""
    from kernels.settings import HelionSettings

    rec = {"backend": arm.backend, **dict(arm.overrides)}
    if arm.backend == "helion":
        rec["kernels.helion"] = HelionSettings.from_mapping(arm_config(cfg, arm).kernels.get("helion") or {}).as_dict()
    return rec


def arm_backends(cfg, arms) -> dict:
    """``{arm: KernelBackend}``, each resolved as a training run with the arm's config resolves its backend
    (``nano_hybrid.model.build.resolve_backend``: ``kernels.deterministic`` and, for helion, the composed
    ``kernels.helion`` settings plus the arm's own); a bad setting is a ConfigError naming the arm, before any work."""
    from nano_hybrid.config import ConfigError
    from nano_hybrid.model.build import resolve_backend

    out = {}
    for arm in dict.fromkeys(arms):
        try:
            out[arm] = resolve_backend(arm_config(cfg, arm))
        except ConfigError as e:
            raise ConfigError(f"arm {arm.label}: {e}") from None
    return out


def check_arms(cfg, arms, with_optimizer: bool) -> None:
    """Each arm's switchable settings checked as ``apply_arm`` will apply them (``arm_values``), before any work:
    a ConfigError naming the arm and its first bad setting. ``with_optimizer``: whether the run builds the optimizer
    that ``optim.fused`` switches."""
    from nano_hybrid.config import ConfigError

    for arm in dict.fromkeys(arms):
        try:
            arm_values(cfg, arm, with_optimizer)
        except ValueError as e:
            raise ConfigError(f"arm {arm.label}: {e}") from None


def arm_values(cfg, arm: Arm, with_optimizer: bool) -> dict:
    """The values of the switchable keys that ``arm`` runs (the composed config's where the arm sets none), checked:
    the LM head and its chunk (and its tensor-parallel layout), ``optim.fused`` (a bool, and only where an optimizer
    is built), ``train.fp8`` (a recipe). A ValueError names the first bad one (the callers name the arm)."""
    from nano_hybrid.model.config import model_dict
    from nano_hybrid.model.fp8 import FP8_RECIPES
    from nano_hybrid.model.lm_loss import check_lm_head_parallel, lm_head_settings

    mcfg = model_dict(cfg.model)  # the model keys' defaults filled in (model/config.py MODEL_DEFAULTS)
    values = {"model.lm_head_loss": mcfg["lm_head_loss"], "model.lm_loss_chunk_tokens": mcfg["lm_loss_chunk_tokens"],
              FUSED_NORM: mcfg["mamba_fused_norm"], "optim.fused": cfg.optim.fused, "train.fp8": cfg.train.fp8,
              **dict(arm.overrides)}
    m = {"lm_head_loss": values["model.lm_head_loss"], "lm_loss_chunk_tokens": values["model.lm_loss_chunk_tokens"]}
    values["lm_head"] = lm_head_settings(m)
    check_lm_head_parallel(m, int(cfg.parallel.tensor_model_parallel_size))
    if not isinstance(values["optim.fused"], bool):
        raise ValueError(f"optim.fused={values['optim.fused']!r} must be true or false")
    if not with_optimizer and "optim.fused" in dict(arm.overrides):
        raise ValueError("optim.fused needs the optimizer step (not with --fwd-bwd-only)")
    if str(values["train.fp8"]) not in FP8_RECIPES:
        raise ValueError(f"train.fp8={values['train.fp8']!r}; choose one of {', '.join(FP8_RECIPES)}")
    return values


def apply_arm(ctx, arm: Arm, backends: dict) -> None:
    """Switch ``ctx`` (a ``nano_hybrid.trainer.Trainer``) to ``arm`` in place: the kernel backend, the mixers' gated
    norm in or after the op (``model.mamba_fused_norm``), the LM head + loss (``LMLossMambaModel`` attributes), the
    AdamW implementation and the fp8 matmuls (``train.fp8``); keys the arm does not set take the composed config's
    values, so every arm is fully determined."""
    from nano_hybrid.model.fp8 import apply_fp8
    from nano_hybrid.optim import set_adam_fused

    try:
        values = arm_values(ctx.cfg, arm, with_optimizer=ctx.optimizer is not None)
    except ValueError as e:
        raise ValueError(f"arm {arm.label}: {e}") from None
    choice, chunk = values["lm_head"]
    set_kernel_backend(ctx.model, backends[arm])
    set_fused_norm(ctx.model, values[FUSED_NORM])
    model = training.unwrap_model(ctx.model)
    # train.fp8: the chosen linears' matmul class is switched in place on the same Parameters (model/fp8.py)
    apply_fp8(model, str(values["train.fp8"]), tuple(str(k) for k in ctx.cfg.train.fp8_modules))
    model.lm_head_loss, model.lm_loss_chunk_tokens = choice, chunk
    if ctx.optimizer is not None:
        set_adam_fused(ctx.optimizer, values["optim.fused"])
