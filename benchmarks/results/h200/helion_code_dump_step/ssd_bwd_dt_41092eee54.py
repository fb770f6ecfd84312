# config {'block_sizes': [], 'num_warps': 4, 'num_stages': 1, 'l2_groupings': [1], 'loop_orders': [[0, 1, 2]], 'range_unroll_factors': [0], 'range_num_stages': [0], 'range_multi_buffers': [None], 'range_flattens': [None], 'host_tensor_descriptors': False, 'load_eviction_policies': ['', '', '', '', '', '', '', '', ''], 'indexing': ['pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer'], 'atomic_indexing': [], 'pid_type': 'persistent_blocked', 'num_sm_multiplier': 1, 'maxnreg': None, 'range_warp_specializes': []}
# args ((torch.float32, torch.Size([2, 64, 64, 128]), (524288, 8192, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 64, 128]), (524288, 8192, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 64, 128]), (524288, 8192, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 64]), (4096, 64, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 64, 128]), (524288, 8192, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 64, 128]), (524288, 8192, 128, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 64, 128, 64]), (84410368, 1318912, 10304, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([64]), (1,), device(type='cuda', index=0)), (torch.float32, torch.Size([64]), (1,), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 64, 128, 64]), (84410368, 1318912, 10304, 1), device(type='cuda', index=0)), (<class 'int'>, 8192), (<class 'float'>, 0.0), (<class 'float'>, inf), (<class 'bool'>, True))
from __future__ import annotations

import torch
import helion
import triton
import triton.language as tl
from torch._inductor.runtime.triton_compat import libdevice
from helion.runtime import default_launcher as _default_launcher

@triton.jit
def add_0(param_0, param_1):
    # src[ssd_helion_bwd.py:267]: ddA = torch.sum(g, dim=0) - hl.cumsum(g, dim=0) + g
    v_0 = param_0 + param_1
    # src[ssd_helion_bwd.py:243]: def ssd_bwd_dt(
    # src[ssd_helion_bwd.py:244]:     ddacs_row: torch.Tensor,  # (b, h, nc, c) fp32
    # src[ssd_helion_bwd.py:245]:     ddacs_col: torch.Tensor,  # (b, h, nc, c)
    # src[ssd_helion_bwd.py:243-283]: ...
    return v_0

@triton.jit
def _helion_ssd_bwd_dt(ddacs_row, ddacs_col, ddacs_prev, ddA_chunk, dt_out, dA_part, ddt_in, A, dt_in, dt_bias, ddt_raw, ddtb_part, softplus, dt_min, dt_max, seqlen, _NUM_SM: tl.constexpr, _RDIM_SIZE_3: tl.constexpr):
    # src[ssd_helion_bwd.py:262]: for ib, ic, ih in hl.grid([b, nc, h]):
    # src[ssd_helion_bwd.py:263]:     last = (hl.arange(c) == c - 1).to(torch.float32)
    # src[ssd_helion_bwd.py:264]:     g = ddacs_row[ib, ih, ic, :] + ddacs_col[ib, ih, ic, :] + ddacs_prev[ib, ih, ic, :]
    # src[ssd_helion_bwd.py:262-282]: ...
    total_pids = 8192
    block_size = tl.cdiv(total_pids, _NUM_SM)
    start_pid = tl.program_id(0) * block_size
    end_pid = start_pid + block_size
    if end_pid > total_pids:
        end_pid = total_pids
    for virtual_pid in tl.range(start_pid, end_pid):
        # src[ssd_helion_bwd.py:262]: for ib, ic, ih in hl.grid([b, nc, h]):
        num_blocks_0 = 2
        num_blocks_1 = 64
        pid_0 = virtual_pid % num_blocks_0
        pid_1 = virtual_pid // num_blocks_0 % num_blocks_1
        pid_2 = virtual_pid // (num_blocks_0 * num_blocks_1)
        offset_0 = pid_0
        offset_1 = pid_1
        offset_2 = pid_2
        indices_3 = tl.arange(0, _RDIM_SIZE_3).to(tl.int32)
        # src[ssd_helion_bwd.py:263]: last = (hl.arange(c) == c - 1).to(torch.float32)
        iota = tl.arange(0, 128)
        v_0 = tl.full([], 127, tl.int32)
        v_1 = iota == v_0
        v_2 = tl.cast(v_1, tl.float32)
        # src[ssd_helion_bwd.py:264]: g = ddacs_row[ib, ih, ic, :] + ddacs_col[ib, ih, ic, :] + ddacs_prev[ib, ih, ic, :]
        load = tl.load(ddacs_row + (offset_0 * 524288 + offset_2 * 8192 + offset_1 * 128 + (0 + indices_3) * 1), None)
        load_1 = tl.load(ddacs_col + (offset_0 * 524288 + offset_2 * 8192 + offset_1 * 128 + (0 + indices_3) * 1), None)
        v_3 = load + load_1
        load_2 = tl.load(ddacs_prev + (offset_0 * 524288 + offset_2 * 8192 + offset_1 * 128 + (0 + indices_3) * 1), None)
        v_4 = v_3 + load_2
        # src[ssd_helion_bwd.py:265]: g = g + last * ddA_chunk[ib, ih, ic]
        load_3 = tl.load(ddA_chunk + (offset_0 * 4096 + offset_2 * 64 + offset_1 * 1), None)
        v_5 = v_2 * load_3
        v_6 = v_4 + v_5
        # src[ssd_helion_bwd.py:267]: ddA = torch.sum(g, dim=0) - hl.cumsum(g, dim=0) + g
        sum_1 = tl.cast(tl.sum(v_6.to(tl.float32), 0), tl.float32)
        _associative_scan = tl.associative_scan(v_6, 0, add_0)
        v_7 = sum_1 - _associative_scan
        v_8 = v_7 + v_6
        # src[ssd_helion_bwd.py:268]: d = dt_out[ib, ih, ic, :]
        load_4 = tl.load(dt_out + (offset_0 * 524288 + offset_2 * 8192 + offset_1 * 128 + (0 + indices_3) * 1), None)
        # src[ssd_helion_bwd.py:269]: dA_part[ib, ic, ih] = torch.sum(ddA * d, dim=0)
        v_9 = v_8 * load_4
        sum_2 = tl.cast(tl.sum(v_9.to(tl.float32), 0), tl.float32)
        tl.store(dA_part + (offset_0 * 4096 + offset_1 * 64 + offset_2 * 1), sum_2, None)
        # src[ssd_helion_bwd.py:270]: gdt = ddt_in[ib, ih, ic, :] + ddA * A[ih].to(torch.float32)
        load_5 = tl.load(ddt_in + (offset_0 * 524288 + offset_2 * 8192 + offset_1 * 128 + (0 + indices_3) * 1), None)
        load_6 = tl.load(A + offset_2 * 1, None)
        v_10 = v_8 * load_6
        v_11 = load_5 + v_10
        # src[ssd_helion_bwd.py:271]: pre = dt_in[ib, ic, :, ih].to(torch.float32)
        load_7 = tl.load(dt_in + (offset_0 * 84410368 + offset_1 * 1318912 + (0 + indices_3) * 10304 + offset_2 * 1), None)
        v_12 = tl.cast(load_7, tl.float32)
        # src[ssd_helion_bwd.py:273]: pre = pre + dt_bias[ih].to(torch.float32)
        load_8 = tl.load(dt_bias + offset_2 * 1, None)
        v_13 = v_12 + load_8
        # src[ssd_helion_bwd.py:274]: if softplus:
        # src[ssd_helion_bwd.py:275]:     sp = torch.where(pre <= 20.0, torch.log1p(torch.exp(pre)), pre)
        # src[ssd_helion_bwd.py:276]:     gdt = torch.where((sp < dt_min) | (sp > dt_max), 0.0, gdt)
        # src[ssd_helion_bwd.py:274-279]: ...
        if softplus:
            v_13_copy = v_13
            v_11_copy = v_11
            v_13_copy_0 = v_13_copy
            v_11_copy_0 = v_11_copy
            # src[ssd_helion_bwd.py:275]: sp = torch.where(pre <= 20.0, torch.log1p(torch.exp(pre)), pre)
            v_14 = tl.full([], 20.0, tl.float32)
            v_15 = v_13_copy_0 <= v_14
            v_16 = libdevice.exp(v_13_copy_0)
            v_17 = libdevice.log1p(v_16)
            sp = tl.where(v_15, v_17, v_13_copy_0)
            # src[ssd_helion_bwd.py:276]: gdt = torch.where((sp < dt_min) | (sp > dt_max), 0.0, gdt)
            v_18 = sp < dt_min
            v_19 = sp > dt_max
            v_20 = v_18 | v_19
            scalar_tensor = tl.full([], 0.0, tl.float32)
            gdt = tl.where(v_20, scalar_tensor, v_11_copy_0)
            # src[ssd_helion_bwd.py:277]: gdt = torch.where(pre <= 20.0, gdt * torch.sigmoid(pre), gdt)
            v_21 = tl.full([], 20.0, tl.float32)
            v_22 = v_13_copy_0 <= v_21
            v_23 = tl.cast(v_13_copy_0, tl.float32)
            v_24 = tl.sigmoid(v_23)
            v_25 = gdt * v_24
            gdt_1 = tl.where(v_22, v_25, gdt)
        else:
            # src[ssd_helion_bwd.py:274]: if softplus:
            # src[ssd_helion_bwd.py:275]:     sp = torch.where(pre <= 20.0, torch.log1p(torch.exp(pre)), pre)
            # src[ssd_helion_bwd.py:276]:     gdt = torch.where((sp < dt_min) | (sp > dt_max), 0.0, gdt)
            # src[ssd_helion_bwd.py:274-279]: ...
            v_13_copy_1 = v_13
            v_11_copy_1 = v_11
            v_13_copy_1_0 = v_13_copy_1
            v_11_copy_1_0 = v_11_copy_1
            # src[ssd_helion_bwd.py:279]: gdt = torch.where((pre < dt_min) | (pre > dt_max), 0.0, gdt)
            v_26 = v_13_copy_1_0 < dt_min
            v_27 = v_13_copy_1_0 > dt_max
            v_28 = v_26 | v_27
            scalar_tensor_1 = tl.full([], 0.0, tl.float32)
            gdt_1 = tl.where(v_28, scalar_tensor_1, v_11_copy_1_0)
        # src[ssd_helion_bwd.py:280]: gdt = torch.where(ic * c + hl.arange(c) < seqlen, gdt, 0.0)  # padded tail tokens
        mul_3 = 128 * offset_1
        iota_1 = tl.arange(0, 128)
        v_29 = tl.cast(mul_3, tl.int32)
        v_30 = iota_1 + v_29
        v_31 = tl.cast(seqlen, tl.int32)
        v_32 = v_30 < v_31
        scalar_tensor_2 = tl.full([], 0.0, tl.float32)
        gdt_3 = tl.where(v_32, gdt_1, scalar_tensor_2)
        # src[ssd_helion_bwd.py:281]: ddt_raw[ib, ic, :, ih] = gdt.to(ddt_raw.dtype)
        v_33 = tl.cast(gdt_3, tl.bfloat16)
        tl.store(ddt_raw + (offset_0 * 84410368 + offset_1 * 1318912 + (0 + indices_3) * 10304 + offset_2 * 1), v_33, None)
        # src[ssd_helion_bwd.py:282]: ddtb_part[ib, ic, ih] = torch.sum(gdt, dim=0)
        sum_3 = tl.cast(tl.sum(gdt_3.to(tl.float32), 0), tl.float32)
        tl.store(ddtb_part + (offset_0 * 4096 + offset_1 * 64 + offset_2 * 1), sum_3, None)

def ssd_bwd_dt(ddacs_row: torch.Tensor, ddacs_col: torch.Tensor, ddacs_prev: torch.Tensor, ddA_chunk: torch.Tensor, ddt_in: torch.Tensor, dt_out: torch.Tensor, dt_in: torch.Tensor, dt_bias: torch.Tensor | None, A: torch.Tensor, ddt_raw: torch.Tensor, seqlen: int, dt_min: float, dt_max: float, softplus: bool, *, _launcher=_default_launcher):
    # src[ssd_helion_bwd.py:259]: b, h, nc, c = ddacs_row.shape
    b, h, nc, c = ddacs_row.shape
    # src[ssd_helion_bwd.py:260]: dA_part = torch.empty([b, nc, h], dtype=torch.float32, device=ddacs_row.device)
    dA_part = torch.empty([b, nc, h], dtype=torch.float32, device=ddacs_row.device)
    # src[ssd_helion_bwd.py:261]: ddtb_part = torch.empty([b, nc, h], dtype=torch.float32, device=ddacs_row.device)
    ddtb_part = torch.empty([b, nc, h], dtype=torch.float32, device=ddacs_row.device)
    # src[ssd_helion_bwd.py:262]: for ib, ic, ih in hl.grid([b, nc, h]):
    _NUM_SM = helion.runtime.get_num_sm(ddacs_row.device)
    _RDIM_SIZE_3 = 128
    # src[ssd_helion_bwd.py:262]: for ib, ic, ih in hl.grid([b, nc, h]):
    # src[ssd_helion_bwd.py:263]:     last = (hl.arange(c) == c - 1).to(torch.float32)
    # src[ssd_helion_bwd.py:264]:     g = ddacs_row[ib, ih, ic, :] + ddacs_col[ib, ih, ic, :] + ddacs_prev[ib, ih, ic, :]
    # src[ssd_helion_bwd.py:262-282]: ...
    _launcher(_helion_ssd_bwd_dt, (_NUM_SM,), ddacs_row, ddacs_col, ddacs_prev, ddA_chunk, dt_out, dA_part, ddt_in, A, dt_in, dt_bias, ddt_raw, ddtb_part, softplus, dt_min, dt_max, seqlen, _NUM_SM, _RDIM_SIZE_3, num_warps=4, num_stages=1)
    # src[ssd_helion_bwd.py:283]: return dA_part, ddtb_part
    return (dA_part, ddtb_part)