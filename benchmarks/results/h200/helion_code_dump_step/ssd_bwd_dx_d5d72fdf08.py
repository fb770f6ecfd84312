# config {'block_sizes': [128], 'loop_orders': [[0, 1, 2]], 'l2_groupings': [1], 'range_unroll_factors': [0, 0], 'range_num_stages': [0, 0], 'range_multi_buffers': [None, None], 'range_flattens': [None, None], 'load_eviction_policies': ['', '', '', '', '', '', '', '', '', '', '', ''], 'num_warps': 8, 'num_stages': 1, 'indexing': ['pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer'], 'pid_type': 'flat', 'host_tensor_descriptors': False, 'atomic_indexing': [], 'range_warp_specializes': []}
# args ((torch.bfloat16, torch.Size([2, 64, 128, 64, 64]), (50331648, 786432, 6144, 64, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 64, 128, 64, 64]), (33554432, 524288, 4096, 64, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 64, 128, 8, 128]), (50331648, 786432, 6144, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 8, 128, 128]), (8388608, 131072, 16384, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 64, 128]), (524288, 8192, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 64, 128]), (524288, 8192, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 64, 64, 128]), (33554432, 524288, 8192, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([2, 64, 128]), (8192, 128, 1), device(type='cuda', index=0)), (torch.float32, torch.Size([64, 64]), (1, 0), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 64, 128, 64, 64]), (50331648, 786432, 6144, 64, 1), device(type='cuda', index=0)))
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._inductor.runtime import triton_helpers
from torch._inductor.runtime.triton_compat import libdevice
from helion.runtime import default_launcher as _default_launcher

_BLOCK_SIZE_0 = tl.constexpr(128)

@triton.jit
def _helion_ssd_bwd_dx(x, dt, dA_cumsum, last_keep, dL, B, dout_x, CB, ddacs_row, Dw, dx, ddt, ddacs_col, dD_part, _RDIM_SIZE_4: tl.constexpr, _RDIM_SIZE_5: tl.constexpr):
    # src[ssd_helion_bwd.py:146]: for ib, ic, ih in hl.grid([b, nc, h]):
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
    # src[ssd_helion_bwd.py:147]: ig = ih // hpg
    floordiv = triton_helpers.div_floor_integer(offset_3, 8)
    # src[ssd_helion_bwd.py:148]: xs = x[ib, ic, :, ih, :]
    xs = tl.load(x + (offset_1 * 50331648 + offset_2 * 786432 + (0 + indices_4)[:, None] * 6144 + offset_3 * 64 + (0 + indices_5)[None, :] * 1), None)
    # src[ssd_helion_bwd.py:149]: dts = dt[ib, ih, ic, :]
    dts = tl.load(dt + (offset_1 * 524288 + offset_3 * 8192 + offset_2 * 128 + (0 + indices_4) * 1), None)
    # src[ssd_helion_bwd.py:150]: acs = dA_cumsum[ib, ih, ic, :]
    acs = tl.load(dA_cumsum + (offset_1 * 524288 + offset_3 * 8192 + offset_2 * 128 + (0 + indices_4) * 1), None)
    # src[ssd_helion_bwd.py:151]: a_last = dA_cumsum[ib, ih, ic, c - 1]
    a_last = tl.load(dA_cumsum + (offset_1 * 524288 + offset_3 * 8192 + offset_2 * 128 + 127 * 1), None)
    # src[ssd_helion_bwd.py:152]: decay_s = torch.exp(torch.clamp(a_last - acs, max=0.0)) * last_keep[ib, ic, :]
    v_0 = a_last - acs
    v_1 = tl.full([], 0.0, tl.float32)
    v_2 = triton_helpers.minimum(v_0, v_1)
    v_3 = libdevice.exp(v_2)
    load_4 = tl.load(last_keep + (offset_1 * 8192 + offset_2 * 128 + (0 + indices_4) * 1), None)
    v_4 = v_3 * load_4
    # src[ssd_helion_bwd.py:153]: dls = dL[ib, ic, ih, :, :].to(x.dtype)
    load_5 = tl.load(dL + (offset_1 * 33554432 + offset_2 * 524288 + offset_3 * 8192 + (0 + indices_5)[:, None] * 128 + (0 + indices_4)[None, :] * 1), None)
    v_5 = tl.cast(load_5, tl.bfloat16)
    # src[ssd_helion_bwd.py:155]: a2 = hl.dot(B[ib, ic, :, ig, :], dls.T) * decay_s[:, None]  # (c, p)
    load_6 = tl.load(B + (offset_1 * 50331648 + offset_2 * 786432 + (0 + indices_4)[:, None] * 6144 + floordiv * 128 + (0 + indices_4)[None, :] * 1), None)
    permute = tl.permute(v_5, [1, 0])
    dot = tl.dot(tl.cast(load_6, tl.bfloat16), tl.cast(permute, tl.bfloat16), input_precision='tf32', out_dtype=tl.float32)
    subscript = v_4[:, None]
    v_6 = dot * subscript
    # src[ssd_helion_bwd.py:156]: a1 = hl.zeros([c, p], dtype=torch.float32)
    a1 = tl.full([_RDIM_SIZE_4, _RDIM_SIZE_5], 0.0, tl.float32)
    # src[ssd_helion_bwd.py:157]: col = hl.zeros([c], dtype=torch.float32)
    col = tl.full([_RDIM_SIZE_4], 0.0, tl.float32)
    # src[ssd_helion_bwd.py:158]: for tt in hl.tile(c, block_size=bk):
    # src[ssd_helion_bwd.py:159]:     dot_ = dout_x[ib, ic, tt, ih, :]  # (bk, p)
    # src[ssd_helion_bwd.py:160]:     act = dA_cumsum[ib, ih, ic, tt]
    # src[ssd_helion_bwd.py:158-168]: ...
    for offset_0 in tl.range(0, 128, _BLOCK_SIZE_0):
        indices_0 = offset_0 + tl.arange(0, _BLOCK_SIZE_0).to(tl.int32)
        acs_copy = acs
        a1_copy = a1
        xs_copy = xs
        dts_copy = dts
        col_copy = col
        acs_copy_0 = acs_copy
        a1_copy_0 = a1_copy
        xs_copy_0 = xs_copy
        dts_copy_0 = dts_copy
        col_copy_0 = col_copy
        # src[ssd_helion_bwd.py:159]: dot_ = dout_x[ib, ic, tt, ih, :]  # (bk, p)
        dot_ = tl.load(dout_x + (offset_1 * 33554432 + offset_2 * 524288 + indices_0[:, None] * 4096 + offset_3 * 64 + (0 + indices_5)[None, :] * 1), None)
        # src[ssd_helion_bwd.py:160]: act = dA_cumsum[ib, ih, ic, tt]
        act = tl.load(dA_cumsum + (offset_1 * 524288 + offset_3 * 8192 + offset_2 * 128 + indices_0 * 1), None)
        # src[ssd_helion_bwd.py:161]: seg = act[None, :] - acs[:, None]  # (c, bk): dAcs[t] - dAcs[s]
        subscript_1 = act[None, :]
        subscript_2 = acs_copy_0[:, None]
        v_7 = subscript_1 - subscript_2
        # src[ssd_helion_bwd.py:162]: causal = tt.index[None, :] >= hl.arange(c)[:, None]
        subscript_3 = indices_0[None, :]
        iota = tl.arange(0, 128)
        subscript_4 = iota[:, None]
        v_8 = subscript_3 >= subscript_4
        # src[ssd_helion_bwd.py:163]: mt = CB[ib, ic, ig, tt, :].T * torch.exp(torch.where(causal, seg, float("-inf")))  # (s, t)
        load_2 = tl.load(CB + (offset_1 * 8388608 + offset_2 * 131072 + floordiv * 16384 + indices_0[:, None] * 128 + (0 + indices_4)[None, :] * 1), None)
        permute_1 = tl.permute(load_2, [1, 0])
        scalar_tensor = tl.full([], float('-inf'), tl.float32)
        where = tl.where(v_8, v_7, scalar_tensor)
        v_9 = libdevice.exp(where)
        v_10 = permute_1 * v_9
        # src[ssd_helion_bwd.py:164]: a1 = hl.dot(mt.to(x.dtype), dot_, acc=a1)
        v_11 = tl.cast(v_10, tl.bfloat16)
        a1 = tl.dot(tl.cast(v_11, tl.bfloat16), tl.cast(dot_, tl.bfloat16), acc=a1_copy_0, input_precision='tf32', out_dtype=tl.float32)
        # src[ssd_helion_bwd.py:165]: gt = hl.dot(xs, dot_.T)  # (s, t): x[s] . dout_x[t]
        permute_2 = tl.permute(dot_, [1, 0])
        gt = tl.dot(tl.cast(xs_copy_0, tl.bfloat16), tl.cast(permute_2, tl.bfloat16), input_precision='tf32', out_dtype=tl.float32)
        # src[ssd_helion_bwd.py:166]: w = mt * dts[:, None] * gt
        subscript_5 = dts_copy_0[:, None]
        v_12 = v_10 * subscript_5
        v_13 = v_12 * gt
        # src[ssd_helion_bwd.py:167]: ddacs_row[ib, ih, ic, tt] = torch.sum(w, dim=0)
        sum_1 = tl.cast(tl.sum(v_13.to(tl.float32), 0), tl.float32)
        tl.store(ddacs_row + (offset_1 * 524288 + offset_3 * 8192 + offset_2 * 128 + indices_0 * 1), sum_1, None)
        # src[ssd_helion_bwd.py:168]: col = col + torch.sum(w, dim=1)
        sum_2 = tl.cast(tl.sum(v_13.to(tl.float32), 1), tl.float32)
        col = col_copy_0 + sum_2
    # src[ssd_helion_bwd.py:169]: a = a1 + a2
    v_15 = a1 + v_6
    # src[ssd_helion_bwd.py:170]: xf = xs.to(torch.float32)
    v_16 = tl.cast(xs, tl.float32)
    # src[ssd_helion_bwd.py:171]: dox_s = dout_x[ib, ic, :, ih, :].to(torch.float32)
    load_7 = tl.load(dout_x + (offset_1 * 33554432 + offset_2 * 524288 + (0 + indices_4)[:, None] * 4096 + offset_3 * 64 + (0 + indices_5)[None, :] * 1), None)
    v_17 = tl.cast(load_7, tl.float32)
    # src[ssd_helion_bwd.py:172]: dx[ib, ic, :, ih, :] = (a * dts[:, None] + dox_s * Dw[ih, :][None, :]).to(dx.dtype)
    subscript_6 = dts[:, None]
    v_18 = v_15 * subscript_6
    load_8 = tl.load(Dw + (offset_3 * 1 + (0 + indices_5) * 0), None)
    subscript_7 = load_8[None, :]
    v_19 = v_17 * subscript_7
    v_20 = v_18 + v_19
    v_21 = tl.cast(v_20, tl.bfloat16)
    tl.store(dx + (offset_1 * 50331648 + offset_2 * 786432 + (0 + indices_4)[:, None] * 6144 + offset_3 * 64 + (0 + indices_5)[None, :] * 1), v_21, None)
    # src[ssd_helion_bwd.py:173]: ddt_s = torch.sum(a * xf, dim=1)
    v_22 = v_15 * v_16
    ddt_s = tl.cast(tl.sum(v_22.to(tl.float32), 1), tl.float32)
    # src[ssd_helion_bwd.py:174]: ddt[ib, ih, ic, :] = ddt_s
    tl.store(ddt + (offset_1 * 524288 + offset_3 * 8192 + offset_2 * 128 + (0 + indices_4) * 1), ddt_s, None)
    # src[ssd_helion_bwd.py:175]: st = dts * torch.sum(a2 * xf, dim=1)  # d/d(-dAcs[s]) of the local state term
    v_23 = v_6 * v_16
    sum_3 = tl.cast(tl.sum(v_23.to(tl.float32), 1), tl.float32)
    v_24 = dts * sum_3
    # src[ssd_helion_bwd.py:176]: last = (hl.arange(c) == c - 1).to(torch.float32)
    iota_1 = tl.arange(0, 128)
    v_25 = tl.full([], 127, tl.int32)
    v_26 = iota_1 == v_25
    v_27 = tl.cast(v_26, tl.float32)
    # src[ssd_helion_bwd.py:177]: ddacs_col[ib, ih, ic, :] = -col - st + last * torch.sum(st, dim=0)
    v_28 = -col
    v_29 = v_28 - v_24
    sum_4 = tl.cast(tl.sum(v_24.to(tl.float32), 0), tl.float32)
    v_30 = v_27 * sum_4
    v_31 = v_29 + v_30
    tl.store(ddacs_col + (offset_1 * 524288 + offset_3 * 8192 + offset_2 * 128 + (0 + indices_4) * 1), v_31, None)
    # src[ssd_helion_bwd.py:178]: dD_part[ib, ic, ih, :] = torch.sum(dox_s * xf, dim=0)
    v_32 = v_17 * v_16
    sum_5 = tl.cast(tl.sum(v_32.to(tl.float32), 0), tl.float32)
    tl.store(dD_part + (offset_1 * 262144 + offset_2 * 4096 + offset_3 * 64 + (0 + indices_5) * 1), sum_5, None)

def ssd_bwd_dx(x: torch.Tensor, dout_x: torch.Tensor, B: torch.Tensor, CB: torch.Tensor, dt: torch.Tensor, dA_cumsum: torch.Tensor, dL: torch.Tensor, last_keep: torch.Tensor, Dw: torch.Tensor, dx: torch.Tensor, *, _launcher=_default_launcher):
    # src[ssd_helion_bwd.py:138]: b, nc, c, h, p = x.shape
    b, nc, c, h, p = x.shape
    # src[ssd_helion_bwd.py:139]: g = B.shape[3]
    g = B.shape[3]
    # src[ssd_helion_bwd.py:141]: ddt = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    ddt = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    # src[ssd_helion_bwd.py:142]: ddacs_row = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    ddacs_row = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    # src[ssd_helion_bwd.py:143]: ddacs_col = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    ddacs_col = torch.empty([b, h, nc, c], dtype=torch.float32, device=x.device)
    # src[ssd_helion_bwd.py:144]: dD_part = torch.empty([b, nc, h, p], dtype=torch.float32, device=x.device)
    dD_part = torch.empty([b, nc, h, p], dtype=torch.float32, device=x.device)
    # src[ssd_helion_bwd.py:146]: for ib, ic, ih in hl.grid([b, nc, h]):
    _RDIM_SIZE_4 = 128
    _RDIM_SIZE_5 = 64
    # src[ssd_helion_bwd.py:146]: for ib, ic, ih in hl.grid([b, nc, h]):
    # src[ssd_helion_bwd.py:147]:     ig = ih // hpg
    # src[ssd_helion_bwd.py:148]:     xs = x[ib, ic, :, ih, :]
    # src[ssd_helion_bwd.py:146-178]: ...
    _launcher(_helion_ssd_bwd_dx, (8192,), x, dt, dA_cumsum, last_keep, dL, B, dout_x, CB, ddacs_row, Dw, dx, ddt, ddacs_col, dD_part, _RDIM_SIZE_4, _RDIM_SIZE_5, num_warps=8, num_stages=1)
    # src[ssd_helion_bwd.py:179]: return ddt, ddacs_row, ddacs_col, dD_part
    return (ddt, ddacs_row, ddacs_col, dD_part)