# config {'block_sizes': [4], 'loop_orders': [[0, 1]], 'l2_groupings': [1], 'range_unroll_factors': [0, 0], 'range_num_stages': [0, 2], 'range_multi_buffers': [None, None], 'range_flattens': [None, None], 'load_eviction_policies': ['last', 'first', 'first', 'first'], 'num_warps': 2, 'num_stages': 1, 'indexing': ['pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer'], 'pid_type': 'flat', 'host_tensor_descriptors': False, 'rows_per_program': 128, 'atomic_indexing': [], 'range_warp_specializes': []}
# args ((torch.bfloat16, torch.Size([16384, 8, 512]), (4096, 512, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([16384, 8, 512]), (4096, 512, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([8, 512]), (512, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([16384, 8, 512]), (4096, 512, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([16384, 8]), (8, 1), device(type='cuda', index=0)), (<class 'bool'>, False), (<class 'bool'>, False))
from __future__ import annotations

import torch
import helion
import helion.language as hl
import triton
import triton.language as tl
from helion.runtime import default_launcher as _default_launcher
import kernels.rmsnorm_gated as _source_module

_BLOCK_SIZE_1 = tl.constexpr(1)
_BLOCK_SIZE_3 = tl.constexpr(4)

@triton.jit
def _helion_rmsnorm_gated_bwd_kernel(weight, x, dy, rstd, dx, dw_partial, _BLOCK_SIZE_0: tl.constexpr, _RDIM_SIZE_2: tl.constexpr):
    # src[rmsnorm_gated.py:180]: for tp, tg in hl.tile([m, g], block_size=[rows, 1]):
    num_blocks_0 = tl.cdiv(16384, _BLOCK_SIZE_0)
    pid_0 = tl.program_id(0) % num_blocks_0
    pid_1 = tl.program_id(0) // num_blocks_0
    offset_0 = pid_0 * _BLOCK_SIZE_0
    offset_1 = pid_1
    indices_1 = offset_1 + tl.zeros([1], tl.int32)
    indices_2 = tl.arange(0, _RDIM_SIZE_2).to(tl.int32)
    # src[rmsnorm_gated.py:181]: dw_acc = hl.zeros([tg, d], dtype=torch.float32)
    dw_acc = tl.full([_BLOCK_SIZE_1, _RDIM_SIZE_2], 0.0, tl.float32)
    # src[rmsnorm_gated.py:182]: wt = weight[tg, :].to(torch.float32)[None, :, :]
    load = tl.load(weight + (indices_1[:, None] * 512 + (0 + indices_2)[None, :] * 1), None, eviction_policy='evict_last')
    v_0 = tl.cast(load, tl.float32)
    wt = v_0[None, :, :]
    # src[rmsnorm_gated.py:183]: for tm in hl.tile(tp.begin, tp.end):
    tile_end = tl.minimum(offset_0 + _BLOCK_SIZE_0, 16384)
    # src[rmsnorm_gated.py:183]: for tm in hl.tile(tp.begin, tp.end):
    # src[rmsnorm_gated.py:184]:     xt = x[tm, tg, :].to(torch.float32)
    # src[rmsnorm_gated.py:185]:     dyt = dy[tm, tg, :].to(torch.float32)
    # src[rmsnorm_gated.py:183-208]: ...
    for offset_3 in tl.range(tl.cast(offset_0, tl.int32), tl.cast(tile_end, tl.int32), _BLOCK_SIZE_3, num_stages=2):
        indices_3 = offset_3 + tl.arange(0, _BLOCK_SIZE_3).to(tl.int32)
        mask_3 = indices_3 < tile_end
        wt_copy = wt
        dw_acc_copy = dw_acc
        wt_copy_0 = wt_copy
        dw_acc_copy_0 = dw_acc_copy
        # src[rmsnorm_gated.py:184]: xt = x[tm, tg, :].to(torch.float32)
        load_1 = tl.load(x + (indices_3[:, None, None] * 4096 + indices_1[None, :, None] * 512 + (0 + indices_2)[None, None, :] * 1), mask_3[:, None, None], other=0, eviction_policy='evict_first')
        v_1 = tl.cast(load_1, tl.float32)
        # src[rmsnorm_gated.py:185]: dyt = dy[tm, tg, :].to(torch.float32)
        load_2 = tl.load(dy + (indices_3[:, None, None] * 4096 + indices_1[None, :, None] * 512 + (0 + indices_2)[None, None, :] * 1), mask_3[:, None, None], other=0, eviction_policy='evict_first')
        v_2 = tl.cast(load_2, tl.float32)
        # src[rmsnorm_gated.py:186]: r = rstd[tm, tg][:, :, None]
        load_3 = tl.load(rstd + (indices_3[:, None] * 8 + indices_1[None, :] * 1), mask_3[:, None], other=0, eviction_policy='evict_first')
        subscript = load_3[:, :, None]
        # src[rmsnorm_gated.py:195]: xin = xt
        v_1_0 = v_1
        # src[rmsnorm_gated.py:196]: xhat = xin * r
        v_3 = v_1_0 * subscript
        # src[rmsnorm_gated.py:200]: dw_acc = dw_acc + torch.sum(dyt * xhat, dim=0)
        v_4 = v_2 * v_3
        sum_1 = tl.cast(tl.sum(v_4.to(tl.float32), 0), tl.float32)
        dw_acc = dw_acc_copy_0 + sum_1
        # src[rmsnorm_gated.py:201]: wdy = dyt * wt
        v_6 = v_2 * wt_copy_0
        # src[rmsnorm_gated.py:202]: c = torch.mean(xhat * wdy, dim=-1)
        v_7 = v_3 * v_6
        c_extra = tl.cast(tl.sum(v_7.to(tl.float32), 2), tl.float32)
        v_8 = 512
        v_9 = tl.cast(v_8, tl.float32)
        v_10 = c_extra / v_9
        # src[rmsnorm_gated.py:203]: dxin = (wdy - xhat * c[:, :, None]) * r
        subscript_1 = v_10[:, :, None]
        v_11 = v_3 * subscript_1
        v_12 = v_6 - v_11
        v_13 = v_12 * subscript
        # src[rmsnorm_gated.py:208]: dx[tm, tg, :] = dxin.to(dx.dtype)
        v_14 = tl.cast(v_13, tl.bfloat16)
        tl.store(dx + (indices_3[:, None, None] * 4096 + indices_1[None, :, None] * 512 + (0 + indices_2)[None, None, :] * 1), v_14, mask_3[:, None, None])
    # src[rmsnorm_gated.py:209]: dw_partial[tp.id, tg, :] = dw_acc
    tile_id = offset_0 // _BLOCK_SIZE_0
    tl.store(dw_partial + (tile_id * 4096 + indices_1[:, None] * 512 + (0 + indices_2)[None, :] * 1), dw_acc, None)

def rmsnorm_gated_bwd_kernel(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor, rstd: torch.Tensor, has_z: hl.constexpr, norm_before_gate: hl.constexpr, *, _launcher=_default_launcher):
    # src[rmsnorm_gated.py:174]: m, g, d = x.size()
    m, g, d = x.size()
    # src[rmsnorm_gated.py:175]: d = hl.specialize(d)
    d = 512
    # src[rmsnorm_gated.py:176]: rows = hl.register_tunable("rows_per_program", PowerOfTwoFragment(1, 16384, 64))
    rows = 128
    # src[rmsnorm_gated.py:177]: dx = torch.empty_like(x)
    dx = torch.empty_like(x)
    # src[rmsnorm_gated.py:178]: dz = torch.empty_like(z)
    dz = torch.empty_like(z)
    # src[rmsnorm_gated.py:179]: dw_partial = torch.empty([helion.cdiv(m, rows), g, d], dtype=torch.float32, device=x.device)
    dw_partial = torch.empty([helion.cdiv(m, rows), g, d], dtype=torch.float32, device=x.device)
    # src[rmsnorm_gated.py:180]: for tp, tg in hl.tile([m, g], block_size=[rows, 1]):
    _BLOCK_SIZE_0 = rows
    _RDIM_SIZE_2 = 512
    # src[rmsnorm_gated.py:180]: for tp, tg in hl.tile([m, g], block_size=[rows, 1]):
    # src[rmsnorm_gated.py:181]:     dw_acc = hl.zeros([tg, d], dtype=torch.float32)
    # src[rmsnorm_gated.py:182]:     wt = weight[tg, :].to(torch.float32)[None, :, :]
    # src[rmsnorm_gated.py:180-209]: ...
    _launcher(_helion_rmsnorm_gated_bwd_kernel, ((16384 + _BLOCK_SIZE_0 - 1) // _BLOCK_SIZE_0 * 8,), weight, x, dy, rstd, dx, dw_partial, _BLOCK_SIZE_0, _RDIM_SIZE_2, num_warps=2, num_stages=1)
    # src[rmsnorm_gated.py:210]: return dx, dz, dw_partial
    return (dx, dz, dw_partial)