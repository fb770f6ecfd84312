# config {'block_sizes': [], 'num_warps': 4, 'num_stages': 1, 'l2_groupings': [1], 'loop_orders': [[0, 1, 2]], 'range_unroll_factors': [0, 0], 'range_num_stages': [0, 0], 'range_multi_buffers': [None, None], 'range_flattens': [None, None], 'host_tensor_descriptors': False, 'load_eviction_policies': ['', '', '', '', '', '', ''], 'indexing': ['pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer'], 'atomic_indexing': [], 'pid_type': 'persistent_blocked', 'num_sm_multiplier': 1, 'maxnreg': None, 'range_warp_specializes': []}
# args ((torch.float32, torch.Size([2, 64, 64, 16, 512]), (33554432, 524288, 8192, 512, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 64, 16, 512]), (33554432, 524288, 8192, 512, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 64]), (524288, 8192, 128), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64]), (8192, 128), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 16, 512]), (524288, 8192, 512, 1), device(type='cuda', index=0)))
from __future__ import annotations

import torch
import helion
import triton
import triton.language as tl
from torch._inductor.runtime.triton_compat import libdevice
from helion.runtime import default_launcher as _default_launcher

@triton.jit
def _helion_ssd_bwd_state_passing(dfinal, dL, dA_last, keep, states_in, ddA_part, dstates, dinit, _NUM_SM: tl.constexpr, _RDIM_SIZE_3: tl.constexpr):
    # src[ssd_helion_bwd.py:113]: for ib, ih, isp in hl.grid([b, h, s]):
    # src[ssd_helion_bwd.py:114]:     gacc = dfinal[ib, ih, isp, :]
    # src[ssd_helion_bwd.py:115]:     for i in hl.grid(nc):
    # src[ssd_helion_bwd.py:113-121]: ...
    total_pids = 2048
    block_size = tl.cdiv(total_pids, _NUM_SM)
    start_pid = tl.program_id(0) * block_size
    end_pid = start_pid + block_size
    if end_pid > total_pids:
        end_pid = total_pids
    for virtual_pid in tl.range(start_pid, end_pid):
        # src[ssd_helion_bwd.py:113]: for ib, ih, isp in hl.grid([b, h, s]):
        num_blocks_0 = 2
        num_blocks_1 = 64
        pid_0 = virtual_pid % num_blocks_0
        pid_1 = virtual_pid // num_blocks_0 % num_blocks_1
        pid_2 = virtual_pid // (num_blocks_0 * num_blocks_1)
        offset_0 = pid_0
        offset_1 = pid_1
        offset_2 = pid_2
        indices_3 = tl.arange(0, _RDIM_SIZE_3).to(tl.int32)
        # src[ssd_helion_bwd.py:114]: gacc = dfinal[ib, ih, isp, :]
        gacc = tl.load(dfinal + (offset_0 * 524288 + offset_1 * 8192 + offset_2 * 512 + (0 + indices_3) * 1), None)
        # src[ssd_helion_bwd.py:115]: for i in hl.grid(nc):
        # src[ssd_helion_bwd.py:116]:     j = nc - 1 - i
        # src[ssd_helion_bwd.py:117]:     dL[ib, j, ih, isp, :] = gacc
        # src[ssd_helion_bwd.py:115-120]: ...
        for offset_4 in tl.range(0, 64):
            gacc_copy = gacc
            gacc_copy_0 = gacc_copy
            # src[ssd_helion_bwd.py:116]: j = nc - 1 - i
            sub = 63 + -1 * offset_4
            # src[ssd_helion_bwd.py:117]: dL[ib, j, ih, isp, :] = gacc
            tl.store(dL + (offset_0 * 33554432 + sub * 524288 + offset_1 * 8192 + offset_2 * 512 + (0 + indices_3) * 1), gacc_copy_0, None)
            # src[ssd_helion_bwd.py:118]: scale = torch.exp(dA_last[ib, ih, j]) * keep[ib, j]
            load = tl.load(dA_last + (offset_0 * 524288 + offset_1 * 8192 + sub * 128), None)
            v_0 = libdevice.exp(load)
            load_1 = tl.load(keep + (offset_0 * 8192 + sub * 128), None)
            v_1 = v_0 * load_1
            # src[ssd_helion_bwd.py:119]: ddA_part[ib, ih, j, isp] = torch.sum(gacc * states_in[ib, j, ih, isp, :], dim=0) * scale
            load_2 = tl.load(states_in + (offset_0 * 33554432 + sub * 524288 + offset_1 * 8192 + offset_2 * 512 + (0 + indices_3) * 1), None)
            v_2 = gacc_copy_0 * load_2
            sum_1 = tl.cast(tl.sum(v_2.to(tl.float32), 0), tl.float32)
            v_3 = sum_1 * v_1
            tl.store(ddA_part + (offset_0 * 65536 + offset_1 * 1024 + sub * 16 + offset_2 * 1), v_3, None)
            # src[ssd_helion_bwd.py:120]: gacc = dstates[ib, j, ih, isp, :] + scale * gacc
            load_3 = tl.load(dstates + (offset_0 * 33554432 + sub * 524288 + offset_1 * 8192 + offset_2 * 512 + (0 + indices_3) * 1), None)
            v_4 = v_1 * gacc_copy_0
            gacc = load_3 + v_4
        # src[ssd_helion_bwd.py:121]: dinit[ib, ih, isp, :] = gacc
        tl.store(dinit + (offset_0 * 524288 + offset_1 * 8192 + offset_2 * 512 + (0 + indices_3) * 1), gacc, None)

def ssd_bwd_state_passing(dstates: torch.Tensor, states_in: torch.Tensor, dA_last: torch.Tensor, keep: torch.Tensor, dfinal: torch.Tensor, *, _launcher=_default_launcher):
    # src[ssd_helion_bwd.py:109]: b, nc, h, s, blk = dstates.shape
    b, nc, h, s, blk = dstates.shape
    # src[ssd_helion_bwd.py:110]: dL = torch.empty_like(dstates)
    dL = torch.empty_like(dstates)
    # src[ssd_helion_bwd.py:111]: ddA_part = torch.empty([b, h, nc, s], dtype=torch.float32, device=dstates.device)
    ddA_part = torch.empty([b, h, nc, s], dtype=torch.float32, device=dstates.device)
    # src[ssd_helion_bwd.py:112]: dinit = torch.empty_like(dfinal)
    dinit = torch.empty_like(dfinal)
    # src[ssd_helion_bwd.py:113]: for ib, ih, isp in hl.grid([b, h, s]):
    _NUM_SM = helion.runtime.get_num_sm(dstates.device)
    _RDIM_SIZE_3 = 512
    # src[ssd_helion_bwd.py:113]: for ib, ih, isp in hl.grid([b, h, s]):
    # src[ssd_helion_bwd.py:114]:     gacc = dfinal[ib, ih, isp, :]
    # src[ssd_helion_bwd.py:115]:     for i in hl.grid(nc):
    # src[ssd_helion_bwd.py:113-121]: ...
    _launcher(_helion_ssd_bwd_state_passing, (_NUM_SM,), dfinal, dL, dA_last, keep, states_in, ddA_part, dstates, dinit, _NUM_SM, _RDIM_SIZE_3, num_warps=4, num_stages=1)
    # src[ssd_helion_bwd.py:122]: return dL, ddA_part, dinit
    return (dL, ddA_part, dinit)