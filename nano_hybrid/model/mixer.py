"""Megatron's ``MambaMixer`` with its two kernels taken from a nano-hybrid kernel backend.

The backend (``kernels.registry.KernelBackend``) is passed per model through the layer spec
(``ModuleSpec(module=BackendMambaMixer, params={"backend": backend})``); megatron modules are not
patched to select it.
"""

from __future__ import annotations

from typing import Optional

import torch
from einops import rearrange
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.ssm.mamba_mixer import MambaMixer, _check_mamba_sequence_packing_support

from nano_hybrid import mcore_compat


class BackendMambaMixer(MambaMixer):
    """``MambaMixer`` whose fused split-conv1d-scan op and gated RMSNorm come from ``backend``.

    - ``self.norm`` is an instance of ``backend.RMSNormGated`` (with megatron's ExtendedRMSNorm
      sharded_state_dict), so checkpoint keys (``mixer.norm.weight``) are unchanged.
    - ``_ssm_training`` calls ``backend.mamba_split_conv1d_scan_combined`` with exactly the arguments
      megatron-core 0.16.1 passes to mamba-ssm's op (``mamba_mixer.py`` ``_ssm_training``).
    - ``_ssm_prefill`` (inference, or ``use_mamba_mem_eff_path=False``) runs megatron's code with
      ``backend.mamba_chunk_scan_combined``.
    """

    def __init__(self, config, submodules, d_model, *args, backend=None, **kwargs):
        if backend is None:
            raise ValueError("BackendMambaMixer needs backend=<kernels.registry.KernelBackend> (set by the layer spec)")
        with mcore_compat.mamba_mixer_init_guard(backend.RMSNormGated):
            super().__init__(config, submodules, d_model, *args, **kwargs)
        # a plain attribute (not a module): the backend holds functions and a class
        self.kernel_backend = backend

    def _ssm_training(
        self, zxBCdt: torch.Tensor, packed_seq_params: Optional[PackedSeqParams] = None
    ) -> torch.Tensor:
        # (l, b, d) -> (b, l, d), as the fused op expects
        zxBCdt = rearrange(zxBCdt, "l b d -> b l d").contiguous()
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
        )
        y = rearrange(y, "b l d -> l b d").contiguous()
        y = self.cp.post_conv_ssm(y, packed_seq_params)
        if self.rmsnorm:
            # the op already applied y * silu(z) (no rmsnorm_weight passed); the norm runs without z
            y = self.norm(y)
        return y

    def _ssm_prefill(self, *args, **kwargs):
        with mcore_compat.scoped_mamba_chunk_scan(self.kernel_backend.mamba_chunk_scan_combined):
            return super()._ssm_prefill(*args, **kwargs)
