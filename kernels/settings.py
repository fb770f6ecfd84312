"""``HelionSettings``: every setting that changes what the helion backend computes or how fast.

The frozen settings object travels with the ``KernelBackend`` (``kernels.registry``); training takes it from
the typed keys under ``kernels.helion`` (their defaults are this class's), which the run's ``config.yaml``
records, and the benchmark scripts write ``as_dict()`` into their JSON. Nothing here reads the environment;
the debugging knobs that do are in ``kernels.debug``.

==================  =========  ===============================================================================
setting             default    what it changes
==================  =========  ===============================================================================
bwd_states_dtype    input      dtype of the states the backward recomputes (chunk_state + state_passing):
                               "input" (x's dtype, bf16 in training) or "fp32" (as mamba-ssm). Of their readers
                               only the backward state passing's ddA sums see the difference (the dB/dC kernels
                               round the states to x's dtype before their GEMMs either way); bf16 halves the
                               268 MB per layer (Nano shape) the recompute writes and two kernels read. The
                               backward recomputes them only with save_conv_states=false, which "fp32" needs.
bwd_dstates_dtype   input      dtype of the per-chunk state gradients dz_dstates writes and the backward state
                               passing reads: "input" (x's dtype; each chunk's term is rounded before the fp32
                               running sum) or "fp32" (as mamba-ssm).
save_cumsum         true       the fused op's forward keeps dA_cumsum and dt_out (two fp32 (b, h, l) tensors) for
                               its backward, which then launches no chunk cumsum; false recomputes them, as
                               mamba-ssm does. The values are bitwise the same either way.
save_conv_states    true       the fused op's forward also keeps the conv output (b, l, di + 2 g n) and the states
                               entering each chunk (b, nc, h, p, n, x's dtype) for its backward, which then runs
                               neither the conv nor chunk_state + state_passing again: bitwise the same gradients,
                               for b l (di + 2 g n + h p n / c) more elements per Mamba layer (335 MB at Nano's
                               2 x 8192 in bf16; the memory planner counts them); false recomputes them in the
                               backward, as mamba-ssm does. bwd_states_dtype=fp32 needs it false (the forward's
                               states are in x's dtype)
save_cb             false      the fused op's forward also keeps its C·Bᵀ (b, nc, g, c, c) in x's dtype, as its chunk
                               scan read it, for the backward, which then runs no bmm_chunk and reads C·Bᵀ rounded
                               to x's dtype where it otherwise recomputes it in fp32 (as mamba-ssm does): one kernel
                               less and half of C·Bᵀ's bytes, for b l g c more elements per Mamba layer (33.6 MB at
                               Nano's 2 x 8192 in bf16; the memory planner counts them). Bitwise the same gradients
                               in fp32; in bf16 what ssd_bwd_dx computes (dx, ddt and the ddA sums) sees the
                               rounding, the other gradients are bitwise the same. Needs
                               save_conv_states (with it off the backward recomputes C·Bᵀ with the states)
state_passing       auto       how the forward (and the backward's recompute) computes the states entering each
                               chunk: "fused" (``ssd_chunk_state_passing``: one program per (batch, head, headdim
                               block, dstate block) walks the chunks in order, the running state in registers),
                               "split" (``ssd_chunk_state`` over every chunk at once, its fp32 states written, then
                               ``ssd_state_passing``: more programs where batch x heads is small, a transient fp32
                               (b, nc, h, p, n) tensor) or "auto": per shape, the path with the smaller sum of
                               tuned kernel times where both paths have exact configs, else "split" where the fused
                               kernel would have fewer programs than a third of the GPU's SMs
                               (``kernels.ssd_helion.choose_state_passing``). Equal within fp32 rounding of the
                               states, not bitwise.
zxbcdt_in_place     true       the Mamba mixer hands the fused op its (l, b, d) in_proj output as a (b, l, d) view
                               and gets the gradient back in that layout (no copy either way); the op then writes y
                               in (l, b, d) memory order too, so the mixer's transpose to (l, b, d) copies nothing;
                               false copies zxbcdt to a contiguous (b, l, d) tensor first and y back, as megatron
                               does for mamba-ssm.
fast_launch         true       after a compiled kernel's first launch, later launches call its Triton binary
                               directly (``kernels.tuning.FastLauncher``), skipping Triton's per-call argument
                               binding; bitwise the same results, less host time per launch.
autotune            false      a kernel call at a shape with no exact committed or user-cache config is tuned
                               at its first call (``kernels.first_use.tune_first_use``: on a GPU in a child
                               process killed at autotune_budget_s + 75 s) and the winner stored in the user
                               cache, which later runs and the other ranks read; a search that gives no config
                               is one warning, and the nearest tuned shape's config that fits runs; off: that
                               config (said once), else a default
autotune_budget_s   120        wall-clock seconds of one first-use search (one kernel at one shape); its child
                               process is killed 75 s (start-up, compiles) after that
autotune_jobs       8          with autotune, a training run tunes before its first step every kernel without an
                               exact config at the run's mixer shape, this many searches at a time (their
                               compiles overlap, their timings take turns on the GPU;
                               ``nano_hybrid.bench.tune_kernels.pretune``); 1: one after the other
compile_cache       true       a kernel's first call with an argument signature keeps its chosen config and Helion's
                               generated Triton module in the per-user cache (``<cache_dir>/compiled/``), so later
                               processes load them without binding the kernel, choosing again or generating code
                               (``kernels.compile_cache``: keyed by the kernel sources, the call's arguments, the
                               config files, the GPU and the versions); false binds, chooses and generates in every
                               process
cache_dir           ""         the per-user config cache (``<cache_dir>/<arch>/<kernel>.json``); "" is
                               ``~/.cache/nano_hybrid/helion`` (``$XDG_CACHE_HOME/nano_hybrid/helion``)
==================  =========  ===============================================================================
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

DTYPE_CHOICES = ("input", "fp32")
STATE_PASSING_CHOICES = ("auto", "fused", "split")
STATE_PASSING_NOTICE = "nano_hybrid kernels: state passing at"  # how the one line of an "auto" decision begins
_DTYPE_KEYS = ("bwd_states_dtype", "bwd_dstates_dtype")


class HelionSettingsError(ValueError):
    """A bad ``kernels.helion`` setting (unknown key, wrong type, value outside its choices)."""


@dataclasses.dataclass(frozen=True)
class HelionSettings:
    bwd_states_dtype: str = "input"
    bwd_dstates_dtype: str = "input"
    save_cumsum: bool = True
    save_conv_states: bool = True
    save_cb: bool = False
    state_passing: str = "auto"
    zxbcdt_in_place: bool = True
    fast_launch: bool = True
    autotune: bool = False
    autotune_budget_s: float = 120  # seconds (a float after __post_init__)
    autotune_jobs: int = 8
    compile_cache: bool = True
    cache_dir: str = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "bool" and not isinstance(v, bool):
                raise HelionSettingsError(f"kernels.helion.{f.name}={v!r} must be true or false")
            if f.name in _DTYPE_KEYS and v not in DTYPE_CHOICES:
                raise HelionSettingsError(f"kernels.helion.{f.name}={v!r}; choose one of {', '.join(DTYPE_CHOICES)}")
            if f.name == "state_passing" and v not in STATE_PASSING_CHOICES:
                raise HelionSettingsError(f"kernels.helion.state_passing={v!r}; choose one of "
                                          f"{', '.join(STATE_PASSING_CHOICES)}")
            if f.type == "float":
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                    raise HelionSettingsError(f"kernels.helion.{f.name}={v!r} must be a finite number of seconds > 0")
                object.__setattr__(self, f.name, float(v))
            if f.type == "int" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise HelionSettingsError(f"kernels.helion.{f.name}={v!r} must be a whole number >= 1")
            if f.name == "cache_dir" and not isinstance(v, str):
                raise HelionSettingsError(f"kernels.helion.cache_dir={v!r} must be a path (a string; \"\" for "
                                          "~/.cache/nano_hybrid/helion)")
        if self.save_conv_states and self.bwd_states_dtype != "input":
            raise HelionSettingsError("kernels.helion.bwd_states_dtype=fp32 needs kernels.helion.save_conv_states=false "
                                      "(save_conv_states, on by default, keeps the forward's states, which are in x's "
                                      "dtype)")
        if self.save_cb and not self.save_conv_states:
            raise HelionSettingsError("kernels.helion.save_cb=true needs kernels.helion.save_conv_states=true (with it "
                                      "off the backward recomputes C·Bᵀ together with the states)")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> HelionSettings:
        """Settings from a mapping such as ``cfg.kernels.helion``: unknown keys are an error, missing keys take the
        defaults."""
        values = dict(values or {})
        unknown = sorted(set(values) - set(cls.keys()))
        if unknown:
            raise HelionSettingsError(
                f"unknown kernels.helion key(s) {', '.join(unknown)}; known: {', '.join(cls.keys())}")
        if values.get("cache_dir") is None and "cache_dir" in values:
            values["cache_dir"] = ""
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
