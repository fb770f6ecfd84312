# config {'block_sizes': [8], 'loop_orders': [[0, 1, 2]], 'l2_groupings': [1], 'range_unroll_factors': [0, 0], 'range_num_stages': [0, 0], 'range_multi_buffers': [None, None], 'range_flattens': [None, None], 'static_ranges': [False], 'load_eviction_policies': ['', '', ''], 'num_warps': 4, 'num_stages': 1, 'indexing': ['pointer', 'pointer', 'pointer', 'pointer', 'pointer'], 'pid_type': 'flat', 'host_tensor_descriptors': False, 'atomic_indexing': [], 'range_warp_specializes': []}
# args ((torch.bfloat16, torch.Size([2, 8192, 64]), (84410368, 10304, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([64]), (1,), device(type='cuda', index=0)), (torch.float32, torch.Size([64]), (1,), device(type='cuda', index=0)), (<class 'int'>, 128), (<class 'int'>, 8192), (<class 'float'>, 0.0), (<class 'float'>, inf), (<class 'bool'>, True))
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._inductor.runtime import triton_helpers
from torch._inductor.runtime.triton_compat import libdevice
from helion.runtime import default_launcher as _default_launcher

_BLOCK_SIZE_0 = tl.constexpr(8)
_BLOCK_SIZE_3 = tl.constexpr(128)

@triton.jit
def add_2(param_0, param_1):
    # src[ssd_helion.py:83]: dA_cs = torch.cumsum(dA, dim=0)
    v_0 = param_0 + param_1
    # src[ssd_helion.py:56]: def _chunk_cumsum_kernel(
    # src[ssd_helion.py:57]:     dt: torch.Tensor,  # (b, L, h) any float dtype, L = nc * c
    # src[ssd_helion.py:58]:     A: torch.Tensor,  # (h,)
    # src[ssd_helion.py:56-86]: ...
    return v_0

@triton.jit
def _helion__chunk_cumsum_kernel(dt, dt_bias, A, dt_out, dA_cumsum, dt_softplus, dt_min, dt_max, seqlen):
    # src[ssd_helion.py:72]: for tb, tc, th in hl.tile([b, nc, h], block_size=[1, 1, block_h]):
    num_blocks_0 = 2
    num_blocks_1 = 64
    pid_0 = tl.program_id(0) % num_blocks_0
    pid_1 = tl.program_id(0) // num_blocks_0 % num_blocks_1
    pid_2 = tl.program_id(0) // (num_blocks_0 * num_blocks_1)
    offset_1 = pid_0
    offset_2 = pid_1
    offset_0 = pid_2 * _BLOCK_SIZE_0
    indices_0 = (offset_0 + tl.arange(0, _BLOCK_SIZE_0)).to(tl.int32)
    # src[ssd_helion.py:73]: for tk in hl.tile(c, block_size=c):
    # src[ssd_helion.py:74]:     d = dt[tb.begin, tc.begin * c + tk.index, th].to(torch.float32)  # (c, BH)
    # src[ssd_helion.py:75]:     if dt_bias is not None:
    # src[ssd_helion.py:73-85]: ...
    for offset_3 in tl.range(0, 128, _BLOCK_SIZE_3):
        indices_3 = offset_3 + tl.arange(0, _BLOCK_SIZE_3).to(tl.int32)
        # src[ssd_helion.py:74]: d = dt[tb.begin, tc.begin * c + tk.index, th].to(torch.float32)  # (c, BH)
        mul = 128 * offset_2
        v_0 = tl.cast(mul, tl.int32)
        v_1 = indices_3 + v_0
        load = tl.load(dt + (offset_1 * 84410368 + (indices_3 + mul)[:, None] * 10304 + indices_0[None, :] * 1), None)
        v_2 = tl.cast(load, tl.float32)
        # src[ssd_helion.py:76]: d = d + dt_bias[th].to(torch.float32)[None, :]
        load_1 = tl.load(dt_bias + indices_0 * 1, None)
        subscript = load_1[None, :]
        v_3 = v_2 + subscript
        # src[ssd_helion.py:77]: if dt_softplus:
        # src[ssd_helion.py:78]:     d = torch.where(d <= 20.0, torch.log1p(torch.exp(d)), d)
        if dt_softplus:
            v_3_before_if = v_3
            v_3_copy = v_3
            v_3_copy_0 = v_3_copy
            # src[ssd_helion.py:78]: d = torch.where(d <= 20.0, torch.log1p(torch.exp(d)), d)
            v_4 = tl.full([], 20.0, tl.float32)
            v_5 = v_3_copy_0 <= v_4
            v_6 = libdevice.exp(v_3_copy_0)
            v_7 = libdevice.log1p(v_6)
            d = tl.where(v_5, v_7, v_3_copy_0)
            # src[ssd_helion.py:77]: if dt_softplus:
            # src[ssd_helion.py:78]:     d = torch.where(d <= 20.0, torch.log1p(torch.exp(d)), d)
            v_3 = d.to(v_3_before_if.dtype)
        else:
            pass
        # src[ssd_helion.py:79]: d = torch.clamp(d, min=dt_min, max=dt_max)
        v_9 = triton_helpers.maximum(v_3, dt_min)
        v_10 = triton_helpers.minimum(v_9, dt_max)
        # src[ssd_helion.py:80]: pos = tc.begin * c + tk.index
        v_11 = tl.cast(mul, tl.int32)
        v_12 = indices_3 + v_11
        # src[ssd_helion.py:81]: d = torch.where((pos < seqlen)[:, None], d, 0.0)
        v_13 = tl.cast(seqlen, tl.int32)
        v_14 = v_12 < v_13
        subscript_1 = v_14[:, None]
        scalar_tensor = tl.full([], 0.0, tl.float32)
        d_2 = tl.where(subscript_1, v_10, scalar_tensor)
        # src[ssd_helion.py:82]: dA = d * A[th].to(torch.float32)[None, :]
        load_2 = tl.load(A + indices_0 * 1, None)
        subscript_2 = load_2[None, :]
        v_15 = d_2 * subscript_2
        # src[ssd_helion.py:83]: dA_cs = torch.cumsum(dA, dim=0)
        dA_cs = tl.associative_scan(v_15, 0, add_2)
        # src[ssd_helion.py:84]: dt_out[tb.begin, th, tc.begin, tk] = d.permute(1, 0)
        permute = tl.permute(d_2, [1, 0])
        tl.store(dt_out + (offset_1 * 524288 + indices_0[:, None] * 8192 + offset_2 * 128 + indices_3[None, :] * 1), permute, None)
        # src[ssd_helion.py:85]: dA_cumsum[tb.begin, th, tc.begin, tk] = dA_cs.permute(1, 0)
        permute_1 = tl.permute(dA_cs, [1, 0])
        tl.store(dA_cumsum + (offset_1 * 524288 + indices_0[:, None] * 8192 + offset_2 * 128 + indices_3[None, :] * 1), permute_1, None)

def _chunk_cumsum_kernel(dt: torch.Tensor, A: torch.Tensor, dt_bias: torch.Tensor | None, chunk_size: int, seqlen: int, dt_min: float, dt_max: float, dt_softplus: bool, *, _launcher=_default_launcher):
    # src[ssd_helion.py:66]: b, L, h = dt.shape
    b, L, h = dt.shape
    # src[ssd_helion.py:67]: c = hl.specialize(chunk_size)
    c = 128
    # src[ssd_helion.py:68]: nc = L // c
    nc = L // c
    # src[ssd_helion.py:69]: dA_cumsum = torch.empty([b, h, nc, c], dtype=torch.float32, device=dt.device)
    dA_cumsum = torch.empty([b, h, nc, c], dtype=torch.float32, device=dt.device)
    # src[ssd_helion.py:70]: dt_out = torch.empty([b, h, nc, c], dtype=torch.float32, device=dt.device)
    dt_out = torch.empty([b, h, nc, c], dtype=torch.float32, device=dt.device)
    # src[ssd_helion.py:72]: for tb, tc, th in hl.tile([b, nc, h], block_size=[1, 1, block_h]):
    # src[ssd_helion.py:73]:     for tk in hl.tile(c, block_size=c):
    # src[ssd_helion.py:74]:         d = dt[tb.begin, tc.begin * c + tk.index, th].to(torch.float32)  # (c, BH)
    # src[ssd_helion.py:72-85]: ...
    _launcher(_helion__chunk_cumsum_kernel, (1024,), dt, dt_bias, A, dt_out, dA_cumsum, dt_softplus, dt_min, dt_max, seqlen, num_warps=4, num_stages=1)
    # src[ssd_helion.py:86]: return dA_cumsum, dt_out
    return (dA_cumsum, dt_out)