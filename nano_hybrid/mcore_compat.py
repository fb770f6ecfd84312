"""Every workaround nano-hybrid needs to run megatron-core 0.16.1 without transformer-engine and/or CUDA.

This is the one module that touches megatron internals or torch.cuda globals for the model, the optimizer
and the process; its one companion is :mod:`nano_hybrid.checkpoint.mcore_io`, which holds the megatron
internals of checkpoint I/O (dist_checkpointing's writer result queue, the DistributedOptimizer's Adam steps).
Each item says why it exists (file:line refer to the installed megatron-core 0.16.1; see
shared/reference/megatron_core_cpu_notes.md for the investigation).

Public helpers (stable; used by nano_hybrid.parallel, nano_hybrid.model and the training loop):

- ``apply_mcore_compat()``: idempotent process-level fixes; the CPU-only ones are applied only when
  ``not torch.cuda.is_available()``.
- ``model_parallel_manual_seed(seed)``: megatron's ``model_parallel_cuda_manual_seed`` on GPU, the CPU
  RNG tracker (same three named streams and seeds) on CPU.
- ``CudaToCpuMode``: a ``TorchFunctionMode`` that maps hard-coded ``device='cuda'`` and
  ``'torch.cuda.*Tensor'`` checks to CPU; wrap ``get_megatron_optimizer(...)`` and ``opt.step()`` in it
  on CPU only (forward/backward run outside it).
- ``DeviceRedirectMode(device)``: sends every factory call with an explicit ``device=`` to ``device``
  (used to build the 30B model on the ``meta`` device, since megatron passes
  ``device=torch.cuda.current_device()`` explicitly in several constructors).
- ``TorchRMSNorm``: RMSNorm usable where megatron's ``WrappedTorchNorm`` refuses sequence parallelism.
- ``LocalNormMambaStack``: ``MambaStack`` whose final norm does not require transformer-engine.
- ``mamba_mixer_init_guard(norm_cls)``: lets megatron's ``MambaMixer.__init__`` run without mamba-ssm.
- ``extended_rmsnorm_class(norm_cls)``: a gated-RMSNorm class with megatron's ``ExtendedRMSNorm``
  sharded_state_dict.
- ``scoped_mamba_chunk_scan(fn)``: the chunk-scan op for megatron's (non-training) prefill path.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

_APPLIED = False
_LOCK = threading.RLock()


def cuda_available() -> bool:
    return torch.cuda.is_available()


def apply_mcore_compat() -> None:
    """Apply the process-level megatron adaptations once (idempotent, safe to call from every entry point)."""
    global _APPLIED
    with _LOCK:
        if _APPLIED:
            return
        import megatron.core.transformer.moe.moe_utils as moe_utils

        # moe/moe_utils.py:1192 tests `te_general_gemm is not None`, but that name is only defined
        # inside `try: import transformer_engine` (l.22-39): without TE the MoE router raises
        # NameError on CPU *and* GPU. Defining it as None selects the plain torch.mm path.
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None

        # tensor_parallel/random.py:636 sets `self.fp8 = fp8 is not None`, so the default
        # CheckpointWithoutOutput() (fp8=False) takes transformer-engine's fp8 path, which raises
        # NameError on FP8GlobalStateManager without TE (random.py:589). The layernorm recompute of
        # TransformerLayer (transformer_layer.py:577, :672) constructs it that way. Without TE, use
        # a subclass whose fp8 flag is the argument's truth value.
        import megatron.core.tensor_parallel as mcore_tp
        import megatron.core.tensor_parallel.random as tp_random

        if not tp_random.HAVE_TE and mcore_tp.CheckpointWithoutOutput is tp_random.CheckpointWithoutOutput:
            class CheckpointWithoutOutputNoTE(tp_random.CheckpointWithoutOutput):
                def __init__(self, fp8=False):
                    super().__init__(fp8)
                    self.fp8 = bool(fp8)

            mcore_tp.CheckpointWithoutOutput = CheckpointWithoutOutputNoTE

        if not cuda_available():
            # CPU-only builds: megatron calls torch.cuda.current_device() for devices of new tensors
            # (ssm/mamba_mixer.py:303-360, utils.py:631 GlobalMemoryBuffer, moe/router.py:90 moves
            # the router weight "to GPU" each forward, distributed/param_and_grad_buffer.py:800).
            # Returning the CPU device makes all of those allocate on CPU.
            torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
            # dist_checkpointing/strategies/filesystem_async.py:230 calls torch.cuda.synchronize()
            # unconditionally; there is nothing to synchronize on CPU.
            torch.cuda.synchronize = _noop_synchronize  # type: ignore[assignment]
            # megatron wraps small helpers in torch.compile (megatron/core/jit.py: jit_fuser), e.g.
            # TopKRouter._apply_expert_bias (moe/router.py:531) called on every MoE forward with
            # expert bias: the first call compiles with inductor (~20-30 s per process on CPU) for
            # no gain. On CPU we call the original Python functions instead.
            from megatron.core.transformer.moe.router import TopKRouter

            TopKRouter._apply_expert_bias = uncompiled(TopKRouter._apply_expert_bias)
        _APPLIED = True


def uncompiled(fn):
    """The Python function behind a ``torch.compile``-wrapped one (``fn`` itself if not compiled)."""
    return getattr(fn, "_torchdynamo_orig_callable", fn)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _noop_synchronize(*args: Any, **kwargs: Any) -> None:
    return None


# --------------------------------------------------------------------------------------------- RNG
_CPU_TRACKER_DOC = """CPU version of megatron's ``CudaRNGStatesTracker`` (tensor_parallel/random.py).

    ``model_parallel_cuda_manual_seed`` fails on CPU at random.py:235 (``torch.cuda.get_rng_state``).
    This tracker keeps the same named streams (data-parallel, model-parallel, expert-parallel) as
    CPU generator states, so megatron's initialisers and dropout ``fork()`` work unchanged.
    Built lazily as a subclass of megatron's tracker so ``isinstance`` checks still pass.
    """


def _make_cpu_tracker_class():
    from megatron.core.tensor_parallel import random as tpr

    class _CPURNGStatesTracker(tpr.CudaRNGStatesTracker):
        __doc__ = _CPU_TRACKER_DOC

        def add(self, name, seed):
            if seed in self.seeds_:
                raise RuntimeError(f"seed {seed} already exists")
            if name in self.states_:
                raise RuntimeError(f"cuda rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=tpr._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise RuntimeError(f"cuda rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return _CPURNGStatesTracker


def model_parallel_manual_seed(seed: int) -> None:
    """Seed megatron's model-parallel RNG streams (call after ``initialize_model_parallel``).

    GPU: megatron's ``model_parallel_cuda_manual_seed``. CPU: the same seeds as megatron
    (data-parallel ``seed``, model-parallel ``seed+2718+tp_rank``, expert
    ``seed+1024+100*ep_rank+etp_rank``) in a CPU tracker; megatron's recompute RNG helpers are pointed at
    the CPU generator (random.py:55, needed by selective recompute).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as tpr

    if cuda_available():
        tpr.model_parallel_cuda_manual_seed(seed)
        return
    tracker = _make_cpu_tracker_class()()
    tp_rank = ps.get_tensor_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    tracker.add(tpr._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(tpr._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(tpr._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
    tpr._CUDA_RNG_STATE_TRACKER = tracker
    tpr._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # random.py:55 `_get_cuda_rng_state` / `_set_cuda_rng_state` are used by activation recompute.
    tpr._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    tpr._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


# ---------------------------------------------------------------------------------- device modes
_FACTORY_DEVICE_KW = "device"


def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, int) and not isinstance(dev, bool):
        return True  # megatron passes torch.cuda.current_device() (an int on CUDA builds)
    return False


class CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Map literal CUDA devices and ``torch.cuda.*Tensor`` type checks to CPU (CPU-only runs).

    ``get_megatron_optimizer`` and ``opt.step()`` hard-code ``device='cuda'`` (optimizer/optimizer.py:481,
    :485, :907; clip_grads.py:103, :174; utils.py:1207) and compare ``Tensor.type()`` with
    ``'torch.cuda.FloatTensor'`` (clip_grads.py:167, distrib_optimizer.py:361, :420, :582). Use it only
    around optimizer construction and ``step()``; it adds overhead to every torch call inside.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _FACTORY_DEVICE_KW in kwargs and _is_cuda_device(kwargs[_FACTORY_DEVICE_KW]):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            t = func(*args)
            return t if t.startswith("torch.cuda.") else t.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if (i > 0 and _is_cuda_device(a) and not isinstance(a, int)) else a
                         for i, a in enumerate(args))
        return func(*args, **kwargs)


class DeviceRedirectMode(torch.overrides.TorchFunctionMode):
    """Send every torch call that names a ``device=`` to ``device`` instead (model construction only).

    Megatron constructors pass ``device=torch.cuda.current_device()`` explicitly (mamba_mixer.py:303-360,
    dot_product_attention.py, experts), which overrides a ``with torch.device('meta')`` context. Used by
    ``build_model(device='meta')`` so the 30B model can be built without allocating its weights.
    """

    def __init__(self, device: torch.device | str):
        super().__init__()
        self.device = torch.device(device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get(_FACTORY_DEVICE_KW) is not None:
            kwargs = dict(kwargs, device=self.device)
        return func(*args, **kwargs)


# ------------------------------------------------------------------------------------------ norms
class TorchRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built from a megatron config, usable with sequence parallelism.

    megatron's ``WrappedTorchNorm`` (transformer/torch_norm.py:32) asserts ``not sequence_parallel``.
    Under sequence parallelism a norm weight sees only this rank's tokens, so its gradient must be
    all-reduced over the TP group; megatron's ``finalize_model_grads`` does that for parameters tagged
    ``sequence_parallel=True``, which is what this class sets. Signature matches megatron norm modules.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_ignored: Any):
        if config.normalization != "RMSNorm":
            raise ValueError(f"TorchRMSNorm needs normalization='RMSNorm', got {config.normalization!r}")
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype,
                         device="cpu" if config.use_cpu_initialization else torch.cuda.current_device())
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))


def _make_local_norm_mamba_stack():
    from megatron.core.ssm.mamba_block import MambaStack

    class LocalNormMambaStack(MambaStack):
        """``MambaStack`` with a torch RMSNorm as final norm.

        ssm/mamba_block.py:166 hard-codes ``TENorm`` for the final norm, which raises ImportError
        without transformer-engine (extensions/transformer_engine.py:440). We build the stack without
        the post norm and add ``TorchRMSNorm`` under the same attribute name (``final_norm``), so state
        dict keys are unchanged.
        """

        def __init__(self, config, submodules, *args, post_layer_norm: bool = True, **kwargs):
            super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                self.final_norm = TorchRMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    return LocalNormMambaStack


_LOCAL_NORM_STACK = None


def local_norm_mamba_stack_class():
    global _LOCAL_NORM_STACK
    if _LOCAL_NORM_STACK is None:
        _LOCAL_NORM_STACK = _make_local_norm_mamba_stack()
    return _LOCAL_NORM_STACK


# ------------------------------------------------------------------------------------- Mamba mixer
_EXTENDED_NORMS: dict[type, type] = {}


def _extended_sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
    """Same as megatron's ``ExtendedRMSNorm.sharded_state_dict``: weight sharded along axis 0 over TP."""
    from megatron.core import parallel_state
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    if not hasattr(self, "tp_group"):
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    state_dict = self.state_dict(prefix="", keep_vars=True)
    return make_sharded_tensors_for_checkpoint(
        state_dict, prefix, {"weight": 0}, sharded_offsets, tp_group=self.tp_group,
        dp_cp_group=metadata["dp_cp_group"],
    )


def extended_rmsnorm_class(norm_cls: type) -> type:
    """The backend's gated RMSNorm class plus megatron's ``ExtendedRMSNorm.sharded_state_dict``.

    Without mamba-ssm, megatron's ``ExtendedRMSNorm`` (ssm/mamba_mixer.py:83) subclasses a
    ``MagicMock()`` and is itself a MagicMock, so it cannot be used; this rebuilds it on top of the
    kernel backend's ``RMSNormGated``.
    """
    with _LOCK:
        if norm_cls not in _EXTENDED_NORMS:
            _EXTENDED_NORMS[norm_cls] = type(
                f"Extended{norm_cls.__name__}", (norm_cls,),
                {"sharded_state_dict": _extended_sharded_state_dict,
                 "__doc__": f"{norm_cls.__name__} with megatron's ExtendedRMSNorm sharded_state_dict."},
            )
        return _EXTENDED_NORMS[norm_cls]


@contextlib.contextmanager
def mamba_mixer_init_guard(norm_cls: type):
    """Run megatron's ``MambaMixer.__init__`` with our gated-norm class and without mamba-ssm.

    ``MambaMixer.__init__`` raises when ``HAVE_MAMBA_SSM`` is False (mamba_mixer.py:174) and builds
    ``self.norm = ExtendedRMSNorm(...)`` from its module global (l.355). For the duration of the
    constructor only (under a lock), both names point at the kernel backend's norm; they are restored
    afterwards, so nothing global stays modified and the kernels are still selected per model.
    """
    import megatron.core.ssm.mamba_mixer as mm

    with _LOCK:
        saved = (mm.HAVE_MAMBA_SSM, mm.ExtendedRMSNorm)
        mm.HAVE_MAMBA_SSM = True
        mm.ExtendedRMSNorm = extended_rmsnorm_class(norm_cls)
        try:
            yield
        finally:
            mm.HAVE_MAMBA_SSM, mm.ExtendedRMSNorm = saved


_MISSING = object()


@contextlib.contextmanager
def scoped_mamba_chunk_scan(chunk_scan_fn):
    """Point megatron's module-level ``mamba_chunk_scan_combined`` at ``chunk_scan_fn`` for one call.

    ``MambaMixer._ssm_prefill`` (inference / ``use_mamba_mem_eff_path=False``) looks the op up in the
    ``megatron.core.ssm.mamba_mixer`` globals at call time; without mamba-ssm the name is undefined.
    Restored afterwards (under a lock).
    """
    import megatron.core.ssm.mamba_mixer as mm

    with _LOCK:
        saved = getattr(mm, "mamba_chunk_scan_combined", _MISSING)
        mm.mamba_chunk_scan_combined = chunk_scan_fn
        try:
            yield
        finally:
            if saved is _MISSING:
                del mm.mamba_chunk_scan_combined
            else:
                mm.mamba_chunk_scan_combined = saved
