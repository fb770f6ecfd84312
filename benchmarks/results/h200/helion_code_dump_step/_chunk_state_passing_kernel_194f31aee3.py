# config {'block_sizes': [64, 64, 128], 'loop_orders': [[0, 1, 2, 3]], 'l2_groupings': [1], 'range_unroll_factors': [0, 0, 0], 'range_num_stages': [0, 0, 0], 'range_multi_buffers': [None, None, None], 'range_flattens': [None, None, None], 'load_eviction_policies': ['', '', '', '', ''], 'num_warps': 8, 'num_stages': 3, 'indexing': ['pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer'], 'pid_type': 'flat', 'host_tensor_descriptors': False, 'atomic_indexing': [], 'range_warp_specializes': []}
# args ((torch.bfloat16, torch.Size([2, 8192, 8, 128]), (50331648, 6144, 128, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 8192, 64, 64]), (50331648, 6144, 64, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 64, 128]), (524288, 8192, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 64, 128]), (524288, 8192, 128, 1), device(type='cuda', index=0)), (<class 'NoneType'>, None), (<class 'NoneType'>, None), (<class 'NoneType'>, None), (torch.float32, torch.Size([0]), (1,), device(type='cuda', index=0)))
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._inductor.runtime import triton_helpers
from torch._inductor.runtime.triton_compat import libdevice
from helion.runtime import default_launcher as _default_launcher
import kernels.ssd_helion as _source_module

_BLOCK_SIZE_0 = tl.constexpr(64)
_BLOCK_SIZE_1 = tl.constexpr(64)
_BLOCK_SIZE_2 = tl.constexpr(128)

@triton.jit
def _helion__chunk_state_passing_kernel(states_in, dA_cumsum, x, B, dt, final_states, _source_module_attr__LOG2E):
    # src[ssd_helion.py:173]: for tb, th, tm, tn in hl.tile([b, h, p, n], block_size=[1, 1, block_m, block_n]):
    num_blocks_0 = 2
    num_blocks_1 = 64
    num_blocks_2 = tl.cdiv(64, _BLOCK_SIZE_0)
    pid_0 = tl.program_id(0) % num_blocks_0
    pid_1 = tl.program_id(0) // num_blocks_0 % num_blocks_1
    pid_2 = tl.program_id(0) // (num_blocks_0 * num_blocks_1) % num_blocks_2
    pid_3 = tl.program_id(0) // (num_blocks_0 * num_blocks_1 * num_blocks_2)
    offset_3 = pid_0
    offset_4 = pid_1
    offset_0 = pid_2 * _BLOCK_SIZE_0
    indices_0 = (offset_0 + tl.arange(0, _BLOCK_SIZE_0)).to(tl.int32)
    offset_1 = pid_3 * _BLOCK_SIZE_1
    indices_1 = (offset_1 + tl.arange(0, _BLOCK_SIZE_1)).to(tl.int32)
    # src[ssd_helion.py:177]: s = hl.zeros([tm, tn], dtype=torch.float32)
    s = tl.full([_BLOCK_SIZE_0, _BLOCK_SIZE_1], 0.0, tl.float32)
    # src[ssd_helion.py:178]: for tc in hl.tile(nc, block_size=1):
    # src[ssd_helion.py:179]:     states_in[tb.begin, tc.begin, th.begin, tm, tn] = s.to(states_in.dtype)
    # src[ssd_helion.py:180]:     dA_last = dA_cumsum[tb.begin, th.begin, tc.begin, c - 1]
    # src[ssd_helion.py:178-200]: ...
    for offset_5 in tl.range(0, 64):
        s_copy = s
        s_copy_0 = s_copy
        # src[ssd_helion.py:179]: states_in[tb.begin, tc.begin, th.begin, tm, tn] = s.to(states_in.dtype)
        tl.store(states_in + (offset_3 * 33554432 + offset_5 * 524288 + offset_4 * 8192 + indices_0[:, None] * 128 + indices_1[None, :] * 1), s_copy_0, None)
        # src[ssd_helion.py:180]: dA_last = dA_cumsum[tb.begin, th.begin, tc.begin, c - 1]
        dA_last = tl.load(dA_cumsum + (offset_3 * 524288 + offset_4 * 8192 + offset_5 * 128 + 127 * 1), None)
        # src[ssd_helion.py:181]: acc = hl.zeros([tm, tn], dtype=torch.float32)
        acc = tl.full([_BLOCK_SIZE_0, _BLOCK_SIZE_1], 0.0, tl.float32)
        # src[ssd_helion.py:184]: for tk in hl.tile(c, block_size=block_k):
        # src[ssd_helion.py:185]:     pos = tc.begin * c + tk.index
        # src[ssd_helion.py:186]:     x_t = x[tb.begin, pos, th.begin, tm]
        # src[ssd_helion.py:184-195]: ...
        for offset_2 in tl.range(0, 128, _BLOCK_SIZE_2):
            indices_2 = offset_2 + tl.arange(0, _BLOCK_SIZE_2).to(tl.int32)
            dA_last_copy = dA_last
            acc_copy = acc
            dA_last_copy_0 = dA_last_copy
            acc_copy_0 = acc_copy
            # src[ssd_helion.py:185]: pos = tc.begin * c + tk.index
            mul = 128 * offset_5
            v_0 = tl.cast(mul, tl.int32)
            v_1 = indices_2 + v_0
            # src[ssd_helion.py:186]: x_t = x[tb.begin, pos, th.begin, tm]
            x_t = tl.load(x + (offset_3 * 50331648 + (indices_2 + mul)[:, None] * 6144 + offset_4 * 64 + indices_0[None, :] * 1), None)
            # src[ssd_helion.py:187]: b_t = B[tb.begin, pos, th.begin // ratio, tn].to(torch.float32)
            floordiv = triton_helpers.div_floor_integer(offset_4, 8)
            load_1 = tl.load(B + (offset_3 * 50331648 + (indices_2 + mul)[:, None] * 6144 + floordiv * 128 + indices_1[None, :] * 1), None)
            v_2 = tl.cast(load_1, tl.float32)
            # src[ssd_helion.py:188]: dA_k = dA_cumsum[tb.begin, th.begin, tc.begin, tk]
            dA_k = tl.load(dA_cumsum + (offset_3 * 524288 + offset_4 * 8192 + offset_5 * 128 + indices_2 * 1), None)
            # src[ssd_helion.py:189]: dt_k = dt[tb.begin, th.begin, tc.begin, tk]
            dt_k = tl.load(dt + (offset_3 * 524288 + offset_4 * 8192 + offset_5 * 128 + indices_2 * 1), None)
            # src[ssd_helion.py:190]: scale = torch.exp2(torch.clamp(dA_last - dA_k, max=0.0) * _LOG2E) * dt_k
            v_3 = dA_last_copy_0 - dA_k
            v_4 = tl.full([], 0.0, tl.float32)
            v_5 = triton_helpers.minimum(v_3, v_4)
            v_6 = v_5 * _source_module_attr__LOG2E
            v_7 = libdevice.exp2(v_6)
            v_8 = v_7 * dt_k
            # src[ssd_helion.py:194]: b_s = (b_t * scale[:, None]).to(x.dtype)
            subscript = v_8[:, None]
            v_9 = v_2 * subscript
            v_10 = tl.cast(v_9, tl.bfloat16)
            # src[ssd_helion.py:195]: acc = hl.dot(x_t.permute(1, 0), b_s, acc=acc)
            permute = tl.permute(x_t, [1, 0])
            acc = tl.dot(tl.cast(permute, tl.bfloat16), tl.cast(v_10, tl.bfloat16), acc=acc_copy_0, input_precision='tf32', out_dtype=tl.float32)
        # src[ssd_helion.py:196]: decay = torch.exp2(dA_last * _LOG2E)
        v_11 = dA_last * _source_module_attr__LOG2E
        v_12 = libdevice.exp2(v_11)
        # src[ssd_helion.py:200]: s = decay * s + acc
        v_13 = v_12 * s_copy_0
        s = v_13 + acc
    # src[ssd_helion.py:201]: final_states[tb.begin, th.begin, tm, tn] = s
    tl.store(final_states + (offset_3 * 524288 + offset_4 * 8192 + indices_0[:, None] * 128 + indices_1[None, :] * 1), s, None)

def _chunk_state_passing_kernel(B: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, dA_cumsum: torch.Tensor, initial_states: torch.Tensor | None, seq_idx: torch.Tensor | None, seq_end: torch.Tensor | None, state_dtype_like: torch.Tensor, *, _launcher=_default_launcher):
    # src[ssd_helion.py:163]: b, L, g, n = B.shape
    b, L, g, n = B.shape
    # src[ssd_helion.py:164]: _, _, h, p = x.shape
    _, _, h, p = x.shape
    # src[ssd_helion.py:165]: _, _, nc, c = dt.shape
    _, _, nc, c = dt.shape
    # src[ssd_helion.py:167]: states_in = torch.empty([b, nc, h, p, n], dtype=state_dtype_like.dtype, device=x.device)
    states_in = torch.empty([b, nc, h, p, n], dtype=state_dtype_like.dtype, device=x.device)
    # src[ssd_helion.py:168]: final_states = torch.empty([b, h, p, n], dtype=torch.float32, device=x.device)
    final_states = torch.empty([b, h, p, n], dtype=torch.float32, device=x.device)
    # src[ssd_helion.py:173]: for tb, th, tm, tn in hl.tile([b, h, p, n], block_size=[1, 1, block_m, block_n]):
    # src[ssd_helion.py:174]:     if initial_states is not None:
    # src[ssd_helion.py:175]:         s = initial_states[tb.begin, th.begin, tm, tn].to(torch.float32)
    # src[ssd_helion.py:173-201]: ...
    _launcher(_helion__chunk_state_passing_kernel, (256,), states_in, dA_cumsum, x, B, dt, final_states, _source_module._LOG2E, num_warps=8, num_stages=3)
    # src[ssd_helion.py:202]: return states_in, final_states
    return (states_in, final_states)