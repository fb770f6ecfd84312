"""FP8 training of the linears through torchao's float8 matmul (``train.fp8``, ``train.fp8_modules``).

    check_settings(cfg, device)        # one-line ConfigError naming the key (validation, before any work)
    counts = apply_fp8(model, "rowwise", ("mamba_proj", "attention"))   # in place; "none" restores bf16

The swap changes the class of each chosen module in place to a subclass (``Fp8ColumnParallelLinear``, ...) whose
matmul is torchao's ``matmul_with_hp_or_float8_args`` (dynamic scaling: the input, the weight and the incoming
gradient are cast to float8 e4m3 at every call, the recipe picking per-tensor or per-row scales) on the SAME
``weight`` Parameter: parameter names, shapes and dtypes, the optimizer's fp32 master weights, DDP's hooks and the
checkpoint keys are those of the bf16 model, so a checkpoint of an FP8 run loads into a bf16 run and the HF export.
Megatron's tensor-parallel communication stays megatron's (the input's all-gather / gradient all-reduce regions
around the matmul, as in ``linear_with_grad_accumulation_and_async_allreduce``).

Module kinds (``FP8_MODULE_KINDS``): ``mamba_proj`` (mixer in_proj/out_proj), ``attention`` (linear_qkv,
linear_proj), ``mlp`` (dense MLP layers), ``shared_expert`` (the MoE shared expert's fc1/fc2), ``experts`` (the
routed experts: megatron's SequentialMLP linears, or for ``moe_experts_impl=grouped`` torchao's rowwise fp8
grouped GEMM, CUDA only). The LM head (``output_layer``) and the router never take part.
On CUDA the matmul with its casts runs through ``torch.compile`` (torchao's recommendation: the amax, scale and
cast fuse into one kernel per operand); on CPU it runs eagerly (torch's CPU ``_scaled_mm``).
"""

from __future__ import annotations

import functools

import torch

from nano_hybrid.schema import TrainSchema, optional_defaults

FP8_RECIPES = ("none", "tensorwise", "rowwise")
FP8_MODULE_KINDS = ("mamba_proj", "attention", "mlp", "shared_expert", "experts")
FP8_ALIGN = 16  # torch._scaled_mm and the scaled grouped GEMM: both dims of every (local) weight, group row counts
INSTALL_HINT = "pip install torchao==0.17.0 --no-deps (torch 2.11; 0.18.0 for torch 2.12/2.13)"
_TRAIN_DEFAULTS = optional_defaults(TrainSchema)  # for configs without the train.fp8* keys


# ------------------------------------------------------------------------------------------- settings
def fp8_settings(cfg) -> tuple[str, tuple[str, ...]]:
    """``(recipe, module kinds)`` of ``cfg.train`` (the schema's defaults for configs without the keys)."""
    t = cfg.get("train") or {}
    recipe = str(t.get("fp8") or _TRAIN_DEFAULTS["fp8"])
    mods = t.get("fp8_modules", _TRAIN_DEFAULTS["fp8_modules"])
    return recipe, tuple(str(m) for m in (mods if mods is not None else ()))


def torchao_available() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def cpu_scaled_mm_error() -> str | None:
    """None when ``torch._scaled_mm`` runs float8 e4m3 operands on this torch's CPU, else why not."""
    try:
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        one = torch.tensor(1.0)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return None


def check_settings(cfg, device: torch.device) -> None:
    """One-line ConfigError naming the key for an unusable ``train.fp8`` / ``train.fp8_modules``."""
    from nano_hybrid.errors import ConfigError

    t = cfg.train
    recipe = str(t.get("fp8", _TRAIN_DEFAULTS["fp8"]))
    if recipe not in FP8_RECIPES:
        raise ConfigError(f"train.fp8={recipe!r}; choose one of {', '.join(FP8_RECIPES)}")
    mods = t.get("fp8_modules")
    if mods is None or isinstance(mods, str) or not hasattr(mods, "__iter__"):
        raise ConfigError(f"train.fp8_modules={mods!r} must be a list of {', '.join(FP8_MODULE_KINDS)}")
    for k in mods:
        if str(k) not in FP8_MODULE_KINDS:
            raise ConfigError(f"train.fp8_modules has {str(k)!r}; choose from {', '.join(FP8_MODULE_KINDS)} "
                              "(the LM head and the router always stay bf16)")
    if recipe == "none":
        return
    if not torchao_available():
        raise ConfigError(f"train.fp8={recipe} needs torchao, which is not installed: {INSTALL_HINT}")
    if device.type == "cpu" and cpu_scaled_mm_error() is not None:
        raise ConfigError(f"train.fp8={recipe} on train.device=cpu: this torch's CPU float8 matmul fails "
                          f"({cpu_scaled_mm_error()}); use train.fp8=none on CPU")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"train.fp8={recipe} runs on cuda or cpu, not {device.type}")
    if "experts" in [str(k) for k in mods] and cfg.model.moe_experts_impl == "grouped":
        if recipe != "rowwise":
            raise ConfigError(f"train.fp8={recipe} with train.fp8_modules containing experts and "
                              "model.moe_experts_impl=grouped: torchao's fp8 grouped GEMM scales rowwise only; "
                              "use train.fp8=rowwise or drop experts from train.fp8_modules")
        if device.type != "cuda":
            raise ConfigError("train.fp8_modules containing experts with model.moe_experts_impl=grouped needs CUDA "
                              "(torchao's fp8 grouped GEMM); drop experts or use model.moe_experts_impl=sequential")


# ------------------------------------------------------------------------------------------- matmul
@functools.lru_cache(maxsize=None)
def float8_config(recipe: str):
    """torchao's ``(Float8LinearConfig, LinearMMConfig)`` of ``recipe`` (tensorwise | rowwise)."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    c = Float8LinearConfig.from_recipe_name(recipe)
    mm = LinearMMConfig(*(ScaledMMConfig(c.emulate, g.use_fast_accum, False, c.pad_inner_dim)
                          for g in (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)))
    return c, mm


def _fp8_mm_eager(x: torch.Tensor, weight: torch.Tensor, recipe: str) -> torch.Tensor:
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    c, mm = float8_config(recipe)
    return matmul_with_hp_or_float8_args.apply(x, weight.t(), mm, c)


_COMPILED: dict = {}


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: str) -> torch.Tensor:
    """``x @ weight.T`` (x [..., K], weight [N, K]) with x, weight and the output gradient cast to float8 e4m3;
    output in x's dtype, gradients in the inputs' dtypes. CUDA: compiled (no fallback: an error propagates)."""
    if not x.is_cuda:
        return _fp8_mm_eager(x, weight, recipe)
    fn = _COMPILED.get(recipe)
    if fn is None:
        # one compiled graph per (recipe, shape) of the one code object: static shapes (fp8 GEMMs want their
        # alignment known), and room for every linear shape of a model x both recipes before dynamo's
        # recompile limit (default 8) would send calls to eager
        import torch._dynamo.config as dcfg

        name = "recompile_limit" if hasattr(dcfg, "recompile_limit") else "cache_size_limit"
        setattr(dcfg, name, max(getattr(dcfg, name), 64))
        fn = _COMPILED[recipe] = torch.compile(functools.partial(_fp8_mm_eager, recipe=recipe), dynamic=False)
    return fn(x, weight)


def pad_groups(x: torch.Tensor, offs: torch.Tensor, align: int = 16):
    """Rows of ``x`` [M, K] grouped by the int32 end offsets ``offs`` [G], placed so that every group starts at a
    multiple of ``align``: ``(x_padded [M + (align - 1) G rounded up to align, K], padded end offsets, dest)`` with
    ``x_padded[dest] == x`` and zeros elsewhere. No host sync (the padded length is the static upper bound);
    differentiable (``index_copy`` / ``index_select``)."""
    m, g = x.shape[0], offs.shape[0]
    ends = offs.to(torch.int64)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (sizes + align - 1) // align * align
    pends = torch.cumsum(padded, 0)
    rows = torch.arange(m, device=x.device)
    grp = torch.searchsorted(ends, rows, right=True)
    dest = rows - (ends - sizes)[grp] + (pends - padded)[grp]
    rows_padded = (m + (align - 1) * g + align - 1) // align * align  # a multiple of align: 16-byte fp8 strides
    xp = x.new_zeros(rows_padded, x.shape[1]).index_copy(0, dest, x)
    return xp, pends.to(torch.int32), dest


def fp8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``grouped_mm`` (out rows of group g = x rows @ w[g].T, w [G, N, K], int32 end offsets) through torchao's
    rowwise fp8 grouped GEMM (CUDA). Groups of any size: they are padded to multiples of 16 here (``pad_groups``),
    torchao's own padding being off."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    xp, pends, dest = pad_groups(x.contiguous(), offs, FP8_ALIGN)
    y = _to_fp8_rowwise_then_scaled_grouped_mm(xp, w.transpose(-2, -1), pends, out_dtype=x.dtype,
                                               pad_token_groups_for_grouped_mm=False)
    return y.index_select(0, dest)


# ------------------------------------------------------------------------------------------- modules
class _Fp8ParallelLinear:
    """Mixin over megatron's Column/RowParallelLinear: ``_forward_impl`` through ``fp8_linear``."""

    fp8_recipe: str = "tensorwise"

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                      sequence_parallel=False, grad_output_buffer=None, wgrad_deferral_limit=None,
                      tp_group=None, **_):
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        if gradient_accumulation_fusion:
            raise ValueError("train.fp8: gradient_accumulation_fusion is not supported by the fp8 linears")
        if grad_output_buffer is not None:
            raise ValueError("train.fp8: deferred embedding wgrad is not supported by the fp8 linears")
        if sequence_parallel:  # forward all-gather, backward reduce-scatter (as megatron's linear)
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
        elif allreduce_dgrad:  # backward all-reduce of the input gradient
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        out = fp8_linear(input, weight, self.fp8_recipe)
        return out if bias is None else out + bias.to(out.dtype)


class _Fp8GroupedExperts:
    """Mixin over ``GroupedGemmExperts``: both expert GEMMs through torchao's rowwise fp8 grouped GEMM."""

    fp8_recipe: str = "rowwise"

    def _mm(self, x, w, offs):
        return fp8_grouped_mm(x, w, offs)


@functools.lru_cache(maxsize=None)
def _fp8_class(base: type) -> type:
    from nano_hybrid.model.experts import GroupedGemmExperts

    mixin = _Fp8GroupedExperts if issubclass(base, GroupedGemmExperts) else _Fp8ParallelLinear
    return type(f"Fp8{base.__name__}", (mixin, base), {"_fp8_base": base})


def _base_class(m) -> type:
    return getattr(type(m), "_fp8_base", type(m))


def module_kind(name: str, module) -> str | None:
    """The ``train.fp8_modules`` kind of the module at qualified ``name``, or None (never fp8: the LM head, the
    router, embeddings, norms and every module that is not a linear)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from nano_hybrid.model.experts import GroupedGemmExperts

    parts = name.split(".")
    if isinstance(module, GroupedGemmExperts):
        return "experts"
    if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return None
    if "output_layer" in parts or "router" in parts:
        return None
    if "experts" in parts and "local_experts" in parts:
        return "experts"
    if "shared_experts" in parts:
        return "shared_expert"
    if "mixer" in parts and parts[-1] in ("in_proj", "out_proj"):
        return "mamba_proj"
    if "self_attention" in parts and parts[-1] in ("linear_qkv", "linear_proj"):
        return "attention"
    if "mlp" in parts and parts[-1] in ("linear_fc1", "linear_fc2"):
        return "mlp"
    return None


def apply_fp8(model: torch.nn.Module, recipe: str, modules) -> dict[str, int]:
    """Switch ``model`` (any wrapping) in place to ``recipe`` for the module kinds ``modules``; every other
    linear (and every one for ``recipe="none"``) runs megatron's bf16 matmul; so does a chosen one whose weight
    does not fit the float8 GEMM (``fp8_fits``: one warning lists them). Parameters are untouched.
    Returns how many modules of each kind run fp8."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"train.fp8={recipe!r}; choose one of {', '.join(FP8_RECIPES)}")
    unknown = [k for k in modules if k not in FP8_MODULE_KINDS]
    if unknown:
        raise ValueError(f"train.fp8_modules has {unknown[0]!r}; choose from {', '.join(FP8_MODULE_KINDS)}")
    counts = {k: 0 for k in FP8_MODULE_KINDS}
    unfit: dict[tuple, int] = {}
    for name, m in model.named_modules():
        kind = module_kind(name, m)
        if kind is None:
            continue
        base = _base_class(m)
        fits = fp8_fits(m)
        if recipe != "none" and kind in modules and not fits:
            key = (kind, name.split(".")[-1], _weight_shapes(m))
            unfit[key] = unfit.get(key, 0) + 1
        if recipe != "none" and kind in modules and fits:
            if kind == "experts" and _fp8_class(base).__mro__[1] is _Fp8GroupedExperts and recipe != "rowwise":
                raise ValueError(f"train.fp8={recipe}: the grouped experts' fp8 GEMM is rowwise only")
            m.__class__ = _fp8_class(base)
            m.fp8_recipe = recipe
            counts[kind] += 1
        else:
            m.__class__ = base
            m.__dict__.pop("fp8_recipe", None)
    if unfit:
        import warnings

        what = "; ".join(f"{n} x {kind} {leaf} {'/'.join('x'.join(map(str, s)) for s in shapes)}"
                         for (kind, leaf, shapes), n in unfit.items())
        warnings.warn(f"train.fp8={recipe}: {sum(unfit.values())} linear(s) stay bf16, a weight dim not being a "
                      f"multiple of {FP8_ALIGN} (float8 GEMM alignment): {what}", stacklevel=2)
    return counts


def _weight_shapes(m) -> tuple[tuple[int, ...], ...]:
    ws = [m.weight1, m.weight2] if hasattr(m, "weight1") else [m.weight]
    return tuple(tuple(int(d) for d in w.shape) for w in ws)


def fp8_fits(m) -> bool:
    """Whether module ``m``'s local weights (after any tensor-parallel split) meet the float8 GEMM's alignment:
    the last two dims of each a multiple of 16. Modules that do not fit stay bf16 (as torchao's own
    ``convert_to_float8_training`` filter does), with one warning listing them."""
    return all(s[-1] % FP8_ALIGN == 0 and s[-2] % FP8_ALIGN == 0 for s in _weight_shapes(m))


def fp8_modules(model: torch.nn.Module) -> dict[str, str]:
    """Qualified name -> recipe of every module that runs fp8."""
    return {n: m.fp8_recipe for n, m in model.named_modules() if hasattr(type(m), "_fp8_base")}


def te_fp8_kwargs(recipe: str) -> dict:
    """The TransformerConfig fields for megatron's transformer-engine fp8 path (``fp8``, ``fp8_recipe``): the
    mapping used where transformer-engine is installed (config mapping only: not run anywhere this project tests).
    TE has no per-row recipe: rowwise is a ConfigError there."""
    from nano_hybrid.errors import ConfigError

    if recipe == "none":
        return {}
    if recipe != "tensorwise":
        raise ConfigError(f"train.fp8={recipe} has no transformer-engine recipe; use train.fp8=tensorwise with TE")
    return {"fp8": "hybrid", "fp8_recipe": "tensorwise"}


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True
