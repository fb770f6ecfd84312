# config {'block_sizes': [128, 128, 64], 'loop_orders': [[0, 1, 2, 3, 4]], 'l2_groupings': [1], 'range_unroll_factors': [0, 0], 'range_num_stages': [0, 0], 'range_multi_buffers': [None, None], 'range_flattens': [None, None], 'load_eviction_policies': ['', ''], 'num_warps': 4, 'num_stages': 3, 'indexing': ['pointer', 'pointer', 'pointer'], 'pid_type': 'flat', 'host_tensor_descriptors': False, 'atomic_indexing': [], 'range_warp_specializes': []}
# args ((torch.bfloat16, torch.Size([2, 8192, 8, 128]), (50331648, 6144, 128, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 8192, 8, 128]), (50331648, 6144, 128, 1), device(type='cuda', index=0)), (<class 'NoneType'>, None), (<class 'int'>, 128))
from __future__ import annotations

import torch
import triton
import triton.language as tl
from helion.runtime import default_launcher as _default_launcher

_BLOCK_SIZE_0 = tl.constexpr(128)
_BLOCK_SIZE_1 = tl.constexpr(128)
_BLOCK_SIZE_2 = tl.constexpr(64)

@triton.jit
def _helion__bmm_chunk_kernel(C, B, CB):
    # src[ssd_helion.py:218]: for tb, tc, tg, tm, tn in hl.tile([b, nc, g, c, c], block_size=[1, 1, 1, block_m, block_n]):
    num_blocks_0 = 2
    num_blocks_1 = 64
    num_blocks_2 = 8
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
    # src[ssd_helion.py:219]: acc = hl.zeros([tm, tn], dtype=torch.float32)
    acc = tl.full([_BLOCK_SIZE_0, _BLOCK_SIZE_1], 0.0, tl.float32)
    # src[ssd_helion.py:220]: for tk in hl.tile(n, block_size=block_k):
    # src[ssd_helion.py:221]:     c_t = C[tb.begin, tc.begin * c + tm.index, tg.begin, tk]
    # src[ssd_helion.py:222]:     b_t = B[tb.begin, tc.begin * c + tn.index, tg.begin, tk]
    # src[ssd_helion.py:220-223]: ...
    for offset_2 in tl.range(0, 128, _BLOCK_SIZE_2):
        indices_2 = offset_2 + tl.arange(0, _BLOCK_SIZE_2).to(tl.int32)
        acc_copy = acc
        acc_copy_0 = acc_copy
        # src[ssd_helion.py:221]: c_t = C[tb.begin, tc.begin * c + tm.index, tg.begin, tk]
        mul = 128 * offset_4
        v_0 = tl.cast(mul, tl.int32)
        v_1 = indices_0 + v_0
        c_t = tl.load(C + (offset_3 * 50331648 + (indices_0 + mul)[:, None] * 6144 + offset_5 * 128 + indices_2[None, :] * 1), None)
        # src[ssd_helion.py:222]: b_t = B[tb.begin, tc.begin * c + tn.index, tg.begin, tk]
        v_2 = tl.cast(mul, tl.int32)
        v_3 = indices_1 + v_2
        b_t = tl.load(B + (offset_3 * 50331648 + (indices_1 + mul)[:, None] * 6144 + offset_5 * 128 + indices_2[None, :] * 1), None)
        # src[ssd_helion.py:223]: acc = hl.dot(c_t, b_t.permute(1, 0), acc=acc)
        permute = tl.permute(b_t, [1, 0])
        acc = tl.dot(tl.cast(c_t, tl.bfloat16), tl.cast(permute, tl.bfloat16), acc=acc_copy_0, input_precision='tf32', out_dtype=tl.float32)
    # src[ssd_helion.py:228]: CB[tb.begin, tc.begin, tg.begin, tm, tn] = acc
    tl.store(CB + (offset_3 * 8388608 + offset_4 * 131072 + offset_5 * 16384 + indices_0[:, None] * 128 + indices_1[None, :] * 1), acc, None)

def _bmm_chunk_kernel(C: torch.Tensor, B: torch.Tensor, seq_idx: torch.Tensor | None, chunk_size: int, *, _launcher=_default_launcher):
    # src[ssd_helion.py:211]: b, L, g, n = C.shape
    b, L, g, n = C.shape
    # src[ssd_helion.py:212]: c = hl.specialize(chunk_size)
    c = 128
    # src[ssd_helion.py:213]: nc = L // c
    nc = L // c
    # src[ssd_helion.py:214]: CB = torch.empty([b, nc, g, c, c], dtype=torch.float32, device=C.device)
    CB = torch.empty([b, nc, g, c, c], dtype=torch.float32, device=C.device)
    # src[ssd_helion.py:218]: for tb, tc, tg, tm, tn in hl.tile([b, nc, g, c, c], block_size=[1, 1, 1, block_m, block_n]):
    # src[ssd_helion.py:219]:     acc = hl.zeros([tm, tn], dtype=torch.float32)
    # src[ssd_helion.py:220]:     for tk in hl.tile(n, block_size=block_k):
    # src[ssd_helion.py:218-228]: ...
    _launcher(_helion__bmm_chunk_kernel, (1024,), C, B, CB, num_warps=4, num_stages=3)
    # src[ssd_helion.py:229]: return CB
    return CB