# config {'block_sizes': [64], 'loop_orders': [[0, 1, 2]], 'l2_groupings': [1], 'range_unroll_factors': [0, 0, 0, 0], 'range_num_stages': [0, 0, 0, 0], 'range_multi_buffers': [None, None, None, None], 'range_flattens': [None, None, None, None], 'static_ranges': [False, False], 'load_eviction_policies': ['', '', '', '', '', '', '', '', '', '', '', '', '', '', '', '', ''], 'num_warps': 8, 'num_stages': 3, 'indexing': ['pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer'], 'pid_type': 'flat', 'host_tensor_descriptors': False, 'atomic_indexing': [], 'range_warp_specializes': []}
# args ((torch.bfloat16, torch.Size([2, 64, 128, 64, 64]), (50331648, 786432, 6144, 64, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 64, 128, 64, 64]), (4096, 1048576, 8192, 64, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 64, 128, 8, 128]), (50331648, 786432, 6144, 128, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 64, 128, 8, 128]), (50331648, 786432, 6144, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 64, 128]), (524288, 8192, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 64, 128]), (524288, 8192, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 64, 64, 128]), (33554432, 524288, 8192, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 64, 64, 128]), (33554432, 524288, 8192, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 128, 128]), (1048576, 16384, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 128]), (8192, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 128]), (8192, 128, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 64, 128, 8, 128]), (50331648, 786432, 6144, 128, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 64, 128, 8, 128]), (50331648, 786432, 6144, 128, 1), device(type='cuda', index=0)))
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._inductor.runtime import triton_helpers
from torch._inductor.runtime.triton_compat import libdevice
from helion.runtime import default_launcher as _default_launcher

_BLOCK_SIZE_0 = tl.constexpr(64)

@triton.jit
def _helion_ssd_bwd_dbc(dA_cumsum, dt, last_keep, x, dL, dout_x, states_in, prev_keep, C, ddacs_prev, same_seq, B, dC, dB, _RDIM_SIZE_4: tl.constexpr, _RDIM_SIZE_6: tl.constexpr):
    # src[ssd_helion_bwd.py:204]: for ib, ic, ig in hl.grid([b, nc, g]):
    num_blocks_0 = 2
    num_blocks_1 = 64
    pid_0 = tl.program_id(0) % num_blocks_0
    pid_1 = tl.program_id(0) // num_blocks_0 % num_blocks_1
    pid_2 = tl.program_id(0) // (num_blocks_0 * num_blocks_1)
    offset_1 = pid_0
    offset_2 = pid_1
    offset_3 = pid_2
    indices_4 = tl.arange(0, _RDIM_SIZE_4).to(tl.int32)
    indices_6 = tl.arange(0, _RDIM_SIZE_6).to(tl.int32)
    # src[ssd_helion_bwd.py:207]: db = hl.zeros([c, n], dtype=torch.float32)
    db = tl.full([_RDIM_SIZE_4, _RDIM_SIZE_4], 0.0, tl.float32)
    # src[ssd_helion_bwd.py:208]: for hh in hl.grid(hpg):
    # src[ssd_helion_bwd.py:209]:     ih = ig * hpg + hh
    # src[ssd_helion_bwd.py:210]:     acs = dA_cumsum[ib, ih, ic, :]
    # src[ssd_helion_bwd.py:208-214]: ...
    for offset_5 in tl.range(0, 8):
        db_copy = db
        db_copy_0 = db_copy
        # src[ssd_helion_bwd.py:209]: ih = ig * hpg + hh
        mul = 8 * offset_3
        add = offset_5 + 8 * offset_3
        # src[ssd_helion_bwd.py:210]: acs = dA_cumsum[ib, ih, ic, :]
        acs = tl.load(dA_cumsum + (offset_1 * 524288 + add * 8192 + offset_2 * 128 + (0 + indices_4) * 1), None)
        # src[ssd_helion_bwd.py:211]: sc = torch.exp(torch.clamp(dA_cumsum[ib, ih, ic, c - 1] - acs, max=0.0)) * dt[ib, ih, ic, :]
        load_1 = tl.load(dA_cumsum + (offset_1 * 524288 + add * 8192 + offset_2 * 128 + 127 * 1), None)
        v_0 = load_1 - acs
        v_1 = tl.full([], 0.0, tl.float32)
        v_2 = triton_helpers.minimum(v_0, v_1)
        v_3 = libdevice.exp(v_2)
        load_2 = tl.load(dt + (offset_1 * 524288 + add * 8192 + offset_2 * 128 + (0 + indices_4) * 1), None)
        v_4 = v_3 * load_2
        # src[ssd_helion_bwd.py:212]: sc = sc * last_keep[ib, ic, :]
        load_3 = tl.load(last_keep + (offset_1 * 8192 + offset_2 * 128 + (0 + indices_4) * 1), None)
        v_5 = v_4 * load_3
        # src[ssd_helion_bwd.py:213]: xsc = (x[ib, ic, :, ih, :].to(torch.float32) * sc[:, None]).to(x.dtype)
        load_4 = tl.load(x + (offset_1 * 50331648 + offset_2 * 786432 + (0 + indices_4)[:, None] * 6144 + add * 64 + (0 + indices_6)[None, :] * 1), None)
        v_6 = tl.cast(load_4, tl.float32)
        subscript = v_5[:, None]
        v_7 = v_6 * subscript
        v_8 = tl.cast(v_7, tl.bfloat16)
        # src[ssd_helion_bwd.py:214]: db = hl.dot(xsc, dL[ib, ic, ih, :, :].to(x.dtype), acc=db)
        load_5 = tl.load(dL + (offset_1 * 33554432 + offset_2 * 524288 + add * 8192 + (0 + indices_6)[:, None] * 128 + (0 + indices_4)[None, :] * 1), None)
        v_9 = tl.cast(load_5, tl.bfloat16)
        db = tl.dot(tl.cast(v_8, tl.bfloat16), tl.cast(v_9, tl.bfloat16), acc=db_copy_0, input_precision='tf32', out_dtype=tl.float32)
    # src[ssd_helion_bwd.py:215]: for tt in hl.tile(c, block_size=bk):
    # src[ssd_helion_bwd.py:216]:     dc = hl.zeros([tt, n], dtype=torch.float32)
    # src[ssd_helion_bwd.py:217]:     dcb = hl.zeros([tt, c], dtype=torch.float32)
    # src[ssd_helion_bwd.py:215-237]: ...
    tl.debug_barrier()
    for offset_0 in tl.range(0, 128, _BLOCK_SIZE_0):
        indices_0 = offset_0 + tl.arange(0, _BLOCK_SIZE_0).to(tl.int32)
        db_copy_1 = db
        db_copy_1_0 = db_copy_1
        # src[ssd_helion_bwd.py:216]: dc = hl.zeros([tt, n], dtype=torch.float32)
        dc = tl.full([_BLOCK_SIZE_0, _RDIM_SIZE_4], 0.0, tl.float32)
        # src[ssd_helion_bwd.py:217]: dcb = hl.zeros([tt, c], dtype=torch.float32)
        dcb = tl.full([_BLOCK_SIZE_0, _RDIM_SIZE_4], 0.0, tl.float32)
        # src[ssd_helion_bwd.py:218]: for hh in hl.grid(hpg):
        # src[ssd_helion_bwd.py:219]:     ih = ig * hpg + hh
        # src[ssd_helion_bwd.py:220]:     dot_ = dout_x[ib, ic, tt, ih, :]
        # src[ssd_helion_bwd.py:218-232]: ...
        for offset_7 in tl.range(0, 8):
            dc_copy = dc
            dcb_copy = dcb
            dc_copy_0 = dc_copy
            dcb_copy_0 = dcb_copy
            # src[ssd_helion_bwd.py:219]: ih = ig * hpg + hh
            mul_1 = 8 * offset_3
            add_1 = offset_7 + 8 * offset_3
            # src[ssd_helion_bwd.py:220]: dot_ = dout_x[ib, ic, tt, ih, :]
            dot_ = tl.load(dout_x + (offset_1 * 4096 + offset_2 * 1048576 + indices_0[:, None] * 8192 + add_1 * 64 + (0 + indices_6)[None, :] * 1), None)
            # src[ssd_helion_bwd.py:221]: act = dA_cumsum[ib, ih, ic, tt]
            act = tl.load(dA_cumsum + (offset_1 * 524288 + add_1 * 8192 + offset_2 * 128 + indices_0 * 1), None)
            # src[ssd_helion_bwd.py:222]: acs = dA_cumsum[ib, ih, ic, :]
            acs_1 = tl.load(dA_cumsum + (offset_1 * 524288 + add_1 * 8192 + offset_2 * 128 + (0 + indices_4) * 1), None)
            # src[ssd_helion_bwd.py:224]: ds = hl.dot(dot_, states_in[ib, ic, ih, :, :].to(x.dtype))  # (bk, n)
            load_6 = tl.load(states_in + (offset_1 * 33554432 + offset_2 * 524288 + add_1 * 8192 + (0 + indices_6)[:, None] * 128 + (0 + indices_4)[None, :] * 1), None)
            v_10 = tl.cast(load_6, tl.bfloat16)
            ds = tl.dot(tl.cast(dot_, tl.bfloat16), tl.cast(v_10, tl.bfloat16), input_precision='tf32', out_dtype=tl.float32)
            # src[ssd_helion_bwd.py:225]: pscale = torch.exp(act) * prev_keep[ib, ic, tt]
            v_11 = libdevice.exp(act)
            load_7 = tl.load(prev_keep + (offset_1 * 8192 + offset_2 * 128 + indices_0 * 1), None)
            v_12 = v_11 * load_7
            # src[ssd_helion_bwd.py:226]: dc = dc + ds * pscale[:, None]
            subscript_1 = v_12[:, None]
            v_13 = ds * subscript_1
            dc = dc_copy_0 + v_13
            # src[ssd_helion_bwd.py:227]: ddacs_prev[ib, ih, ic, tt] = torch.sum(ds * C[ib, ic, tt, ig, :].to(torch.float32), dim=1) * pscale
            load_8 = tl.load(C + (offset_1 * 50331648 + offset_2 * 786432 + indices_0[:, None] * 6144 + offset_3 * 128 + (0 + indices_4)[None, :] * 1), None)
            v_15 = tl.cast(load_8, tl.float32)
            v_16 = ds * v_15
            sum_1 = tl.cast(tl.sum(v_16.to(tl.float32), 1), tl.float32)
            v_17 = sum_1 * v_12
            tl.store(ddacs_prev + (offset_1 * 524288 + add_1 * 8192 + offset_2 * 128 + indices_0 * 1), v_17, None)
            # src[ssd_helion_bwd.py:229]: gts = hl.dot(dot_, x[ib, ic, :, ih, :].T)  # (bk, c)
            load_9 = tl.load(x + (offset_1 * 50331648 + offset_2 * 786432 + (0 + indices_4)[:, None] * 6144 + add_1 * 64 + (0 + indices_6)[None, :] * 1), None)
            permute = tl.permute(load_9, [1, 0])
            gts = tl.dot(tl.cast(dot_, tl.bfloat16), tl.cast(permute, tl.bfloat16), input_precision='tf32', out_dtype=tl.float32)
            # src[ssd_helion_bwd.py:230]: causal = tt.index[:, None] >= hl.arange(c)[None, :]
            subscript_2 = indices_0[:, None]
            iota = tl.arange(0, 128)
            subscript_3 = iota[None, :]
            v_18 = subscript_2 >= subscript_3
            # src[ssd_helion_bwd.py:231]: seg = torch.where(causal, act[:, None] - acs[None, :], float("-inf"))
            subscript_4 = act[:, None]
            subscript_5 = acs_1[None, :]
            v_19 = subscript_4 - subscript_5
            scalar_tensor = tl.full([], float('-inf'), tl.float32)
            seg = tl.where(v_18, v_19, scalar_tensor)
            # src[ssd_helion_bwd.py:232]: dcb = dcb + gts * torch.exp(seg) * dt[ib, ih, ic, :][None, :]
            v_20 = libdevice.exp(seg)
            v_21 = gts * v_20
            load_10 = tl.load(dt + (offset_1 * 524288 + add_1 * 8192 + offset_2 * 128 + (0 + indices_4) * 1), None)
            subscript_6 = load_10[None, :]
            v_22 = v_21 * subscript_6
            dcb = dcb_copy_0 + v_22
        # src[ssd_helion_bwd.py:233]: dcb = dcb * same_seq[ib, ic, tt, :]
        load = tl.load(same_seq + (offset_1 * 1048576 + offset_2 * 16384 + indices_0[:, None] * 128 + (0 + indices_4)[None, :] * 1), None)
        v_24 = dcb * load
        # src[ssd_helion_bwd.py:234]: dcb_c = dcb.to(x.dtype)
        v_25 = tl.cast(v_24, tl.bfloat16)
        # src[ssd_helion_bwd.py:235]: dc = hl.dot(dcb_c, B[ib, ic, :, ig, :], acc=dc)
        load_11 = tl.load(B + (offset_1 * 50331648 + offset_2 * 786432 + (0 + indices_4)[:, None] * 6144 + offset_3 * 128 + (0 + indices_4)[None, :] * 1), None)
        dc_1 = tl.dot(tl.cast(v_25, tl.bfloat16), tl.cast(load_11, tl.bfloat16), acc=dc, input_precision='tf32', out_dtype=tl.float32)
        # src[ssd_helion_bwd.py:236]: dC[ib, ic, tt, ig, :] = dc.to(dC.dtype)
        v_26 = tl.cast(dc_1, tl.bfloat16)
        tl.store(dC + (offset_1 * 50331648 + offset_2 * 786432 + indices_0[:, None] * 6144 + offset_3 * 128 + (0 + indices_4)[None, :] * 1), v_26, None)
        # src[ssd_helion_bwd.py:237]: db = hl.dot(dcb_c.T, C[ib, ic, tt, ig, :], acc=db)
        permute_1 = tl.permute(v_25, [1, 0])
        load_12 = tl.load(C + (offset_1 * 50331648 + offset_2 * 786432 + indices_0[:, None] * 6144 + offset_3 * 128 + (0 + indices_4)[None, :] * 1), None)
        db = tl.dot(tl.cast(permute_1, tl.bfloat16), tl.cast(load_12, tl.bfloat16), acc=db_copy_1_0, input_precision='tf32', out_dtype=tl.float32)
    # src[ssd_helion_bwd.py:238]: dB[ib, ic, :, ig, :] = db.to(dB.dtype)
    v_27 = tl.cast(db, tl.bfloat16)
    tl.store(dB + (offset_1 * 50331648 + offset_2 * 786432 + (0 + indices_4)[:, None] * 6144 + offset_3 * 128 + (0 + indices_4)[None, :] * 1), v_27, None)

def ssd_bwd_dbc(x: torch.Tensor, dout_x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, dA_cumsum: torch.Tensor, states_in: torch.Tensor, dL: torch.Tensor, same_seq: torch.Tensor, prev_keep: torch.Tensor, last_keep: torch.Tensor, dB: torch.Tensor, dC: torch.Tensor, *, _launcher=_default_launcher):
    # src[ssd_helion_bwd.py:198]: b, nc, c, h, p = x.shape
    b, nc, c, h, p = x.shape
    # src[ssd_helion_bwd.py:199]: g = B.shape[3]
    g = B.shape[3]
    # src[ssd_helion_bwd.py:200]: n = B.shape[4]
    n = B.shape[4]
    # src[ssd_helion_bwd.py:202]: ddacs_prev = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    ddacs_prev = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    # src[ssd_helion_bwd.py:204]: for ib, ic, ig in hl.grid([b, nc, g]):
    _RDIM_SIZE_4 = 128
    _RDIM_SIZE_6 = 64
    # src[ssd_helion_bwd.py:204]: for ib, ic, ig in hl.grid([b, nc, g]):
    # src[ssd_helion_bwd.py:205]:     Cs = C[ib, ic, :, ig, :]
    # src[ssd_helion_bwd.py:206]:     # dB from the local state: sum_h decay*dt * x_h @ dL_h
    # src[ssd_helion_bwd.py:204-238]: ...
    _launcher(_helion_ssd_bwd_dbc, (1024,), dA_cumsum, dt, last_keep, x, dL, dout_x, states_in, prev_keep, C, ddacs_prev, same_seq, B, dC, dB, _RDIM_SIZE_4, _RDIM_SIZE_6, num_warps=8, num_stages=3)
    # src[ssd_helion_bwd.py:239]: return ddacs_prev
    return ddacs_prev