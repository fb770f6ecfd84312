# config {'block_sizes': [16], 'loop_orders': [[0, 1, 2]], 'l2_groupings': [1], 'range_unroll_factors': [0, 0], 'range_num_stages': [0, 0], 'range_multi_buffers': [None, None], 'range_flattens': [None, None], 'load_eviction_policies': ['', '', '', '', '', ''], 'num_warps': 4, 'num_stages': 3, 'indexing': ['pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer'], 'pid_type': 'flat', 'host_tensor_descriptors': False, 'atomic_indexing': [], 'range_warp_specializes': []}
# args ((torch.bfloat16, torch.Size([2, 64, 128, 64, 64]), (4096, 1048576, 8192, 64, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 64, 128, 64, 64]), (84410368, 1318912, 10304, 64, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 64, 128, 64, 64]), (33554432, 524288, 4096, 64, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 64, 128, 8, 128]), (50331648, 786432, 6144, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 64, 128]), (524288, 8192, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 128]), (8192, 128, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 64, 128, 64, 64]), (84410368, 1318912, 10304, 64, 1), device(type='cuda', index=0)))
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._inductor.runtime import triton_helpers
from torch._inductor.runtime.triton_compat import libdevice
from helion.runtime import default_launcher as _default_launcher

_BLOCK_SIZE_0 = tl.constexpr(16)

@triton.jit
def _helion_ssd_bwd_dz_dstates(dout, z, out_x, dz, dout_x, dA_cumsum, prev_keep, C, dstates, _RDIM_SIZE_4: tl.constexpr, _RDIM_SIZE_5: tl.constexpr):
    # src[ssd_helion_bwd.py:82]: for ib, ic, ih in hl.grid([b, nc, h]):
    num_blocks_0 = 2
    num_blocks_1 = 64
    pid_0 = tl.program_id(0) % num_blocks_0
    pid_1 = tl.program_id(0) // num_blocks_0 % num_blocks_1
    pid_2 = tl.program_id(0) // (num_blocks_0 * num_blocks_1)
    offset_1 = pid_0
    offset_2 = pid_1
    offset_3 = pid_2
    indices_4 = tl.arange(0, _RDIM_SIZE_4).to(tl.int32)
    indices_5 = tl.arange(0, _RDIM_SIZE_5).to(tl.int32)
    # src[ssd_helion_bwd.py:84]: acc = hl.zeros([p, n], dtype=torch.float32)
    acc = tl.full([_RDIM_SIZE_4, _RDIM_SIZE_5], 0.0, tl.float32)
    # src[ssd_helion_bwd.py:95]: cs = (C[ib, ic, tt, ig, :].to(torch.float32) * scale[:, None]).to(C.dtype)
    symnode_0 = triton_helpers.div_floor_integer(offset_3, 8)
    # src[ssd_helion_bwd.py:85]: for tt in hl.tile(c, block_size=bk):
    # src[ssd_helion_bwd.py:86]:     do = dout[ib, ic, tt, ih, :].to(torch.float32)
    # src[ssd_helion_bwd.py:87]:     zz = z[ib, ic, tt, ih, :].to(torch.float32)
    # src[ssd_helion_bwd.py:85-96]: ...
    for offset_0 in tl.range(0, 128, _BLOCK_SIZE_0):
        indices_0 = offset_0 + tl.arange(0, _BLOCK_SIZE_0).to(tl.int32)
        acc_copy = acc
        acc_copy_0 = acc_copy
        # src[ssd_helion_bwd.py:86]: do = dout[ib, ic, tt, ih, :].to(torch.float32)
        load = tl.load(dout + (offset_1 * 4096 + offset_2 * 1048576 + indices_0[:, None] * 8192 + offset_3 * 64 + (0 + indices_4)[None, :] * 1), None)
        v_0 = tl.cast(load, tl.float32)
        # src[ssd_helion_bwd.py:87]: zz = z[ib, ic, tt, ih, :].to(torch.float32)
        load_1 = tl.load(z + (offset_1 * 84410368 + offset_2 * 1318912 + indices_0[:, None] * 10304 + offset_3 * 64 + (0 + indices_4)[None, :] * 1), None)
        v_1 = tl.cast(load_1, tl.float32)
        # src[ssd_helion_bwd.py:88]: ox = out_x[ib, ic, tt, ih, :].to(torch.float32)
        load_2 = tl.load(out_x + (offset_1 * 33554432 + offset_2 * 524288 + indices_0[:, None] * 4096 + offset_3 * 64 + (0 + indices_4)[None, :] * 1), None)
        v_2 = tl.cast(load_2, tl.float32)
        # src[ssd_helion_bwd.py:89]: sz = torch.sigmoid(zz)
        v_3 = tl.cast(v_1, tl.float32)
        v_4 = tl.sigmoid(v_3)
        # src[ssd_helion_bwd.py:90]: dox = do * zz * sz
        v_5 = v_0 * v_1
        v_6 = v_5 * v_4
        # src[ssd_helion_bwd.py:91]: dz[ib, ic, tt, ih, :] = (do * ox * sz * (1.0 + zz * (1.0 - sz))).to(dz.dtype)
        v_7 = v_0 * v_2
        v_8 = v_7 * v_4
        v_9 = tl.full([], 1.0, tl.float32)
        v_10 = v_9 - v_4
        v_11 = v_1 * v_10
        v_12 = tl.full([], 1.0, tl.float32)
        v_13 = v_11 + v_12
        v_14 = v_8 * v_13
        v_15 = tl.cast(v_14, tl.bfloat16)
        tl.store(dz + (offset_1 * 84410368 + offset_2 * 1318912 + indices_0[:, None] * 10304 + offset_3 * 64 + (0 + indices_4)[None, :] * 1), v_15, None)
        # src[ssd_helion_bwd.py:92]: dox_c = dox.to(dout.dtype)
        v_16 = tl.cast(v_6, tl.bfloat16)
        # src[ssd_helion_bwd.py:93]: dout_x[ib, ic, tt, ih, :] = dox_c
        tl.store(dout_x + (offset_1 * 4096 + offset_2 * 1048576 + indices_0[:, None] * 8192 + offset_3 * 64 + (0 + indices_4)[None, :] * 1), v_16, None)
        # src[ssd_helion_bwd.py:94]: scale = torch.exp(dA_cumsum[ib, ih, ic, tt]) * prev_keep[ib, ic, tt]
        load_3 = tl.load(dA_cumsum + (offset_1 * 524288 + offset_3 * 8192 + offset_2 * 128 + indices_0 * 1), None)
        v_17 = libdevice.exp(load_3)
        load_4 = tl.load(prev_keep + (offset_1 * 8192 + offset_2 * 128 + indices_0 * 1), None)
        v_18 = v_17 * load_4
        # src[ssd_helion_bwd.py:95]: cs = (C[ib, ic, tt, ig, :].to(torch.float32) * scale[:, None]).to(C.dtype)
        load_5 = tl.load(C + (offset_1 * 50331648 + offset_2 * 786432 + indices_0[:, None] * 6144 + symnode_0 * 128 + (0 + indices_5)[None, :] * 1), None)
        v_19 = tl.cast(load_5, tl.float32)
        subscript = v_18[:, None]
        v_20 = v_19 * subscript
        v_21 = tl.cast(v_20, tl.bfloat16)
        # src[ssd_helion_bwd.py:96]: acc = hl.dot(dox_c.T, cs, acc=acc)
        permute = tl.permute(v_16, [1, 0])
        acc = tl.dot(tl.cast(permute, tl.bfloat16), tl.cast(v_21, tl.bfloat16), acc=acc_copy_0, input_precision='tf32', out_dtype=tl.float32)
    # src[ssd_helion_bwd.py:97]: dstates[ib, ic, ih, :, :] = acc
    tl.store(dstates + (offset_1 * 33554432 + offset_2 * 524288 + offset_3 * 8192 + (0 + indices_4)[:, None] * 128 + (0 + indices_5)[None, :] * 1), acc, None)

def ssd_bwd_dz_dstates(dout: torch.Tensor, z: torch.Tensor, out_x: torch.Tensor, C: torch.Tensor, dA_cumsum: torch.Tensor, prev_keep: torch.Tensor, dz: torch.Tensor, *, _launcher=_default_launcher):
    # src[ssd_helion_bwd.py:75]: b, nc, c, h, p = dout.shape
    b, nc, c, h, p = dout.shape
    # src[ssd_helion_bwd.py:76]: g = C.shape[3]
    g = C.shape[3]
    # src[ssd_helion_bwd.py:77]: n = C.shape[4]
    n = C.shape[4]
    # src[ssd_helion_bwd.py:79]: dout_x = torch.empty_like(dout)
    dout_x = torch.empty_like(dout)
    # src[ssd_helion_bwd.py:80]: dstates = torch.empty([b, nc, h, p, n], dtype=torch.float32, device=dout.device)
    dstates = torch.empty([b, nc, h, p, n], dtype=torch.float32, device=dout.device)
    # src[ssd_helion_bwd.py:82]: for ib, ic, ih in hl.grid([b, nc, h]):
    _RDIM_SIZE_4 = 64
    _RDIM_SIZE_5 = 128
    # src[ssd_helion_bwd.py:82]: for ib, ic, ih in hl.grid([b, nc, h]):
    # src[ssd_helion_bwd.py:83]:     ig = ih // hpg
    # src[ssd_helion_bwd.py:84]:     acc = hl.zeros([p, n], dtype=torch.float32)
    # src[ssd_helion_bwd.py:82-97]: ...
    _launcher(_helion_ssd_bwd_dz_dstates, (8192,), dout, z, out_x, dz, dout_x, dA_cumsum, prev_keep, C, dstates, _RDIM_SIZE_4, _RDIM_SIZE_5, num_warps=4, num_stages=3)
    # src[ssd_helion_bwd.py:98]: return dout_x, dstates
    return (dout_x, dstates)