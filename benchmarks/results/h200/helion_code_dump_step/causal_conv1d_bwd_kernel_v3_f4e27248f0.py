# config {'block_sizes': [4, 128], 'range_unroll_factors': [0, 2, 0], 'num_warps': 4, 'l_per_lane': 64, 'l2_groupings': [1], 'loop_orders': [[0, 1, 2]], 'range_num_stages': [0, 0, 0], 'range_multi_buffers': [None, None, None], 'range_flattens': [None, None, None], 'num_stages': 1, 'host_tensor_descriptors': False, 'load_eviction_policies': ['', '', '', '', '', '', '', '', '', '', '', '', '', ''], 'indexing': ['pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer', 'pointer'], 'atomic_indexing': [], 'pid_type': 'persistent_blocked', 'num_sm_multiplier': 1, 'maxnreg': None, 'range_warp_specializes': []}
# args ((torch.bfloat16, torch.Size([2, 8192, 6144]), (84410368, 10304, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([6144, 4]), (4, 1), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([6144]), (1,), device(type='cuda', index=0)), (torch.bfloat16, torch.Size([2, 8192, 6144]), (50331648, 6144, 1), device(type='cuda', index=0)), (<class 'NoneType'>, None), (torch.bfloat16, torch.Size([2, 8192, 6144]), (84410368, 10304, 1), device(type='cuda', index=0)), (<class 'bool'>, True))
from __future__ import annotations

import torch
import helion
import helion.language as hl
import triton
import triton.language as tl
from helion.runtime import default_launcher as _default_launcher
import kernels.causal_conv1d as _source_module

_BLOCK_SIZE_0 = tl.constexpr(4)
_BLOCK_SIZE_2 = tl.constexpr(128)

@triton.jit
def _helion_causal_conv1d_bwd_kernel_v3(w4, bias, x, dout, dx, dw_part, db_part, db_part_stride_0, dw_part_stride_0, nlane, _NUM_SM: tl.constexpr, sl: tl.constexpr):
    # src[causal_conv1d.py:362]: for tb, tj, td in hl.tile([nb, nlane, nd], block_size=[1, nr, None]):
    # src[causal_conv1d.py:363]:     w0 = w4[td, 0].to(torch.float32)[None, :]
    # src[causal_conv1d.py:364]:     w1 = w4[td, 1].to(torch.float32)[None, :]
    # src[causal_conv1d.py:362-468]: ...
    total_pids = 2 * tl.cdiv(nlane, _BLOCK_SIZE_0) * tl.cdiv(6144, _BLOCK_SIZE_2)
    block_size = tl.cdiv(total_pids, _NUM_SM)
    start_pid = tl.program_id(0) * block_size
    end_pid = start_pid + block_size
    if end_pid > total_pids:
        end_pid = total_pids
    for virtual_pid in tl.range(start_pid, end_pid):
        # src[causal_conv1d.py:362]: for tb, tj, td in hl.tile([nb, nlane, nd], block_size=[1, nr, None]):
        num_blocks_0 = 2
        num_blocks_1 = tl.cdiv(nlane, _BLOCK_SIZE_0)
        pid_0 = virtual_pid % num_blocks_0
        pid_1 = virtual_pid // num_blocks_0 % num_blocks_1
        pid_2 = virtual_pid // (num_blocks_0 * num_blocks_1)
        offset_1 = pid_0
        offset_0 = pid_1 * _BLOCK_SIZE_0
        indices_0 = (offset_0 + tl.arange(0, _BLOCK_SIZE_0)).to(tl.int32)
        mask_0 = indices_0 < nlane
        offset_2 = pid_2 * _BLOCK_SIZE_2
        indices_2 = (offset_2 + tl.arange(0, _BLOCK_SIZE_2)).to(tl.int32)
        # src[causal_conv1d.py:363]: w0 = w4[td, 0].to(torch.float32)[None, :]
        load = tl.load(w4 + (indices_2 * 4 + 0 * 1), None)
        v_0 = tl.cast(load, tl.float32)
        w0 = v_0[None, :]
        # src[causal_conv1d.py:364]: w1 = w4[td, 1].to(torch.float32)[None, :]
        load_1 = tl.load(w4 + (indices_2 * 4 + 1 * 1), None)
        v_1 = tl.cast(load_1, tl.float32)
        w1 = v_1[None, :]
        # src[causal_conv1d.py:365]: w2 = w4[td, 2].to(torch.float32)[None, :]
        load_2 = tl.load(w4 + (indices_2 * 4 + 2 * 1), None)
        v_2 = tl.cast(load_2, tl.float32)
        w2 = v_2[None, :]
        # src[causal_conv1d.py:366]: w3 = w4[td, 3].to(torch.float32)[None, :]
        load_3 = tl.load(w4 + (indices_2 * 4 + 3 * 1), None)
        v_3 = tl.cast(load_3, tl.float32)
        w3 = v_3[None, :]
        # src[causal_conv1d.py:368]: bb = bias[td].to(torch.float32)[None, :]
        load_4 = tl.load(bias + indices_2 * 1, None)
        v_4 = tl.cast(load_4, tl.float32)
        bb = v_4[None, :]
        # src[causal_conv1d.py:369]: r0 = tj.index * sl  # first row of each lane
        v_5 = tl.cast(sl, tl.int32)
        v_6 = indices_0 * v_5
        # src[causal_conv1d.py:370]: r1 = r0 + sl  # first row past each lane
        v_7 = tl.cast(sl, tl.int32)
        v_8 = v_6 + v_7
        # src[causal_conv1d.py:373]: xm3 = hl.load(x, [tb.begin, r0 - 3, td], extra_mask=(r0 >= 3)[:, None]).to(torch.float32)
        v_9 = tl.full([], 3, tl.int32)
        v_10 = v_6 - v_9
        v_11 = tl.full([], 3, tl.int32)
        v_12 = v_6 >= v_11
        subscript_5 = v_12[:, None]
        load_5 = tl.load(x + (offset_1 * 84410368 + v_10[:, None] * 10304 + indices_2[None, :] * 1), mask_0[:, None] & subscript_5, other=0)
        v_13 = tl.cast(load_5, tl.float32)
        # src[causal_conv1d.py:374]: xm2 = hl.load(x, [tb.begin, r0 - 2, td], extra_mask=(r0 >= 2)[:, None]).to(torch.float32)
        v_14 = tl.full([], 2, tl.int32)
        v_15 = v_6 - v_14
        v_16 = tl.full([], 2, tl.int32)
        v_17 = v_6 >= v_16
        subscript_6 = v_17[:, None]
        load_6 = tl.load(x + (offset_1 * 84410368 + v_15[:, None] * 10304 + indices_2[None, :] * 1), mask_0[:, None] & subscript_6, other=0)
        v_18 = tl.cast(load_6, tl.float32)
        # src[causal_conv1d.py:375]: xm1 = hl.load(x, [tb.begin, r0 - 1, td], extra_mask=(r0 >= 1)[:, None]).to(torch.float32)
        v_19 = tl.full([], 1, tl.int32)
        v_20 = v_6 - v_19
        v_21 = tl.full([], 1, tl.int32)
        v_22 = v_6 >= v_21
        subscript_7 = v_22[:, None]
        load_7 = tl.load(x + (offset_1 * 84410368 + v_20[:, None] * 10304 + indices_2[None, :] * 1), mask_0[:, None] & subscript_7, other=0)
        v_23 = tl.cast(load_7, tl.float32)
        # src[causal_conv1d.py:376]: gm3 = hl.zeros([tj, td], dtype=torch.float32)
        gm3 = tl.full([_BLOCK_SIZE_0, _BLOCK_SIZE_2], 0.0, tl.float32)
        # src[causal_conv1d.py:377]: gm2 = hl.zeros([tj, td], dtype=torch.float32)
        gm2 = tl.full([_BLOCK_SIZE_0, _BLOCK_SIZE_2], 0.0, tl.float32)
        # src[causal_conv1d.py:378]: gm1 = hl.zeros([tj, td], dtype=torch.float32)
        gm1 = tl.full([_BLOCK_SIZE_0, _BLOCK_SIZE_2], 0.0, tl.float32)
        # src[causal_conv1d.py:384]: dw0 = hl.zeros([tj, td], dtype=torch.float32)
        dw0 = tl.full([_BLOCK_SIZE_0, _BLOCK_SIZE_2], 0.0, tl.float32)
        # src[causal_conv1d.py:385]: dw1 = hl.zeros([tj, td], dtype=torch.float32)
        dw1 = tl.full([_BLOCK_SIZE_0, _BLOCK_SIZE_2], 0.0, tl.float32)
        # src[causal_conv1d.py:386]: dw2 = hl.zeros([tj, td], dtype=torch.float32)
        dw2 = tl.full([_BLOCK_SIZE_0, _BLOCK_SIZE_2], 0.0, tl.float32)
        # src[causal_conv1d.py:387]: dw3 = hl.zeros([tj, td], dtype=torch.float32)
        dw3 = tl.full([_BLOCK_SIZE_0, _BLOCK_SIZE_2], 0.0, tl.float32)
        # src[causal_conv1d.py:388]: db = hl.zeros([tj, td], dtype=torch.float32)
        db = tl.full([_BLOCK_SIZE_0, _BLOCK_SIZE_2], 0.0, tl.float32)
        # src[causal_conv1d.py:390]: xn = hl.load(x, [tb.begin, r0, td], extra_mask=(r0 < nl)[:, None])
        v_24 = tl.full([], 8192, tl.int32)
        v_25 = v_6 < v_24
        subscript_8 = v_25[:, None]
        xn = tl.load(x + (offset_1 * 84410368 + v_6[:, None] * 10304 + indices_2[None, :] * 1), mask_0[:, None] & subscript_8, other=0)
        # src[causal_conv1d.py:391]: gn = hl.load(dout, [tb.begin, r0, td], extra_mask=(r0 < nl)[:, None])
        v_26 = tl.full([], 8192, tl.int32)
        v_27 = v_6 < v_26
        subscript_9 = v_27[:, None]
        gn = tl.load(dout + (offset_1 * 50331648 + v_6[:, None] * 6144 + indices_2[None, :] * 1), mask_0[:, None] & subscript_9, other=0)
        # src[causal_conv1d.py:393]: for s in hl.grid(sl):
        # src[causal_conv1d.py:394]:     r = r0 + s
        # src[causal_conv1d.py:395]:     x0 = xn.to(torch.float32)
        # src[causal_conv1d.py:393-429]: ...
        for offset_3 in tl.range(0, tl.cast(sl, tl.int32), loop_unroll_factor=2):
            v_6_copy = v_6
            xn_copy = xn
            gn_copy = gn
            v_13_copy = v_13
            v_18_copy = v_18
            v_23_copy = v_23
            w0_copy = w0
            w1_copy = w1
            w2_copy = w2
            w3_copy = w3
            bb_copy = bb
            dw0_copy = dw0
            dw1_copy = dw1
            dw2_copy = dw2
            dw3_copy = dw3
            db_copy = db
            gm3_copy = gm3
            gm2_copy = gm2
            gm1_copy = gm1
            v_6_copy_0 = v_6_copy
            xn_copy_0 = xn_copy
            gn_copy_0 = gn_copy
            v_13_copy_0 = v_13_copy
            v_13 = v_18_copy
            v_18 = v_23_copy
            w0_copy_0 = w0_copy
            w1_copy_0 = w1_copy
            w2_copy_0 = w2_copy
            w3_copy_0 = w3_copy
            bb_copy_0 = bb_copy
            dw0_copy_0 = dw0_copy
            dw1_copy_0 = dw1_copy
            dw2_copy_0 = dw2_copy
            dw3_copy_0 = dw3_copy
            db_copy_0 = db_copy
            gm3_copy_0 = gm3_copy
            gm3 = gm2_copy
            gm2 = gm1_copy
            # src[causal_conv1d.py:394]: r = r0 + s
            v_28 = tl.cast(offset_3, tl.int32)
            v_29 = v_6_copy_0 + v_28
            # src[causal_conv1d.py:395]: x0 = xn.to(torch.float32)
            v_23 = tl.cast(xn_copy_0, tl.float32)
            # src[causal_conv1d.py:396]: g0 = gn.to(torch.float32)
            v_31 = tl.cast(gn_copy_0, tl.float32)
            # src[causal_conv1d.py:397]: okn = r + 1 < nl
            v_32 = tl.full([], 1, tl.int32)
            v_33 = v_29 + v_32
            v_34 = tl.full([], 8192, tl.int32)
            v_35 = v_33 < v_34
            # src[causal_conv1d.py:398]: xn = hl.load(x, [tb.begin, r + 1, td], extra_mask=okn[:, None])
            v_36 = tl.full([], 1, tl.int32)
            v_37 = v_29 + v_36
            subscript = v_35[:, None]
            xn = tl.load(x + (offset_1 * 84410368 + v_37[:, None] * 10304 + indices_2[None, :] * 1), mask_0[:, None] & subscript, other=0)
            # src[causal_conv1d.py:399]: gn = hl.load(dout, [tb.begin, r + 1, td], extra_mask=okn[:, None])
            v_38 = tl.full([], 1, tl.int32)
            v_39 = v_29 + v_38
            subscript_1 = v_35[:, None]
            gn = tl.load(dout + (offset_1 * 50331648 + v_39[:, None] * 6144 + indices_2[None, :] * 1), mask_0[:, None] & subscript_1, other=0)
            # src[causal_conv1d.py:409]: a = w0 * xe3 + w1 * xe2 + w2 * xe1 + w3 * x0
            v_40 = w0_copy_0 * v_13_copy_0
            v_41 = w1_copy_0 * v_13
            v_42 = v_40 + v_41
            v_43 = w2_copy_0 * v_18
            v_44 = v_42 + v_43
            v_45 = w3_copy_0 * v_23
            v_46 = v_44 + v_45
            # src[causal_conv1d.py:411]: a = a + bb
            v_47 = v_46 + bb_copy_0
            # src[causal_conv1d.py:412]: sg = torch.sigmoid(a)
            v_48 = tl.cast(v_47, tl.float32)
            v_49 = tl.sigmoid(v_48)
            # src[causal_conv1d.py:413]: g0 = g0 * sg * (1.0 + a * (1.0 - sg))
            v_50 = v_31 * v_49
            v_51 = tl.full([], 1.0, tl.float32)
            v_52 = v_51 - v_49
            v_53 = v_47 * v_52
            v_54 = tl.full([], 1.0, tl.float32)
            v_55 = v_53 + v_54
            gm1 = v_50 * v_55
            # src[causal_conv1d.py:414]: dw0 = dw0 + g0 * xe3
            v_57 = gm1 * v_13_copy_0
            dw0 = dw0_copy_0 + v_57
            # src[causal_conv1d.py:415]: dw1 = dw1 + g0 * xe2
            v_59 = gm1 * v_13
            dw1 = dw1_copy_0 + v_59
            # src[causal_conv1d.py:416]: dw2 = dw2 + g0 * xe1
            v_61 = gm1 * v_18
            dw2 = dw2_copy_0 + v_61
            # src[causal_conv1d.py:417]: dw3 = dw3 + g0 * x0
            v_63 = gm1 * v_23
            dw3 = dw3_copy_0 + v_63
            # src[causal_conv1d.py:418]: db = db + g0
            db = db_copy_0 + gm1
            # src[causal_conv1d.py:419]: t = r - 3
            v_66 = tl.full([], 3, tl.int32)
            v_67 = v_29 - v_66
            # src[causal_conv1d.py:426]: dxt = w3 * gm3 + w2 * gm2 + w1 * gm1 + w0 * g0
            v_68 = w3_copy_0 * gm3_copy_0
            v_69 = w2_copy_0 * gm3
            v_70 = v_68 + v_69
            v_71 = w1_copy_0 * gm2
            v_72 = v_70 + v_71
            v_73 = w0_copy_0 * gm1
            v_74 = v_72 + v_73
            # src[causal_conv1d.py:427]: hl.store(dx, [tb.begin, t, td], dxt.to(dx.dtype), extra_mask=((t >= r0) & (t < nl))[:, None])
            v_75 = tl.cast(v_74, tl.bfloat16)
            v_76 = v_67 >= v_6_copy_0
            v_77 = tl.full([], 8192, tl.int32)
            v_78 = v_67 < v_77
            v_79 = v_76 & v_78
            subscript_2 = v_79[:, None]
            tl.store(dx + (offset_1 * 84410368 + v_67[:, None] * 10304 + indices_2[None, :] * 1), v_75, mask_0[:, None] & subscript_2)
        # src[causal_conv1d.py:431]: for s in hl.grid(sl, sl + 3):
        add_1 = 3 + sl
        # src[causal_conv1d.py:431]: for s in hl.grid(sl, sl + 3):
        # src[causal_conv1d.py:432]:     r = r0 + s
        # src[causal_conv1d.py:433]:     x0 = xn.to(torch.float32)
        # src[causal_conv1d.py:431-462]: ...
        tl.debug_barrier()
        for offset_4 in tl.range(tl.cast(sl, tl.int32), tl.cast(add_1, tl.int32)):
            v_6_copy_1 = v_6
            xn_copy_1 = xn
            gn_copy_1 = gn
            v_8_copy = v_8
            v_13_copy_1 = v_13
            v_18_copy_1 = v_18
            v_23_copy_1 = v_23
            w0_copy_1 = w0
            w1_copy_1 = w1
            w2_copy_1 = w2
            w3_copy_1 = w3
            bb_copy_1 = bb
            gm3_copy_1 = gm3
            gm2_copy_1 = gm2
            gm1_copy_1 = gm1
            v_6_copy_1_0 = v_6_copy_1
            xn_copy_1_0 = xn_copy_1
            gn_copy_1_0 = gn_copy_1
            v_8_copy_0 = v_8_copy
            v_13_copy_1_0 = v_13_copy_1
            v_13 = v_18_copy_1
            v_18 = v_23_copy_1
            w0_copy_1_0 = w0_copy_1
            w1_copy_1_0 = w1_copy_1
            w2_copy_1_0 = w2_copy_1
            w3_copy_1_0 = w3_copy_1
            bb_copy_1_0 = bb_copy_1
            gm3_copy_1_0 = gm3_copy_1
            gm3 = gm2_copy_1
            gm2 = gm1_copy_1
            # src[causal_conv1d.py:432]: r = r0 + s
            v_80 = tl.cast(offset_4, tl.int32)
            v_81 = v_6_copy_1_0 + v_80
            # src[causal_conv1d.py:433]: x0 = xn.to(torch.float32)
            v_23 = tl.cast(xn_copy_1_0, tl.float32)
            # src[causal_conv1d.py:434]: g0 = gn.to(torch.float32)
            v_83 = tl.cast(gn_copy_1_0, tl.float32)
            # src[causal_conv1d.py:435]: okn = (r + 1 < nl) & (r + 1 < r1 + 3)
            v_84 = tl.full([], 1, tl.int32)
            v_85 = v_81 + v_84
            v_86 = tl.full([], 8192, tl.int32)
            v_87 = v_85 < v_86
            v_88 = tl.full([], 1, tl.int32)
            v_89 = v_81 + v_88
            v_90 = tl.full([], 3, tl.int32)
            v_91 = v_8_copy_0 + v_90
            v_92 = v_89 < v_91
            v_93 = v_87 & v_92
            # src[causal_conv1d.py:436]: xn = hl.load(x, [tb.begin, r + 1, td], extra_mask=okn[:, None])
            v_94 = tl.full([], 1, tl.int32)
            v_95 = v_81 + v_94
            subscript_3 = v_93[:, None]
            xn = tl.load(x + (offset_1 * 84410368 + v_95[:, None] * 10304 + indices_2[None, :] * 1), mask_0[:, None] & subscript_3, other=0)
            # src[causal_conv1d.py:437]: gn = hl.load(dout, [tb.begin, r + 1, td], extra_mask=okn[:, None])
            v_96 = tl.full([], 1, tl.int32)
            v_97 = v_81 + v_96
            subscript_4 = v_93[:, None]
            gn = tl.load(dout + (offset_1 * 50331648 + v_97[:, None] * 6144 + indices_2[None, :] * 1), mask_0[:, None] & subscript_4, other=0)
            # src[causal_conv1d.py:447]: a = w0 * xe3 + w1 * xe2 + w2 * xe1 + w3 * x0
            v_98 = w0_copy_1_0 * v_13_copy_1_0
            v_99 = w1_copy_1_0 * v_13
            v_100 = v_98 + v_99
            v_101 = w2_copy_1_0 * v_18
            v_102 = v_100 + v_101
            v_103 = w3_copy_1_0 * v_23
            v_104 = v_102 + v_103
            # src[causal_conv1d.py:449]: a = a + bb
            v_105 = v_104 + bb_copy_1_0
            # src[causal_conv1d.py:450]: sg = torch.sigmoid(a)
            v_106 = tl.cast(v_105, tl.float32)
            v_107 = tl.sigmoid(v_106)
            # src[causal_conv1d.py:451]: g0 = g0 * sg * (1.0 + a * (1.0 - sg))
            v_108 = v_83 * v_107
            v_109 = tl.full([], 1.0, tl.float32)
            v_110 = v_109 - v_107
            v_111 = v_105 * v_110
            v_112 = tl.full([], 1.0, tl.float32)
            v_113 = v_111 + v_112
            gm1 = v_108 * v_113
            # src[causal_conv1d.py:452]: t = r - 3
            v_115 = tl.full([], 3, tl.int32)
            v_116 = v_81 - v_115
            # src[causal_conv1d.py:459]: dxt = w3 * gm3 + w2 * gm2 + w1 * gm1 + w0 * g0
            v_117 = w3_copy_1_0 * gm3_copy_1_0
            v_118 = w2_copy_1_0 * gm3
            v_119 = v_117 + v_118
            v_120 = w1_copy_1_0 * gm2
            v_121 = v_119 + v_120
            v_122 = w0_copy_1_0 * gm1
            v_123 = v_121 + v_122
            # src[causal_conv1d.py:460]: hl.store(dx, [tb.begin, t, td], dxt.to(dx.dtype), extra_mask=(t < nl)[:, None])
            v_124 = tl.cast(v_123, tl.bfloat16)
            v_125 = tl.full([], 8192, tl.int32)
            v_126 = v_116 < v_125
            subscript_10 = v_126[:, None]
            tl.store(dx + (offset_1 * 84410368 + v_116[:, None] * 10304 + indices_2[None, :] * 1), v_124, mask_0[:, None] & subscript_10)
        # src[causal_conv1d.py:464]: dw_part[tb.begin, tj.id, 0, td] = torch.sum(dw0, dim=0)
        sum_1 = tl.cast(tl.sum(dw0.to(tl.float32), 0), tl.float32)
        tile_id = offset_0 // _BLOCK_SIZE_0
        tl.store(dw_part + (offset_1 * dw_part_stride_0 + tile_id * 24576 + 0 * 6144 + indices_2 * 1), sum_1, None)
        # src[causal_conv1d.py:465]: dw_part[tb.begin, tj.id, 1, td] = torch.sum(dw1, dim=0)
        sum_2 = tl.cast(tl.sum(dw1.to(tl.float32), 0), tl.float32)
        tl.store(dw_part + (offset_1 * dw_part_stride_0 + tile_id * 24576 + 1 * 6144 + indices_2 * 1), sum_2, None)
        # src[causal_conv1d.py:466]: dw_part[tb.begin, tj.id, 2, td] = torch.sum(dw2, dim=0)
        sum_3 = tl.cast(tl.sum(dw2.to(tl.float32), 0), tl.float32)
        tl.store(dw_part + (offset_1 * dw_part_stride_0 + tile_id * 24576 + 2 * 6144 + indices_2 * 1), sum_3, None)
        # src[causal_conv1d.py:467]: dw_part[tb.begin, tj.id, 3, td] = torch.sum(dw3, dim=0)
        sum_4 = tl.cast(tl.sum(dw3.to(tl.float32), 0), tl.float32)
        tl.store(dw_part + (offset_1 * dw_part_stride_0 + tile_id * 24576 + 3 * 6144 + indices_2 * 1), sum_4, None)
        # src[causal_conv1d.py:468]: db_part[tb.begin, tj.id, td] = torch.sum(db, dim=0)
        sum_5 = tl.cast(tl.sum(db.to(tl.float32), 0), tl.float32)
        tl.store(db_part + (offset_1 * db_part_stride_0 + tile_id * 6144 + indices_2 * 1), sum_5, None)

def causal_conv1d_bwd_kernel_v3(x: torch.Tensor, w4: torch.Tensor, bias: torch.Tensor | None, dout: torch.Tensor, seq: torch.Tensor | None, dx: torch.Tensor, silu: hl.constexpr, *, _launcher=_default_launcher):
    # src[causal_conv1d.py:355]: nb, nl, nd = x.size()
    nb, nl, nd = x.size()
    # src[causal_conv1d.py:356]: sl = hl.register_tunable("l_per_lane", PowerOfTwoFragment(16, 4096, 64))  # rows per lane (>= 3)
    sl = 64
    # src[causal_conv1d.py:357]: nlane = helion.cdiv(nl, sl)
    nlane = helion.cdiv(nl, sl)
    # src[causal_conv1d.py:358]: nr = hl.register_block_size(1, 64)  # lanes per program
    nr = 4
    # src[causal_conv1d.py:359]: nlp = helion.cdiv(nlane, nr)
    nlp = helion.cdiv(nlane, nr)
    # src[causal_conv1d.py:360]: dw_part = torch.empty([nb, nlp, 4, nd], dtype=torch.float32, device=x.device)
    dw_part = torch.empty([nb, nlp, 4, nd], dtype=torch.float32, device=x.device)
    # src[causal_conv1d.py:361]: db_part = torch.empty([nb, nlp, nd], dtype=torch.float32, device=x.device)
    db_part = torch.empty([nb, nlp, nd], dtype=torch.float32, device=x.device)
    # src[causal_conv1d.py:362]: for tb, tj, td in hl.tile([nb, nlane, nd], block_size=[1, nr, None]):
    _NUM_SM = helion.runtime.get_num_sm(x.device)
    # src[causal_conv1d.py:362]: for tb, tj, td in hl.tile([nb, nlane, nd], block_size=[1, nr, None]):
    # src[causal_conv1d.py:363]:     w0 = w4[td, 0].to(torch.float32)[None, :]
    # src[causal_conv1d.py:364]:     w1 = w4[td, 1].to(torch.float32)[None, :]
    # src[causal_conv1d.py:362-468]: ...
    _launcher(_helion_causal_conv1d_bwd_kernel_v3, (_NUM_SM,), w4, bias, x, dout, dx, dw_part, db_part, db_part.stride(0), dw_part.stride(0), nlane, _NUM_SM, sl, num_warps=4, num_stages=1)
    # src[causal_conv1d.py:469]: return dw_part, db_part
    return (dw_part, db_part)