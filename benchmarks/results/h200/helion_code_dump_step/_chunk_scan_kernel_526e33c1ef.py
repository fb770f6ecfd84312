# config {'block_sizes': [128, 64, 128], 'loop_orders': [[0, 1, 2, 3, 4]], 'l2_groupings': [1], 'range_unroll_factors': [0, 0], 'range_num_stages': [0, 0], 'range_multi_buffers': [None, None], 'range_flattens': [None, None], 'load_eviction_policies': ['', '', '', '', '', '', '', '', '', '', ''], 'num_warps': 4, 'num_stages': 1, 'indexing': ['pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer'], 'pid_type': 'flat', 'host_tensor_descriptors': False, 'atomic_indexing': [], 'range_warp_specializes': []}
# args ((torch.float32, torch.Size([2, 64, 8, 128, 128]), (8388608, 131072, 16384, 128, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 8192, 64, 64]), (50331648, 6144, 64, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 64, 128]), (524288, 8192, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 64, 128]), (524288, 8192, 128, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 8192, 8, 128]), (50331648, 6144, 128, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 64, 64, 64, 128]), (33554432, 524288, 8192, 128, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([64, 64]), (1, 0), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 8192, 64, 64]), (84410368, 10304, 64, 1), device(type='cuda', index=0)), (<class 'NoneType'>, None), (<class 'NoneType'>, None))
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._inductor.runtime import triton_helpers
from torch._inductor.runtime.triton_compat import libdevice
from helion.runtime import default_launcher as _default_launcher
import kernels.ssd_helion as _source_module

_BLOCK_SIZE_0 = tl.constexpr(128)
_BLOCK_SIZE_1 = tl.constexpr(64)
_BLOCK_SIZE_2 = tl.constexpr(128)

@triton.jit
def _helion__chunk_scan_kernel(dA_cumsum, C, states_in, CB, dt, x, D, out_x, z, out, _source_module_attr__LOG2E, _RDIM_SIZE_6: tl.constexpr):
    # src[ssd_helion.py:255]: for tb, tc, th, tm, tn in hl.tile([b, nc, h, c, p], block_size=[1, 1, 1, block_m, block_n]):
    num_blocks_0 = 2
    num_blocks_1 = 64
    num_blocks_2 = 64
    num_blocks_3 = tl.cdiv(128, _BLOCK_SIZE_0)
    pid_0 = tl.program_id(0) % num_blocks_0
    pid_1 = tl.program_id(0) // num_blocks_0 % num_blocks_1
    pid_2 = tl.program_id(0) // (num_blocks_0 * num_blocks_1) % num_blocks_2
    pid_3 = tl.program_id(0) // (num_blocks_0 * num_blocks_1 * num_blocks_2) % num_blocks_3
    pid_4 = tl.program_id(0) // (num_blocks_0 * num_blocks_1 * num_blocks_2 * num_blocks_3)
    offset_3 = pid_0
    offset_4 = pid_1
    offset_5 = pid_2
    offset_0 = pid_3 * _BLOCK_SIZE_0
    indices_0 = (offset_0 + tl.arange(0, _BLOCK_SIZE_0)).to(tl.int32)
    offset_1 = pid_4 * _BLOCK_SIZE_1
    indices_1 = (offset_1 + tl.arange(0, _BLOCK_SIZE_1)).to(tl.int32)
    indices_6 = tl.arange(0, _RDIM_SIZE_6).to(tl.int32)
    # src[ssd_helion.py:256]: pos_m = tc.begin * c + tm.index
    mul = 128 * offset_4
    v_0 = tl.cast(mul, tl.int32)
    v_1 = indices_0 + v_0
    # src[ssd_helion.py:257]: dA_m = dA_cumsum[tb.begin, th.begin, tc.begin, tm]
    dA_m = tl.load(dA_cumsum + (offset_3 * 524288 + offset_5 * 8192 + offset_4 * 128 + indices_0 * 1), None)
    # src[ssd_helion.py:259]: c_m = C[tb.begin, pos_m, th.begin // ratio, :]  # (M, n)
    floordiv = triton_helpers.div_floor_integer(offset_5, 8)
    c_m = tl.load(C + (offset_3 * 50331648 + (indices_0 + mul)[:, None] * 6144 + floordiv * 128 + (0 + indices_6)[None, :] * 1), None)
    # src[ssd_helion.py:260]: st = states_in[tb.begin, tc.begin, th.begin, tn, :].to(C.dtype)  # (N, n)
    st = tl.load(states_in + (offset_3 * 33554432 + offset_4 * 524288 + offset_5 * 8192 + indices_1[:, None] * 128 + (0 + indices_6)[None, :] * 1), None)
    # src[ssd_helion.py:261]: acc = hl.dot(c_m, st.permute(1, 0))
    permute = tl.permute(st, [1, 0])
    acc = tl.dot(tl.cast(c_m, tl.bfloat16), tl.cast(permute, tl.bfloat16), input_precision='tf32', out_dtype=tl.float32)
    # src[ssd_helion.py:262]: scale_m = torch.exp2(dA_m * _LOG2E)
    v_2 = dA_m * _source_module_attr__LOG2E
    v_3 = libdevice.exp2(v_2)
    # src[ssd_helion.py:266]: acc = acc * scale_m[:, None]
    subscript = v_3[:, None]
    v_4 = acc * subscript
    # src[ssd_helion.py:268]: for tk in hl.tile((tm.id + 1) * block_m, block_size=block_k):
    tile_id = offset_0 // _BLOCK_SIZE_0
    add_1 = 1 + tile_id
    mul_3 = _BLOCK_SIZE_0 + _BLOCK_SIZE_0 * tile_id
    # src[ssd_helion.py:268]: for tk in hl.tile((tm.id + 1) * block_m, block_size=block_k):
    # src[ssd_helion.py:269]:     cb = CB[tb.begin, tc.begin, th.begin // ratio, tm, tk]
    # src[ssd_helion.py:270]:     dA_k = dA_cumsum[tb.begin, th.begin, tc.begin, tk]
    # src[ssd_helion.py:268-275]: ...
    for offset_2 in tl.range(0, tl.cast(mul_3, tl.int32), _BLOCK_SIZE_2):
        indices_2 = offset_2 + tl.arange(0, _BLOCK_SIZE_2).to(tl.int32)
        mask_2 = indices_2 < mul_3
        dA_m_copy = dA_m
        v_4_copy = v_4
        dA_m_copy_0 = dA_m_copy
        v_4_copy_0 = v_4_copy
        # src[ssd_helion.py:269]: cb = CB[tb.begin, tc.begin, th.begin // ratio, tm, tk]
        cb = tl.load(CB + (offset_3 * 8388608 + offset_4 * 131072 + floordiv * 16384 + indices_0[:, None] * 128 + indices_2[None, :] * 1), mask_2[None, :], other=0)
        # src[ssd_helion.py:270]: dA_k = dA_cumsum[tb.begin, th.begin, tc.begin, tk]
        dA_k = tl.load(dA_cumsum + (offset_3 * 524288 + offset_5 * 8192 + offset_4 * 128 + indices_2 * 1), mask_2, other=0)
        # src[ssd_helion.py:271]: dt_k = dt[tb.begin, th.begin, tc.begin, tk]
        dt_k = tl.load(dt + (offset_3 * 524288 + offset_5 * 8192 + offset_4 * 128 + indices_2 * 1), mask_2, other=0)
        # src[ssd_helion.py:272]: w = cb * torch.exp2(torch.clamp(dA_m[:, None] - dA_k[None, :], max=0.0) * _LOG2E) * dt_k[None, :]
        subscript_1 = dA_m_copy_0[:, None]
        subscript_2 = dA_k[None, :]
        v_5 = subscript_1 - subscript_2
        v_6 = tl.full([], 0.0, tl.float32)
        v_7 = triton_helpers.minimum(v_5, v_6)
        v_8 = v_7 * _source_module_attr__LOG2E
        v_9 = libdevice.exp2(v_8)
        v_10 = cb * v_9
        subscript_3 = dt_k[None, :]
        v_11 = v_10 * subscript_3
        # src[ssd_helion.py:273]: w = torch.where(tm.index[:, None] >= tk.index[None, :], w, 0.0).to(x.dtype)
        load_3 = indices_0[:, None]
        subscript_4 = indices_2[None, :]
        v_12 = load_3 >= subscript_4
        scalar_tensor = tl.full([], 0.0, tl.float32)
        where = tl.where(v_12, v_11, scalar_tensor)
        v_13 = tl.cast(where, tl.bfloat16)
        # src[ssd_helion.py:274]: x_k = x[tb.begin, tc.begin * c + tk.index, th.begin, tn]
        v_14 = tl.cast(mul, tl.int32)
        v_15 = indices_2 + v_14
        x_k = tl.load(x + (offset_3 * 50331648 + (indices_2 + mul)[:, None] * 6144 + offset_5 * 64 + indices_1[None, :] * 1), mask_2[:, None], other=0)
        # src[ssd_helion.py:275]: acc = hl.dot(w, x_k, acc=acc)
        v_4 = tl.dot(tl.cast(v_13, tl.bfloat16), tl.cast(x_k, tl.bfloat16), acc=v_4_copy_0, input_precision='tf32', out_dtype=tl.float32)
    # src[ssd_helion.py:277]: x_m = x[tb.begin, pos_m, th.begin, tn].to(torch.float32)
    load_1 = tl.load(x + (offset_3 * 50331648 + (indices_0 + mul)[:, None] * 6144 + offset_5 * 64 + indices_1[None, :] * 1), None)
    v_16 = tl.cast(load_1, tl.float32)
    # src[ssd_helion.py:278]: acc = acc + x_m * D[th.begin, tn].to(torch.float32)[None, :]
    load_4 = tl.load(D + (offset_5 * 1 + indices_1 * 0), None)
    v_17 = tl.cast(load_4, tl.float32)
    subscript_5 = v_17[None, :]
    v_18 = v_16 * subscript_5
    v_19 = v_4 + v_18
    # src[ssd_helion.py:280]: out_x[tb.begin, pos_m, th.begin, tn] = acc.to(out_x.dtype)
    v_20 = tl.cast(v_19, tl.bfloat16)
    tl.store(out_x + (offset_3 * 33554432 + (indices_0 + mul)[:, None] * 4096 + offset_5 * 64 + indices_1[None, :] * 1), v_20, None)
    # src[ssd_helion.py:281]: z_m = z[tb.begin, pos_m, th.begin, tn].to(torch.float32)
    load_5 = tl.load(z + (offset_3 * 84410368 + (indices_0 + mul)[:, None] * 10304 + offset_5 * 64 + indices_1[None, :] * 1), None)
    v_21 = tl.cast(load_5, tl.float32)
    # src[ssd_helion.py:282]: acc = acc * (z_m * torch.sigmoid(z_m))
    v_22 = tl.cast(v_21, tl.float32)
    v_23 = tl.sigmoid(v_22)
    v_24 = v_21 * v_23
    v_25 = v_19 * v_24
    # src[ssd_helion.py:283]: out[tb.begin, pos_m, th.begin, tn] = acc.to(out.dtype)
    v_26 = tl.cast(v_25, tl.bfloat16)
    tl.store(out + (offset_3 * 33554432 + (indices_0 + mul)[:, None] * 4096 + offset_5 * 64 + indices_1[None, :] * 1), v_26, None)

def _chunk_scan_kernel(CB: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, dA_cumsum: torch.Tensor, C: torch.Tensor, states_in: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None, seq_idx: torch.Tensor | None, seq_end: torch.Tensor | None, *, _launcher=_default_launcher):
    # src[ssd_helion.py:244]: b, L, h, p = x.shape
    b, L, h, p = x.shape
    # src[ssd_helion.py:245]: out = torch.empty_like(x)
    out = torch.empty_like(x)
    # src[ssd_helion.py:246]: out_x = torch.empty_like(x) if z is not None else out
    out_x = torch.empty_like(x) if z is not None else out
    # src[ssd_helion.py:247]: _, nc, g, c, _ = CB.shape
    _, nc, g, c, _ = CB.shape
    # src[ssd_helion.py:255]: for tb, tc, th, tm, tn in hl.tile([b, nc, h, c, p], block_size=[1, 1, 1, block_m, block_n]):
    _BLOCK_SIZE_0 = 128
    _RDIM_SIZE_6 = 128
    # src[ssd_helion.py:255]: for tb, tc, th, tm, tn in hl.tile([b, nc, h, c, p], block_size=[1, 1, 1, block_m, block_n]):
    # src[ssd_helion.py:256]:     pos_m = tc.begin * c + tm.index
    # src[ssd_helion.py:257]:     dA_m = dA_cumsum[tb.begin, th.begin, tc.begin, tm]
    # src[ssd_helion.py:255-283]: ...
    _RDIM_SIZE_7 = max(triton.next_power_of_2(_BLOCK_SIZE_0), 1)
    _launcher(_helion__chunk_scan_kernel, (8192,), dA_cumsum, C, states_in, CB, dt, x, D, out_x, z, out, _source_module._LOG2E, _RDIM_SIZE_6, num_warps=4, num_stages=1)
    # src[ssd_helion.py:284]: return out, out_x
    return (out, out_x)