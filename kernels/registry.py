"""Kernel-backend registry: one name -> the two ops Megatron's MambaMixer calls in training.

    backend = get_backend("helion")
    y = backend.mamba_split_conv1d_scan_combined(zxbcdt, conv_w, conv_b, dt_bias, A, D, chunk_size, ...)
    norm = backend.RMSNormGated(d_inner, eps=1e-5, group_size=512, norm_before_gate=False)

Backends:
  torch      pure-PyTorch reference (autograd, fp32 accumulation); CPU default and correctness oracle
  mamba_ssm  mamba-ssm 2.3.2 Triton kernels + causal-conv1d 1.7.0 CUDA (needs a CUDA GPU and ``.[gpu]``)
  helion     our Helion kernels with per-GPU configs from ``kernels/configs/<arch>/``

Selection is explicit: an unknown or unavailable backend raises one clear error naming what is
missing; nothing falls back silently. The helion backend carries its ``HelionSettings`` (``kernels.settings``:
every setting that changes what it computes or how fast), bound into its ops; ``settings_dict()`` records them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from kernels.settings import HelionSettings, HelionSettingsError

BACKENDS = ("torch", "mamba_ssm", "helion")


class UnknownBackendError(ValueError):
    pass


class BackendUnavailableError(RuntimeError):
    pass


class KernelSwitchError(ValueError):
    """A kernels.* switch that does not apply to the chosen backend (e.g. autotune with mamba_ssm)."""


@dataclass(frozen=True)
class KernelBackend:
    name: str
    mamba_split_conv1d_scan_combined: Callable
    mamba_chunk_scan_combined: Callable
    RMSNormGated: type
    description: str = ""
    # the fused op takes zxbcdt in any layout whose last dim has unit stride (e.g. a (b, l, d) view of Megatron's
    # (l, b, d) in_proj output) and allocates its gradient with the same strides: the mixer then skips the
    # (l, b, d) -> (b, l, d) copy and its backward twin (338 MB each per layer at the Nano shape)
    strided_zxbcdt: bool = False
    # the helion backend's settings (None for the others)
    settings: HelionSettings | None = None
    # kernels.deterministic: bitwise-repeatable gradients were asked for (the helion kernels are atomics-free, the
    # torch reference is deterministic, mamba-ssm honours MAMBA_DETERMINISTIC=1)
    deterministic: bool = False
    # the most elements a tensor of the Mamba mixer may have (None: no limit; the zxbcdt input and the chunk
    # states are the largest, ``mixer_elements``): mamba-ssm's Triton kernels compute offsets in 32 bits
    # (``INT32_OFFSET_LIMIT``); the helion kernels switch to 64-bit indices (kernels.tuning.with_index_dtype_for)
    max_mixer_elements: int | None = None

    def shape_refusal(self, *, b: int, l: int, h: int, p: int, g: int, n: int, c: int, **_) -> str | None:
        """One line saying why this backend cannot run the Mamba mixer at dims (b, l, h, p, g, n, chunk c) (see
        ``max_mixer_elements``), or None."""
        elements, what = mixer_elements(b=b, l=l, h=h, p=p, g=g, n=n, c=c)
        if self.max_mixer_elements is None or elements <= self.max_mixer_elements:
            return None
        return (f"kernel backend {self.name!r} indexes with 32-bit offsets: {what} at {b} x {l} with {h} heads "
                f"x {p}, {g} groups x {n}, chunk {c} has {elements:.3g} elements, more than "
                f"{self.max_mixer_elements}")

    def settings_dict(self) -> dict[str, Any]:
        """{"backend": name, **settings}: what a run or benchmark records about the kernels it ran."""
        return {"backend": self.name, **({} if self.settings is None else self.settings.as_dict())}


# mamba-ssm's Triton kernels compute tensor offsets in 32 bits: at Nano widths and 1 x 262144 (zxbcdt of 2.7e9
# elements) its forward stops with an illegal memory access on an H100
INT32_OFFSET_LIMIT = 2**31 - 1


def zxbcdt_elements(*, b: int, l: int, h: int, p: int, g: int, n: int) -> int:
    """Elements of the Mamba mixer's in_proj output zxbcdt at micro-batch b, sequence l, h heads of p, g groups of
    state n: (b, l, 2*h*p + 2*g*n + h)."""
    return b * l * (2 * h * p + 2 * g * n + h)


def mixer_elements(*, b: int, l: int, h: int, p: int, g: int, n: int, c: int) -> tuple[int, str]:
    """The largest tensor of the Mamba mixer's op at these dims, (elements, name): zxbcdt, or the chunk states
    (b, ceil(l / c), h, p, n) where they are larger (a large state with a small chunk)."""
    states = b * -(-l // c) * h * p * n
    zxbcdt = zxbcdt_elements(b=b, l=l, h=h, p=p, g=g, n=n)
    return (zxbcdt, "zxbcdt") if zxbcdt >= states else (states, "the chunk states")


def _torch_backend() -> KernelBackend:
    from kernels.mamba_split import mamba_split_conv1d_scan_combined_ref
    from kernels.rmsnorm_gated import RMSNormGatedRef
    from kernels.ssd import mamba_chunk_scan_combined_ref

    return KernelBackend(
        "torch", mamba_split_conv1d_scan_combined_ref, mamba_chunk_scan_combined_ref, RMSNormGatedRef,
        "pure-PyTorch reference",
    )


def import_mamba_ssm() -> None:
    """Import mamba-ssm's Triton Mamba-2 modules.

    mamba-ssm built without its CUDA extension (MAMBA_SKIP_CUDA_BUILD) lacks ``selective_scan_cuda``
    (the Mamba-1 scan, unused on the Mamba-2 path), and ``import mamba_ssm`` fails without it. We
    register an empty placeholder module under that name so the package imports; calling a Mamba-1
    selective-scan op would then fail loudly with an AttributeError.
    """
    if "selective_scan_cuda" not in sys.modules:
        try:
            importlib.import_module("selective_scan_cuda")
        except ImportError:
            sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")
    importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    importlib.import_module("mamba_ssm.ops.triton.layernorm_gated")


def _mamba_ssm_backend() -> KernelBackend:
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailableError("kernel backend 'mamba_ssm' needs a CUDA GPU; use kernels.backend=torch on CPU")
    missing = []
    try:
        import_mamba_ssm()
    except ImportError as e:
        missing.append(f"mamba-ssm ({e})")
    try:
        importlib.import_module("causal_conv1d")
    except ImportError as e:
        missing.append(f"causal-conv1d ({e})")
    if missing:
        raise BackendUnavailableError(
            "kernel backend 'mamba_ssm' is unavailable: missing " + "; ".join(missing)
            + ". Install with: pip install -e '.[gpu]' (or the offline wheelhouse, see README)"
        )
    from mamba_ssm.ops.triton.layernorm_gated import RMSNorm
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined

    return KernelBackend(
        "mamba_ssm", mamba_split_conv1d_scan_combined, mamba_chunk_scan_combined, RMSNorm,
        "mamba-ssm Triton + causal-conv1d CUDA", max_mixer_elements=INT32_OFFSET_LIMIT,
    )


def helion_training_kernels(settings: HelionSettings | None = None, fused_norm: bool = False) -> tuple[str, ...]:
    """The tunable Helion kernels (tuning names, ``kernels.tuner.discover_tunable_kernels``) one training step of the
    helion backend calls at a mixer shape with ``settings`` (default: the defaults): the fused op's forward and
    backward and the gated RMSNorm's. What a run's pretuning tunes (``nano_hybrid.kernel_search.pretune``); the fp32-CB
    chunk scan runs only in comparisons and inference. With ``state_passing=auto`` both state paths' kernels, so
    that the tuned times choose between them (``kernels.ssd_helion.choose_state_passing``). ``fused_norm``
    (``model.mamba_fused_norm``): the op runs the gated norm, whose kernels read z, and the SSD backward's first
    kernel is ``ssd_bwd_dstates``.
    tests/test_mamba_split_helion.py checks it against the calls."""
    mode = "auto" if settings is None else settings.state_passing
    states = {"fused": ("ssd_chunk_state_passing",), "split": ("ssd_chunk_state", "ssd_state_passing")}.get(
        mode, ("ssd_chunk_state_passing", "ssd_chunk_state", "ssd_state_passing"))
    first, norm = (("ssd_bwd_dstates",), ("rmsnorm_fwd_z", "rmsnorm_bwd_z")) if fused_norm else \
        (("ssd_bwd_dz_dstates",), ("rmsnorm_fwd", "rmsnorm_bwd"))
    return ("conv1d_fwd", "conv1d_bwd", "ssd_chunk_cumsum", *states, "ssd_bmm_chunk", "ssd_chunk_scan_cb16",
            *first, "ssd_bwd_state_passing", "ssd_bwd_dx", "ssd_bwd_dc_dcb", "ssd_bwd_db", "ssd_bwd_dt", *norm)


HELION_TRAINING_KERNELS = helion_training_kernels()  # with the default settings

_HELION_PARTS = {
    "mamba_split_conv1d_scan_combined": ("kernels.mamba_split_helion", "mamba_split_conv1d_scan_combined_helion"),
    "mamba_chunk_scan_combined": ("kernels.ssd_helion", "mamba_chunk_scan_combined_helion"),
    "RMSNormGated": ("kernels.rmsnorm_gated_helion", "RMSNormGatedHelion"),
}


def _helion_backend(settings: HelionSettings) -> KernelBackend:
    import torch

    try:
        importlib.import_module("helion")
    except ImportError as e:
        raise BackendUnavailableError(f"kernel backend 'helion' is unavailable: helion is not installed ({e})") from None
    interpret = os.environ.get("HELION_INTERPRET", "") in ("1", "true", "True")
    if not torch.cuda.is_available() and not interpret:
        raise BackendUnavailableError(
            "kernel backend 'helion' needs a CUDA GPU (or HELION_INTERPRET=1 for Helion's slow eager CPU mode)"
        )
    if not torch.cuda.is_available() and not _cpu_mm_dtype_available():
        raise BackendUnavailableError(
            "kernel backend 'helion' in CPU interpret mode needs aten::mm.dtype on CPU, which this torch build "
            "lacks (hl.dot lowers to it); the test suite registers a test-only implementation in tests/conftest.py"
        )
    parts, missing = {}, []
    for field, (mod, attr) in _HELION_PARTS.items():
        try:
            parts[field] = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            missing.append(f"{mod}.{attr} ({type(e).__name__}: {e})")
    if missing:
        raise BackendUnavailableError("kernel backend 'helion' is incomplete: missing " + "; ".join(missing))
    from kernels import tuning

    # every op runs its kernels under this backend's runtime (kernels.tuning.use): its own switches and caches
    parts["mamba_split_conv1d_scan_combined"] = functools.partial(parts["mamba_split_conv1d_scan_combined"],
                                                                  settings=settings)
    parts["mamba_chunk_scan_combined"] = tuning.with_runtime(parts["mamba_chunk_scan_combined"], settings)
    parts["RMSNormGated"] = type(parts["RMSNormGated"].__name__, (parts["RMSNormGated"],), {"settings": settings})
    return KernelBackend("helion", description="Helion kernels, per-GPU tuned configs",
                         strided_zxbcdt=settings.zxbcdt_in_place, settings=settings, **parts)


def _cpu_mm_dtype_available() -> bool:
    import torch

    try:
        torch.ops.aten.mm.dtype(torch.ones(1, 1), torch.ones(1, 1), torch.float32)
        return True
    except (NotImplementedError, RuntimeError):
        return False


_FACTORIES = {"torch": _torch_backend, "mamba_ssm": _mamba_ssm_backend, "helion": _helion_backend}
_CACHE: dict[tuple[str, HelionSettings | None], KernelBackend] = {}


def _helion_settings(helion: HelionSettings | Mapping[str, Any] | None) -> HelionSettings:
    if isinstance(helion, HelionSettings):
        return helion
    try:
        return HelionSettings.from_mapping(helion)
    except (HelionSettingsError, TypeError) as e:
        raise KernelSwitchError(str(e)) from None


def get_backend(name: str, helion: HelionSettings | Mapping[str, Any] | None = None) -> KernelBackend:
    """The backend called ``name``; raises UnknownBackendError / BackendUnavailableError (one line).

    ``helion``: the helion backend's settings (a ``HelionSettings`` or a mapping of its keys; None: the defaults);
    giving them for another backend is a ``KernelSwitchError``."""
    if name not in _FACTORIES:
        raise UnknownBackendError(f"unknown kernel backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    if name != "helion" and helion is not None and helion != {}:
        raise KernelSwitchError(f"kernels.helion settings apply to kernels.backend=helion only (got {name!r})")
    settings = _helion_settings(helion) if name == "helion" else None
    key = (name, settings)
    if key not in _CACHE:
        _CACHE[key] = _FACTORIES[name](settings) if name == "helion" else _FACTORIES[name]()
    return _CACHE[key]


def configure_backend(name: str, *, deterministic: bool = False,
                      helion: HelionSettings | Mapping[str, Any] | None = None) -> KernelBackend:
    """Resolve backend ``name`` with the ``kernels.deterministic`` switch and, for helion, its settings.

    Nothing process-wide is switched: the helion settings (fast launch, first-use tuning ``kernels.helion.autotune``,
    its budget and cache directory) belong to the backend's runtime (``kernels.tuning.runtime_for``), which its
    ops enter, so two backends with different settings in one process do not share state.

    * ``helion``: ``HelionSettings`` or a mapping of its keys (``cfg.kernels.helion``); a bad key or value is a
      ``KernelSwitchError``.
    * ``deterministic``: helion's kernels reduce through per-program partials in a fixed order (no
      atomics), so gradients are bitwise repeatable under every config; the torch reference is
      deterministic as it stands; mamba-ssm honours ``MAMBA_DETERMINISTIC=1`` (it then cuts each
      autotune list to one config), which must be set before it is imported.
    """
    if name not in _FACTORIES:
        raise UnknownBackendError(f"unknown kernel backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    if deterministic and name == "mamba_ssm" and os.environ.get("MAMBA_DETERMINISTIC") != "1":
        if "mamba_ssm" in sys.modules:
            raise KernelSwitchError("kernels.deterministic=true with mamba_ssm needs MAMBA_DETERMINISTIC=1 before mamba-ssm "
                             "is imported; set it in the environment")
        os.environ["MAMBA_DETERMINISTIC"] = "1"
    backend = get_backend(name, helion)
    return dataclasses.replace(backend, deterministic=True) if deterministic else backend


def available_backends() -> dict[str, str | None]:
    """{name: None if usable here, else the reason it is not}."""
    out: dict[str, str | None] = {}
    for name in BACKENDS:
        try:
            get_backend(name)
            out[name] = None
        except BackendUnavailableError as e:
            out[name] = str(e)
    return out
