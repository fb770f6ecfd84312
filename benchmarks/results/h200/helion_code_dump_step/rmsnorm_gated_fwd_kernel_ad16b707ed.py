# config {'block_sizes': [8], 'loop_orders': [[0, 1]], 'l2_groupings': [1], 'reduction_loops': [None], 'range_unroll_factors': [0], 'range_num_stages': [0], 'range_multi_buffers': [None], 'range_flattens': [None], 'load_eviction_policies': ['', '', '', '', ''], 'num_warps': 1, 'num_stages': 1, 'indexing': ['pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer'], 'pid_type': 'flat', 'host_tensor_descriptors': False, 'atomic_indexing': [], 'range_warp_specializes': []}
# args ((torch.bfloat16, torch.Size([16384, 8, 512]), (4096, 512, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([8, 512]), (512, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([16384, 8, 512]), (4096, 512, 1), device(type='cuda', index=0)), (<class 'float'>, 1e-05), (<class 'bool'>, False), (<class 'bool'>, False))
from __future__ import annotations

import torch
import helion.language as hl
import triton
import triton.language as tl
from torch._inductor.runtime.triton_compat import libdevice
from helion.runtime import default_launcher as _default_launcher

_BLOCK_SIZE_0 = tl.constexpr(8)

@triton.jit
def _helion_rmsnorm_gated_fwd_kernel(x, weight, y, rstd, eps, _RDIM_SIZE_2: tl.constexpr):
    # src[rmsnorm_gated.py:115]: for tm, tg in hl.tile([m, g], block_size=[None, 1]):
    num_blocks_0 = tl.cdiv(16384, _BLOCK_SIZE_0)
    pid_0 = tl.program_id(0) % num_blocks_0
    pid_1 = tl.program_id(0) // num_blocks_0
    offset_0 = pid_0 * _BLOCK_SIZE_0
    indices_0 = (offset_0 + tl.arange(0, _BLOCK_SIZE_0)).to(tl.int32)
    offset_1 = pid_1
    indices_1 = offset_1 + tl.zeros([1], tl.int32)
    indices_2 = tl.arange(0, _RDIM_SIZE_2).to(tl.int32)
    # src[rmsnorm_gated.py:116]: xt = x[tm, tg, :].to(torch.float32)
    load = tl.load(x + (indices_0[:, None, None] * 4096 + indices_1[None, :, None] * 512 + (0 + indices_2)[None, None, :] * 1), None)
    v_0 = tl.cast(load, tl.float32)
    # src[rmsnorm_gated.py:120]: r = torch.rsqrt(torch.mean(xt * xt, dim=-1) + eps)
    v_1 = v_0 * v_0
    mean_extra = tl.cast(tl.sum(v_1.to(tl.float32), 2), tl.float32)
    v_2 = 512
    v_3 = tl.cast(v_2, tl.float32)
    v_4 = mean_extra / v_3
    v_5 = v_4 + eps
    v_6 = libdevice.rsqrt(v_5)
    # src[rmsnorm_gated.py:121]: out = xt * r[:, :, None] * weight[tg, :].to(torch.float32)[None, :, :]
    subscript = v_6[:, :, None]
    v_7 = v_0 * subscript
    load_1 = tl.load(weight + (indices_1[:, None] * 512 + (0 + indices_2)[None, :] * 1), None)
    v_8 = tl.cast(load_1, tl.float32)
    subscript_1 = v_8[None, :, :]
    v_9 = v_7 * subscript_1
    # src[rmsnorm_gated.py:125]: y[tm, tg, :] = out.to(y.dtype)
    v_10 = tl.cast(v_9, tl.bfloat16)
    tl.store(y + (indices_0[:, None, None] * 4096 + indices_1[None, :, None] * 512 + (0 + indices_2)[None, None, :] * 1), v_10, None)
    # src[rmsnorm_gated.py:126]: rstd[tm, tg] = r
    tl.store(rstd + (indices_0[:, None] * 8 + indices_1[None, :] * 1), v_6, None)

def rmsnorm_gated_fwd_kernel(x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor, eps: float, has_z: hl.constexpr, norm_before_gate: hl.constexpr, *, _launcher=_default_launcher):
    # src[rmsnorm_gated.py:111]: m, g, d = x.size()
    m, g, d = x.size()
    # src[rmsnorm_gated.py:113]: y = torch.empty_like(x)
    y = torch.empty_like(x)
    # src[rmsnorm_gated.py:114]: rstd = torch.empty([m, g], dtype=torch.float32, device=x.device)
    rstd = torch.empty([m, g], dtype=torch.float32, device=x.device)
    # src[rmsnorm_gated.py:115]: for tm, tg in hl.tile([m, g], block_size=[None, 1]):
    _RDIM_SIZE_2 = 512
    # src[rmsnorm_gated.py:115]: for tm, tg in hl.tile([m, g], block_size=[None, 1]):
    # src[rmsnorm_gated.py:116]:     xt = x[tm, tg, :].to(torch.float32)
    # src[rmsnorm_gated.py:117]:     if has_z and not norm_before_gate:
    # src[rmsnorm_gated.py:115-126]: ...
    _launcher(_helion_rmsnorm_gated_fwd_kernel, (16384,), x, weight, y, rstd, eps, _RDIM_SIZE_2, num_warps=1, num_stages=1)
    # src[rmsnorm_gated.py:127]: return y, rstd
    return (y, rstd)