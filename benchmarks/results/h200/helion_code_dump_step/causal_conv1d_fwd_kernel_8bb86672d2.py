# config {'block_sizes': [64, 64], 'loop_orders': [[0, 1, 2]], 'l2_groupings': [1], 'range_unroll_factors': [0], 'range_num_stages': [0], 'range_multi_buffers': [None], 'range_flattens': [None], 'load_eviction_policies': ['', '', '', '', '', '', '', '', ''], 'num_warps': 4, 'num_stages': 1, 'indexing': ['pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer'], 'pid_type': 'flat', 'host_tensor_descriptors': False, 'atomic_indexing': [], 'range_warp_specializes': []}
# args ((torch.bfloat16, torch.Size([2, 8192, 6144]), (84410368, 10304, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([6144, 4]), (4, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([6144]), (1,), device(type='cuda', index=0)), (<class 'NoneType'>, None), (<class 'bool'>, True))
from __future__ import annotations

import torch
import helion.language as hl
import triton
import triton.language as tl
from helion.runtime import default_launcher as _default_launcher

_BLOCK_SIZE_1 = tl.constexpr(64)
_BLOCK_SIZE_2 = tl.constexpr(64)

@triton.jit
def _helion_causal_conv1d_fwd_kernel(bias, x, w4, out):
    # src[causal_conv1d.py:90]: for tb, tt, td in hl.tile([nb, nl, nd], block_size=[1, None, None]):
    num_blocks_0 = 2
    num_blocks_1 = tl.cdiv(8192, _BLOCK_SIZE_1)
    pid_0 = tl.program_id(0) % num_blocks_0
    pid_1 = tl.program_id(0) // num_blocks_0 % num_blocks_1
    pid_2 = tl.program_id(0) // (num_blocks_0 * num_blocks_1)
    offset_0 = pid_0
    offset_1 = pid_1 * _BLOCK_SIZE_1
    indices_1 = (offset_1 + tl.arange(0, _BLOCK_SIZE_1)).to(tl.int32)
    offset_2 = pid_2 * _BLOCK_SIZE_2
    indices_2 = (offset_2 + tl.arange(0, _BLOCK_SIZE_2)).to(tl.int32)
    # src[causal_conv1d.py:92]: acc = hl.zeros([tt, td], dtype=torch.float32)
    acc = tl.full([_BLOCK_SIZE_1, _BLOCK_SIZE_2], 0.0, tl.float32)
    # src[causal_conv1d.py:94]: acc = acc + bias[td].to(torch.float32)[None, :]
    load = tl.load(bias + indices_2 * 1, None)
    v_0 = tl.cast(load, tl.float32)
    subscript = v_0[None, :]
    v_1 = acc + subscript
    # src[causal_conv1d.py:98]: src = t - (3 - k)
    v_2 = tl.full([], 3, tl.int32)
    v_3 = indices_1 - v_2
    # src[causal_conv1d.py:99]: ok = src >= 0
    v_4 = tl.full([], 0, tl.int32)
    v_5 = v_3 >= v_4
    # src[causal_conv1d.py:103]: xv = hl.load(x, [tb.begin, src, td], extra_mask=ok[:, None])
    subscript_1 = v_5[:, None]
    xv = tl.load(x + (offset_0 * 84410368 + v_3[:, None] * 10304 + indices_2[None, :] * 1), subscript_1, other=0)
    # src[causal_conv1d.py:104]: acc = acc + xv.to(torch.float32) * w4[td, k].to(torch.float32)[None, :]
    v_6 = tl.cast(xv, tl.float32)
    load_2 = tl.load(w4 + (indices_2 * 4 + 0 * 1), None)
    v_7 = tl.cast(load_2, tl.float32)
    subscript_2 = v_7[None, :]
    v_8 = v_6 * subscript_2
    v_9 = v_1 + v_8
    # src[causal_conv1d.py:98]: src = t - (3 - k)
    v_10 = tl.full([], 2, tl.int32)
    v_11 = indices_1 - v_10
    # src[causal_conv1d.py:99]: ok = src >= 0
    v_12 = tl.full([], 0, tl.int32)
    v_13 = v_11 >= v_12
    # src[causal_conv1d.py:103]: xv = hl.load(x, [tb.begin, src, td], extra_mask=ok[:, None])
    subscript_3 = v_13[:, None]
    xv_1 = tl.load(x + (offset_0 * 84410368 + v_11[:, None] * 10304 + indices_2[None, :] * 1), subscript_3, other=0)
    # src[causal_conv1d.py:104]: acc = acc + xv.to(torch.float32) * w4[td, k].to(torch.float32)[None, :]
    v_14 = tl.cast(xv_1, tl.float32)
    load_4 = tl.load(w4 + (indices_2 * 4 + 1 * 1), None)
    v_15 = tl.cast(load_4, tl.float32)
    subscript_4 = v_15[None, :]
    v_16 = v_14 * subscript_4
    v_17 = v_9 + v_16
    # src[causal_conv1d.py:98]: src = t - (3 - k)
    v_18 = tl.full([], 1, tl.int32)
    v_19 = indices_1 - v_18
    # src[causal_conv1d.py:99]: ok = src >= 0
    v_20 = tl.full([], 0, tl.int32)
    v_21 = v_19 >= v_20
    # src[causal_conv1d.py:103]: xv = hl.load(x, [tb.begin, src, td], extra_mask=ok[:, None])
    subscript_5 = v_21[:, None]
    xv_2 = tl.load(x + (offset_0 * 84410368 + v_19[:, None] * 10304 + indices_2[None, :] * 1), subscript_5, other=0)
    # src[causal_conv1d.py:104]: acc = acc + xv.to(torch.float32) * w4[td, k].to(torch.float32)[None, :]
    v_22 = tl.cast(xv_2, tl.float32)
    load_6 = tl.load(w4 + (indices_2 * 4 + 2 * 1), None)
    v_23 = tl.cast(load_6, tl.float32)
    subscript_6 = v_23[None, :]
    v_24 = v_22 * subscript_6
    v_25 = v_17 + v_24
    # src[causal_conv1d.py:98]: src = t - (3 - k)
    v_26 = tl.full([], 0, tl.int32)
    v_27 = indices_1 - v_26
    # src[causal_conv1d.py:99]: ok = src >= 0
    v_28 = tl.full([], 0, tl.int32)
    v_29 = v_27 >= v_28
    # src[causal_conv1d.py:103]: xv = hl.load(x, [tb.begin, src, td], extra_mask=ok[:, None])
    subscript_7 = v_29[:, None]
    xv_3 = tl.load(x + (offset_0 * 84410368 + v_27[:, None] * 10304 + indices_2[None, :] * 1), subscript_7, other=0)
    # src[causal_conv1d.py:104]: acc = acc + xv.to(torch.float32) * w4[td, k].to(torch.float32)[None, :]
    v_30 = tl.cast(xv_3, tl.float32)
    load_8 = tl.load(w4 + (indices_2 * 4 + 3 * 1), None)
    v_31 = tl.cast(load_8, tl.float32)
    subscript_8 = v_31[None, :]
    v_32 = v_30 * subscript_8
    v_33 = v_25 + v_32
    # src[causal_conv1d.py:106]: acc = acc * torch.sigmoid(acc)
    v_34 = tl.cast(v_33, tl.float32)
    v_35 = tl.sigmoid(v_34)
    v_36 = v_33 * v_35
    # src[causal_conv1d.py:107]: out[tb.begin, tt, td] = acc.to(out.dtype)
    v_37 = tl.cast(v_36, tl.bfloat16)
    tl.store(out + (offset_0 * 50331648 + indices_1[:, None] * 6144 + indices_2[None, :] * 1), v_37, None)

def causal_conv1d_fwd_kernel(x: torch.Tensor, w4: torch.Tensor, bias: torch.Tensor | None, seq: torch.Tensor | None, silu: hl.constexpr, *, _launcher=_default_launcher):
    # src[causal_conv1d.py:88]: nb, nl, nd = x.size()
    nb, nl, nd = x.size()
    # src[causal_conv1d.py:89]: out = torch.empty([nb, nl, nd], dtype=x.dtype, device=x.device)
    out = torch.empty([nb, nl, nd], dtype=x.dtype, device=x.device)
    # src[causal_conv1d.py:90]: for tb, tt, td in hl.tile([nb, nl, nd], block_size=[1, None, None]):
    # src[causal_conv1d.py:91]:     t = tt.index
    # src[causal_conv1d.py:92]:     acc = hl.zeros([tt, td], dtype=torch.float32)
    # src[causal_conv1d.py:90-107]: ...
    _launcher(_helion_causal_conv1d_fwd_kernel, (24576,), bias, x, w4, out, num_warps=4, num_stages=1)
    # src[causal_conv1d.py:108]: return out
    return out