"""Megatron's ``MambaMixer`` with its two kernels taken from a nano-hybrid kernel backend.

The backend (``kernels.registry.KernelBackend``) is passed per model through the layer spec
(``ModuleSpec(module=BackendMambaMixer, params={"backend": backend})``); megatron modules are not
patched to select it.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Optional

import torch
from einops import rearrange
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.ssm.mamba_mixer import MambaMixer, _check_mamba_sequence_packing_support

from kernels.derived import derived
from nano_hybrid import mcore_compat


class BackendMambaMixer(MambaMixer):
    """``MambaMixer`` whose fused split-conv1d-scan op and gated RMSNorm come from ``backend``.

    - ``self.norm`` is an instance of ``backend.RMSNormGated`` (with megatron's ExtendedRMSNorm
      sharded_state_dict), so checkpoint keys (``mixer.norm.weight``) are unchanged.
    - ``_ssm_training`` calls ``backend.mamba_split_conv1d_scan_combined`` with exactly the arguments
      megatron-core 0.16.1 passes to mamba-ssm's op (``mamba_mixer.py`` ``_ssm_training``); with ``fused_norm``
      (``model.mamba_fused_norm``) also the norm's weight and eps (``rmsnorm_weight``, ``rmsnorm_eps``), and the norm
      module is not called.
    - ``_ssm_prefill`` (inference, or ``use_mamba_mem_eff_path=False``) runs megatron's code with
      ``backend.mamba_chunk_scan_combined``.
    """

    def __init__(self, config, submodules, d_model, *args, backend=None, recompute_ssd: bool = False,
                 fused_norm: bool = False, **kwargs):
        if backend is None:
            raise ValueError("BackendMambaMixer needs backend=<kernels.registry.KernelBackend> (set by the layer spec)")
        with mcore_compat.mamba_mixer_init_guard(backend.RMSNormGated):
            super().__init__(config, submodules, d_model, *args, **kwargs)
        # a plain attribute (not a module): the backend holds functions and a class
        self.kernel_backend = backend
        # model.recompute_modules has ssd: _ssm_training (conv, scan, gating, gated norm) is one
        # tensor_parallel.checkpoint region keeping only zxBCdt (see nano_hybrid.model.recompute)
        self.recompute_ssd = recompute_ssd
        # model.mamba_fused_norm: the op runs the gated norm (its weight passed as rmsnorm_weight, as mamba-ssm's Mamba2
        # module does) on the SSD's ungated output; self.norm keeps the weight (and the checkpoint key) but is not called
        self.fused_norm = bool(fused_norm)
        if self.fused_norm:
            if not self.rmsnorm:
                raise ValueError("model.mamba_fused_norm=true needs the mixer's gated RMSNorm (rmsnorm=True)")
            if self.norm_before_gate:
                raise ValueError("model.mamba_fused_norm=true needs norm_before_gate=False (the norm after the gate, as "
                                 "the separate norm module computes it)")
            if self.cp.cp_size > 1:
                raise ValueError("model.mamba_fused_norm=true needs context_parallel_size=1 (the norm runs after the "
                                 "context-parallel exchange of the SSD output)")
        if config.use_cpu_initialization and config.perform_initialization:
            bound = inspect.signature(MambaMixer.__init__).bind(self, config, submodules, d_model, *args, **kwargs)
            bound.apply_defaults()
            self._init_layout_invariant(bound.arguments)

    @torch.no_grad()
    def _init_layout_invariant(self, a: dict) -> None:
        """Re-draw the TP-split mixer weights from full-size host masters (``use_cpu_initialization``).

        megatron's ``MambaMixer`` draws ``conv1d`` (weight, bias), ``dt_bias`` and ``A_log`` with this
        rank's local shapes from the per-TP-rank RNG stream, and its ``in_proj`` (a ColumnParallelLinear)
        keeps a contiguous 1/TP row block of the [z x B C dt] master, whereas the mixer uses the rank's
        block of *each* component. Here each of them is drawn as a full master from the global torch
        CPU generator (same on every rank; same distributions as megatron's) and this rank keeps its
        per-component slice, so the weights are those of the TP=1 model for every TP size. The drawing
        order (in_proj, conv weight, conv bias, dt, A) does not depend on TP.
        """
        tp, r = self.pg_collection.tp.size(), self.pg_collection.tp.rank()
        d_inner, nh, gs = self.nheads * self.headdim, self.nheads, self.ngroups * self.d_state

        def local(master: torch.Tensor, sizes: list[int], dim: int = 0) -> torch.Tensor:
            parts = torch.split(master, sizes, dim=dim)
            return torch.cat([torch.chunk(p, tp, dim=dim)[r] for p in parts], dim=dim)

        w = torch.empty(2 * d_inner + 2 * gs + nh, self.d_model, dtype=torch.float32)
        self.config.init_method(w)
        self.in_proj.weight.data.copy_(local(w, [d_inner, d_inner, gs, gs, nh]))

        conv_w = torch.empty(d_inner + 2 * gs, 1, self.d_conv, dtype=torch.float32)
        if self.conv_init is not None:
            torch.nn.init.uniform_(conv_w, -self.conv_init, self.conv_init)
        else:
            torch.nn.init.kaiming_uniform_(conv_w, a=math.sqrt(5))
        self.conv1d.weight.data.copy_(local(conv_w, [d_inner, gs, gs]))
        if self.conv1d.bias is not None:  # nn.Conv1d's default bias init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
            fan_in, _ = torch.nn.init._calculate_fan_in_and_fan_out(conv_w)
            bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            conv_b = torch.empty(d_inner + 2 * gs, dtype=torch.float32).uniform_(-bound, bound)
            self.conv1d.bias.data.copy_(local(conv_b, [d_inner, gs, gs]))

        dt_min, dt_max = float(a["dt_min"]), float(a["dt_max"])
        dt = torch.exp(torch.rand(nh, dtype=torch.float32) * (math.log(dt_max) - math.log(dt_min))
                       + math.log(dt_min)).clamp(min=float(a["dt_init_floor"]))
        inv_dt = dt + torch.log(-torch.expm1(-dt))  # inverse of softplus
        self.dt_bias.data.copy_(torch.chunk(inv_dt, tp)[r])
        A = torch.empty(nh, dtype=torch.float32).uniform_(*a["A_init_range"])
        self.A_log.data.copy_(torch.chunk(torch.log(A), tp)[r])
        # D and the norm weight are ones (layout-invariant already)

    def _ssm_training(
        self, zxBCdt: torch.Tensor, packed_seq_params: Optional[PackedSeqParams] = None
    ) -> torch.Tensor:
        if self.recompute_ssd and self.training and torch.is_grad_enabled():
            fn = functools.partial(self._ssm_training_region, packed_seq_params=packed_seq_params)
            return tensor_parallel.checkpoint(fn, False, zxBCdt)
        return self._ssm_training_region(zxBCdt, packed_seq_params)

    def _ssm_training_region(
        self, zxBCdt: torch.Tensor, packed_seq_params: Optional[PackedSeqParams] = None
    ) -> torch.Tensor:
        # (l, b, d) -> (b, l, d), as the fused op expects: a copy (as megatron does) unless the backend's op reads the
        # transposed view in place and returns its gradient in the same (l, b, d) layout, which in_proj's backward
        # then takes without a copy either
        zxBCdt = rearrange(zxBCdt, "l b d -> b l d")
        if not self.kernel_backend.strided_zxbcdt:
            zxBCdt = zxBCdt.contiguous()
        A = -torch.exp(self.cp.get_A_log().float())

        seq_idx = None
        if packed_seq_params is not None:
            ok, reason = _check_mamba_sequence_packing_support(for_inference_not_training=False)
            if not ok:
                raise RuntimeError(reason)
            seq_idx = self._create_packed_seq_idx(packed_seq_params, zxBCdt.shape[1])

        D = self.cp.get_D()
        y = self.kernel_backend.mamba_split_conv1d_scan_combined(
            zxBCdt,
            rearrange(self.cp.get_conv1d_weight(), "d 1 w -> d w"),
            self.cp.get_conv1d_bias(),
            self.cp.get_dt_bias().float(),
            A,
            D=rearrange(D.float(), "(h p) -> h p", p=self.headdim) if self.D_has_hdim else D,
            chunk_size=self.chunk_size,
            activation=self.activation,
            headdim=None if self.D_has_hdim else self.headdim,
            ngroups=self.cp.ngroups_local_tpcp,
            norm_before_gate=self.norm_before_gate,
            seq_idx=seq_idx,
            **({"rmsnorm_weight": self.norm.weight, "rmsnorm_eps": self.norm.eps} if self.fused_norm else {}),
        )
        # a copy unless the backend's op returned y as a view of (l, b, d) memory (helion does for a transposed zxBCdt)
        y = rearrange(y, "b l d -> l b d").contiguous()
        y = self.cp.post_conv_ssm(y, packed_seq_params)
        if self.rmsnorm and not self.fused_norm:
            # the op already applied y * silu(z) (no rmsnorm_weight passed); the norm runs without z
            y = self.norm(y)
        return y

    def _create_packed_seq_idx(self, packed_seq_params: PackedSeqParams, total_tokens: int) -> torch.Tensor:
        """megatron's seq_idx for packed documents, built once per cu_seqlens tensor (``kernels.derived``): every
        Mamba layer of the step then hands the kernels the same seq_idx object, whose padded copy and masks the
        kernels build once as well."""
        cu = packed_seq_params.cu_seqlens_q_padded
        cu = packed_seq_params.cu_seqlens_q if cu is None else cu  # the tensor megatron's method reads
        return derived(cu, ("packed_seq_idx", total_tokens),
                       lambda: super(BackendMambaMixer, self)._create_packed_seq_idx(packed_seq_params, total_tokens))

    def _ssm_prefill(self, *args, **kwargs):
        with mcore_compat.scoped_mamba_chunk_scan(self.kernel_backend.mamba_chunk_scan_combined):
            return super()._ssm_prefill(*args, **kwargs)
