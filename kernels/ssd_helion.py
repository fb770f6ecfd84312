"""Mamba-2 SSD forward (chunked scan) in Helion, with mamba-ssm 2.3.2 semantics.

Pieces (same layouts as mamba-ssm / ``kernels.ssd``; b batch, l seqlen, h nheads, p headdim,
g ngroups, n dstate, c chunk_size, nc = ceil(l / c)):

=============================================  ================================================
``ssd_chunk_cumsum_helion(dt, A, c, ...)``     -> (dA_cumsum, dt_out), both (b, h, nc, c) fp32
``ssd_chunk_state_helion(B, x, dt, dA, ...)``  -> states (b, nc, h, p, n) fp32 (zero initial state)
``ssd_state_passing_helion(states, dAlast..)`` -> (states_in (b, nc, h, p, n), final (b, h, p, n) fp32)
``ssd_chunk_state_passing_helion(...)``        chunk_state + state_passing fused (serial over chunks,
                                               the fp32 per-chunk states never reach memory)
``ssd_bmm_chunk_helion(C, B, c, seq_idx)``     -> CB (b, nc, g, c, c) fp32
``ssd_chunk_pieces_helion(B, x, C, dt, A, c)`` -> (dA_cumsum, dt_out, states_in, final_states, CB)
``ssd_chunk_scan_helion(CB, x, dt, dA, C, ..)`` -> (out, out_x) (b, l, h, p) in x.dtype
``ssd_forward_helion(...)``                    -> (out, out_x, dt_out, dA_cumsum, states_in, final_states[, CB])
``mamba_chunk_scan_combined_helion(...)``      forward-only, mamba-ssm's signature
=============================================  ================================================

dtypes follow mamba-ssm: dt_out, dA_cumsum, per-chunk states, CB and final_states are fp32;
``states_in`` (the state entering each chunk) is stored in ``state_dtype`` or, by default,
C.dtype, exactly as ``_mamba_chunk_scan_combined_fwd`` does (chunk_scan casts it to C.dtype
before its GEMM anyway). Pass ``state_dtype=torch.float32`` to keep it in fp32.

Inputs may be strided views (x/B/C slices of the conv output, z/dt slices of zxbcdt): the kernels
read them in place, the wrappers copy nothing (only the fp32 intermediates are produced contiguous).
Sequence lengths that are not a multiple of the chunk size are padded internally to nc * c
(padded positions get dt = 0, so they change no state; padded output rows are dropped). ``ssd_forward_helion``
takes l from dt: x, B, C, z and seq_idx may come already padded to nc * c (the fused op pads zxbcdt once), and
are then read as they are.
``chunk_size`` must be a power of two (Megatron uses 128).

Configs come from ``kernels.first_use.select_config`` (through ``first_use.tuned_call``); the defaults below are
conservative (power-of-two blocks, 4 warps, 2-3 stages) and compile on Triton 3.6 / sm90.
Each (kernel, config) pair is one ``helion.kernel`` with a fixed config: no autotuning at call time.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

import helion
import helion.language as hl

from kernels import first_use, tuning
from kernels import tuner  # noqa: E402
from kernels.derived import derived
from kernels.settings import STATE_PASSING_CHOICES, STATE_PASSING_NOTICE
from kernels.shapes import padded_len
from kernels.ssd import _pad_len
from kernels.ssd import _pad_seq_idx as _pad_seq_idx_ref

_LOG2E = 1.4426950408889634

# ----------------------------------------------------------------------------------------------
# Kernel bodies (Helion). Every index into the sequence dimension is chunk * c + offset, so the
# host pads l to nc * c before calling them.
# ----------------------------------------------------------------------------------------------


# The chunk cumsum on (heads, chunk) tiles, as mamba-ssm's _chunk_cumsum_fwd_kernel: the (c, heads) tile of dt is
# transposed right after its strided load, the cumsum runs along the chunk and both stores are chunk-contiguous. The
# softplus is mamba-ssm's log(1 + exp(d)) on the fast exp2 / log.
def _chunk_cumsum_kernel(
    dt: torch.Tensor,  # (b, L, h) any float dtype, L = nc * c
    A: torch.Tensor,  # (h,)
    dt_bias: torch.Tensor | None,  # (h,)
    chunk_size: int,
    seqlen: int,
    dt_min: float,
    dt_max: float,
    dt_softplus: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, L, h = dt.shape
    c = hl.specialize(chunk_size)
    nc = L // c
    dA_cumsum = torch.empty([b, h, nc, c], dtype=torch.float32, device=dt.device)
    dt_out = torch.empty([b, h, nc, c], dtype=torch.float32, device=dt.device)
    block_h = hl.register_block_size(1, h)
    for tb, tc, th in hl.tile([b, nc, h], block_size=[1, 1, block_h]):
        for tk in hl.tile(c, block_size=c):
            d = dt[tb.begin, tc.begin * c + tk.index, th].permute(1, 0).to(torch.float32)  # (BH, c)
            if dt_bias is not None:
                d = d + dt_bias[th].to(torch.float32)[:, None]
            if dt_softplus:
                # log(1 + exp(d)) as mamba-ssm computes it (Triton 3: tl.math.log(tl.math.exp(dt) + 1)), on the fast
                # exp2 / log (ex2.approx, lg2.approx); log1p(exp(d)) would lower to libdevice's exact log1p and exp
                d = torch.where(d <= 20.0, torch.log(torch.exp2(d * _LOG2E) + 1.0), d)
            d = torch.clamp(d, min=dt_min, max=dt_max)
            pos = tc.begin * c + tk.index
            d = torch.where((pos < seqlen)[None, :], d, 0.0)
            dt_out[tb.begin, th, tc.begin, tk] = d
            dA_cumsum[tb.begin, th, tc.begin, tk] = torch.cumsum(d * A[th].to(torch.float32)[:, None], dim=1)
    return dA_cumsum, dt_out


def _chunk_state_kernel(
    B: torch.Tensor,  # (b, L, g, n)
    x: torch.Tensor,  # (b, L, h, p)
    dt: torch.Tensor,  # (b, h, nc, c) fp32
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    seq_idx: torch.Tensor | None,  # (b, L) int32
) -> torch.Tensor:
    b, L, g, n = B.shape
    _, _, h, p = x.shape
    _, _, nc, c = dt.shape
    c = hl.specialize(c)
    states = torch.empty([b, nc, h, p, n], dtype=torch.float32, device=x.device)
    ratio = h // g
    block_m = hl.register_block_size(16, p)
    block_n = hl.register_block_size(16, n)
    block_k = hl.register_block_size(16, c)
    for tb, tc, th, tm, tn in hl.tile([b, nc, h, p, n], block_size=[1, 1, 1, block_m, block_n]):
        acc = hl.zeros([tm, tn], dtype=torch.float32)
        dA_last = dA_cumsum[tb.begin, th.begin, tc.begin, c - 1]
        if seq_idx is not None:
            seq_last = seq_idx[tb.begin, tc.begin * c + c - 1]
        for tk in hl.tile(c, block_size=block_k):
            pos = tc.begin * c + tk.index
            x_t = x[tb.begin, pos, th.begin, tm]  # (K, M)
            b_t = B[tb.begin, pos, th.begin // ratio, tn].to(torch.float32)  # (K, N)
            dA_k = dA_cumsum[tb.begin, th.begin, tc.begin, tk]
            dt_k = dt[tb.begin, th.begin, tc.begin, tk]
            scale = torch.exp2(torch.clamp(dA_last - dA_k, max=0.0) * _LOG2E) * dt_k
            if seq_idx is not None:
                same = seq_idx[tb.begin, pos] == seq_last
                scale = torch.where(same, scale, 0.0)
            b_s = (b_t * scale[:, None]).to(x.dtype)
            acc = hl.dot(x_t.permute(1, 0), b_s, acc=acc)
        states[tb.begin, tc.begin, th.begin, tm, tn] = acc
    return states


def _state_passing_kernel(
    states: torch.Tensor,  # (b, nc, h, D) fp32, D = p * n
    dA_last: torch.Tensor,  # (b, h, nc) fp32 (dA_cumsum[..., -1])
    initial_states: torch.Tensor | None,  # (b, h, D)
    seq_end: torch.Tensor | None,  # (b, nc + 1) int32: [0, seq_idx at the end of chunk 0, 1, ...]
    state_dtype_like: torch.Tensor,  # empty tensor whose dtype is states_in's
) -> tuple[torch.Tensor, torch.Tensor]:
    b, nc, h, dim = states.shape
    states_in = torch.empty([b, nc, h, dim], dtype=state_dtype_like.dtype, device=states.device)
    final_states = torch.empty([b, h, dim], dtype=torch.float32, device=states.device)
    block = hl.register_block_size(64, dim)
    for tb, th, td in hl.tile([b, h, dim], block_size=[1, 1, block]):
        if initial_states is not None:
            s = initial_states[tb.begin, th.begin, td].to(torch.float32)
        else:
            s = hl.zeros([td], dtype=torch.float32)
        for tc in hl.tile(nc, block_size=1):
            states_in[tb.begin, tc.begin, th.begin, td] = s.to(states_in.dtype)
            scale = torch.exp2(dA_last[tb.begin, th.begin, tc.begin] * _LOG2E)
            if seq_end is not None:
                keep = seq_end[tb.begin, tc.begin + 1] == seq_end[tb.begin, tc.begin]
                scale = torch.where(keep, scale, 0.0)
            s = scale * s + states[tb.begin, tc.begin, th.begin, td]
        final_states[tb.begin, th.begin, td] = s
    return states_in, final_states


def _chunk_state_passing_kernel(
    B: torch.Tensor,  # (b, L, g, n)
    x: torch.Tensor,  # (b, L, h, p)
    dt: torch.Tensor,  # (b, h, nc, c) fp32
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    initial_states: torch.Tensor | None,  # (b, h, p, n)
    seq_idx: torch.Tensor | None,  # (b, L) int32
    seq_end: torch.Tensor | None,  # (b, nc + 1) int32
    state_dtype_like: torch.Tensor,  # empty tensor whose dtype is states_in's
) -> tuple[torch.Tensor, torch.Tensor]:
    b, L, g, n = B.shape
    _, _, h, p = x.shape
    _, _, nc, c = dt.shape
    c = hl.specialize(c)
    states_in = torch.empty([b, nc, h, p, n], dtype=state_dtype_like.dtype, device=x.device)
    final_states = torch.empty([b, h, p, n], dtype=torch.float32, device=x.device)
    ratio = h // g
    block_m = hl.register_block_size(16, p)
    block_n = hl.register_block_size(16, n)
    block_k = hl.register_block_size(16, c)
    for tb, th, tm, tn in hl.tile([b, h, p, n], block_size=[1, 1, block_m, block_n]):
        if initial_states is not None:
            s = initial_states[tb.begin, th.begin, tm, tn].to(torch.float32)
        else:
            s = hl.zeros([tm, tn], dtype=torch.float32)
        for tc in hl.tile(nc, block_size=1):
            states_in[tb.begin, tc.begin, th.begin, tm, tn] = s.to(states_in.dtype)
            dA_last = dA_cumsum[tb.begin, th.begin, tc.begin, c - 1]
            acc = hl.zeros([tm, tn], dtype=torch.float32)
            if seq_idx is not None:
                seq_last = seq_idx[tb.begin, tc.begin * c + c - 1]
            for tk in hl.tile(c, block_size=block_k):
                pos = tc.begin * c + tk.index
                x_t = x[tb.begin, pos, th.begin, tm]
                b_t = B[tb.begin, pos, th.begin // ratio, tn].to(torch.float32)
                dA_k = dA_cumsum[tb.begin, th.begin, tc.begin, tk]
                dt_k = dt[tb.begin, th.begin, tc.begin, tk]
                scale = torch.exp2(torch.clamp(dA_last - dA_k, max=0.0) * _LOG2E) * dt_k
                if seq_idx is not None:
                    same = seq_idx[tb.begin, pos] == seq_last
                    scale = torch.where(same, scale, 0.0)
                b_s = (b_t * scale[:, None]).to(x.dtype)
                acc = hl.dot(x_t.permute(1, 0), b_s, acc=acc)
            decay = torch.exp2(dA_last * _LOG2E)
            if seq_end is not None:
                keep = seq_end[tb.begin, tc.begin + 1] == seq_end[tb.begin, tc.begin]
                decay = torch.where(keep, decay, 0.0)
            s = decay * s + acc
        final_states[tb.begin, th.begin, tm, tn] = s
    return states_in, final_states


def _bmm_chunk_kernel(
    C: torch.Tensor,  # (b, L, g, n)
    B: torch.Tensor,  # (b, L, g, n)
    seq_idx: torch.Tensor | None,  # (b, L) int32
    chunk_size: int,
    like: torch.Tensor,  # empty, CB's dtype (fp32; bf16 for chunk_scan_cb16)
) -> torch.Tensor:
    b, L, g, n = C.shape
    c = hl.specialize(chunk_size)
    nc = L // c
    CB = torch.empty([b, nc, g, c, c], dtype=like.dtype, device=C.device)
    block_m = hl.register_block_size(16, c)
    block_n = hl.register_block_size(16, c)
    block_k = hl.register_block_size(16, n)
    for tb, tc, tg, tm, tn in hl.tile([b, nc, g, c, c], block_size=[1, 1, 1, block_m, block_n]):
        acc = hl.zeros([tm, tn], dtype=torch.float32)
        for tk in hl.tile(n, block_size=block_k):
            c_t = C[tb.begin, tc.begin * c + tm.index, tg.begin, tk]
            b_t = B[tb.begin, tc.begin * c + tn.index, tg.begin, tk]
            acc = hl.dot(c_t, b_t.permute(1, 0), acc=acc)
        if seq_idx is not None:
            s_m = seq_idx[tb.begin, tc.begin * c + tm.index]
            s_n = seq_idx[tb.begin, tc.begin * c + tn.index]
            acc = torch.where(s_m[:, None] == s_n[None, :], acc, 0.0)
        CB[tb.begin, tc.begin, tg.begin, tm, tn] = acc.to(CB.dtype)
    return CB


def _chunk_scan_kernel(
    CB: torch.Tensor,  # (b, nc, g, c, c) fp32
    x: torch.Tensor,  # (b, L, h, p)
    dt: torch.Tensor,  # (b, h, nc, c) fp32
    dA_cumsum: torch.Tensor,  # (b, h, nc, c) fp32
    C: torch.Tensor,  # (b, L, g, n)
    states_in: torch.Tensor,  # (b, nc, h, p, n)
    D: torch.Tensor | None,  # (h, p) (a per-head D is expanded with stride 0 by the host)
    z: torch.Tensor | None,  # (b, L, h, p)
    seq_idx: torch.Tensor | None,  # (b, L) int32
    seq_end: torch.Tensor | None,  # (b, nc + 1) int32
    out: torch.Tensor,  # (b, L, h, p), written here (the wrapper picks its memory layout)
    out_x: torch.Tensor,  # (b, L, h, p), written here with z; ``out`` itself without z
) -> tuple[torch.Tensor, torch.Tensor]:
    b, L, h, p = x.shape
    _, nc, g, c, _ = CB.shape
    n = C.shape[3]
    c = hl.specialize(c)
    n = hl.specialize(n)
    ratio = h // g
    block_m = hl.register_block_size(16, c)
    block_n = hl.register_block_size(16, p)
    block_k = hl.register_block_size(16, c)
    # Program order: heads fastest, then row and column tiles, then batch and chunk. The tiles that share data run
    # side by side: the heads of a group read the same C and C.B^T blocks, and the row tiles of a (chunk, head) the
    # same state and x rows, so these reads come close together in time (batch first puts the heads of a group b*nc
    # programs apart and the row tiles b*nc*h).
    for th, tm, tn, tb, tc in hl.tile([h, c, p, b, nc], block_size=[1, block_m, block_n, 1, 1]):
        pos_m = tc.begin * c + tm.index
        dA_m = dA_cumsum[tb.begin, th.begin, tc.begin, tm]
        # Inter-chunk part: exp(dA_m) * C_m . state_in^T  (K = n in one dot).
        c_m = C[tb.begin, pos_m, th.begin // ratio, :]  # (M, n)
        st = states_in[tb.begin, tc.begin, th.begin, tn, :].to(C.dtype)  # (N, n)
        acc = hl.dot(c_m, st.permute(1, 0))
        scale_m = torch.exp2(dA_m * _LOG2E)
        if seq_idx is not None:
            same = seq_idx[tb.begin, pos_m] == seq_end[tb.begin, tc.begin]
            scale_m = torch.where(same, scale_m, 0.0)
        acc = acc * scale_m[:, None]
        # Intra-chunk part: causal, decayed, dt-weighted CB applied to x.
        for tk in hl.tile((tm.id + 1) * block_m, block_size=block_k):
            cb = CB[tb.begin, tc.begin, th.begin // ratio, tm, tk]
            dA_k = dA_cumsum[tb.begin, th.begin, tc.begin, tk]
            dt_k = dt[tb.begin, th.begin, tc.begin, tk]
            w = cb * torch.exp2(torch.clamp(dA_m[:, None] - dA_k[None, :], max=0.0) * _LOG2E) * dt_k[None, :]
            w = torch.where(tm.index[:, None] >= tk.index[None, :], w, 0.0).to(x.dtype)
            x_k = x[tb.begin, tc.begin * c + tk.index, th.begin, tn]
            acc = hl.dot(w, x_k, acc=acc)
        if D is not None:
            x_m = x[tb.begin, pos_m, th.begin, tn].to(torch.float32)
            acc = acc + x_m * D[th.begin, tn].to(torch.float32)[None, :]
        if z is not None:
            out_x[tb.begin, pos_m, th.begin, tn] = acc.to(out_x.dtype)
            z_m = z[tb.begin, pos_m, th.begin, tn].to(torch.float32)
            acc = acc * (z_m * torch.sigmoid(z_m))
        out[tb.begin, pos_m, th.begin, tn] = acc.to(out.dtype)
    return out, out_x


# ----------------------------------------------------------------------------------------------
# Configs and compiled-kernel cache
# ----------------------------------------------------------------------------------------------

_BODIES: dict[str, Callable[..., Any]] = {
    "ssd_chunk_cumsum": _chunk_cumsum_kernel,
    "ssd_chunk_state": _chunk_state_kernel,
    "ssd_state_passing": _state_passing_kernel,
    "ssd_chunk_state_passing": _chunk_state_passing_kernel,
    "ssd_bmm_chunk": _bmm_chunk_kernel,
    # chunk_scan with CB in fp32 (fp32 inputs) and in the inputs' 16-bit dtype (bf16 / fp16 inputs: the bmm writes CB
    # in that dtype, half of its bytes; chunk_scan rounds its CB-derived weights to x's dtype for the GEMM anyway):
    # one body, two names, so each dtype has its own tuned configs
    "ssd_chunk_scan": _chunk_scan_kernel,
    "ssd_chunk_scan_cb16": _chunk_scan_kernel,
}

# Conservative defaults (sm90-safe): block_sizes follow each body's register_block_size order.
DEFAULT_CONFIGS: dict[str, dict[str, Any]] = {
    "ssd_chunk_cumsum": dict(block_sizes=[8], num_warps=4, num_stages=1),
    "ssd_chunk_state": dict(block_sizes=[64, 64, 64], num_warps=4, num_stages=3),
    "ssd_state_passing": dict(block_sizes=[512], num_warps=4, num_stages=3),
    "ssd_chunk_state_passing": dict(block_sizes=[32, 64, 64], num_warps=4, num_stages=3),
    "ssd_bmm_chunk": dict(block_sizes=[64, 64, 64], num_warps=4, num_stages=3),
    "ssd_chunk_scan": dict(block_sizes=[64, 64, 64], num_warps=4, num_stages=2),
    "ssd_chunk_scan_cb16": dict(block_sizes=[64, 64, 32], num_warps=4, num_stages=1),  # chunk_scan's tuned Nano config
}


def forward_cb_dtype(dtype: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The dtype of CB between the forward's bmm and chunk_scan for inputs (x, B, C) of ``dtype``: the inputs' own
    (bf16 in training: ``ssd_chunk_scan_cb16``; fp32 inputs keep an fp32 CB and ``ssd_chunk_scan``, as mamba-ssm).
    The backward recomputes CB in fp32."""
    return dtype


def _chunk_scan_name(dtype: torch.dtype) -> str:
    return "ssd_chunk_scan" if dtype == torch.float32 else "ssd_chunk_scan_cb16"

_KERNELS: dict[str, Any] = {}


def _config_dict(cfg: Any) -> dict[str, Any]:
    if isinstance(cfg, helion.Config):
        return dict(cfg.config)
    return dict(cfg)


def _next_pow2(v: int) -> int:
    return 1 << max(0, (int(v) - 1).bit_length())


def _clip_blocks(name: str, cfg: dict[str, Any], limits: list[int]) -> dict[str, Any]:
    """Clamp block sizes to the extents they tile (rounded up to a power of two), so a config
    tuned at a large shape stays valid at a small one."""
    cfg = dict(cfg)
    bs = list(cfg["block_sizes"])
    if len(bs) != len(limits):
        raise ValueError(f"{name}: config has {len(bs)} block sizes, the kernel registers {len(limits)}")
    cfg["block_sizes"] = [min(int(v), _next_pow2(lim)) for v, lim in zip(bs, limits)]
    return cfg


def get_kernel(name: str) -> Any:
    """The (config-less) ``helion.kernel`` for body ``name``; configs are given at call time."""
    k = _KERNELS.get(name)
    if k is None:
        k = helion.kernel(
            _BODIES[name], static_shapes=True,
            ignore_warnings=[helion.exc.TensorOperationInWrapper, *tuning.IGNORED_HELION_WARNINGS]
        )
        _KERNELS[name] = k
    return k


def _run(name: str, dims: dict[str, int], limits: list[int], args: tuple, config: Any = None) -> Any:
    kernel = get_kernel(name)
    if config is None:
        return first_use.tuned_call(name, kernel, args, dims, DEFAULT_CONFIGS[name], seeds=_SEEDS.get(name, ()),
                                    atol=2e-2, rtol=2e-2, adjust=lambda cfg: _clip_blocks(name, cfg, limits))
    cfg = _clip_blocks(name, _config_dict(config), limits)
    return tuning.run_with_config(kernel, args, cfg)


# ----------------------------------------------------------------------------------------------
# Input checks and padding helpers
# ----------------------------------------------------------------------------------------------


def _check_lengths(l: int, L: int, **tensors: torch.Tensor | None) -> None:
    """Every given (b, length, ...) tensor has length ``l`` or its padded length ``L``."""
    for name, t in tensors.items():
        if t is not None and (t.dim() < 2 or t.shape[1] not in (l, L)):
            raise ValueError(f"{name} must be {l}" + (f" or {L} (padded to the chunk)" if L != l else "")
                             + f" long in its dim 1, got {tuple(t.shape)}")


def _check_chunk(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size!r}")


def _pad_seq(t: torch.Tensor | None, total: int, dim: int = 1) -> torch.Tensor | None:
    """Zero-pad ``dim`` to ``total`` (``t`` itself, strided or not, when it already has that length)."""
    return None if t is None else _pad_len(t, dim, total)


def _pad_seq_idx(seq_idx: torch.Tensor | None, total: int) -> torch.Tensor | None:
    """(b, l) -> (b, total) int32, repeating the last entry (as mamba-ssm reads the last valid token): ``seq_idx``
    itself when it already is that, else built once per seq_idx tensor (``kernels.derived``)."""
    if seq_idx is None:
        return None
    if seq_idx.dtype == torch.int32 and seq_idx.shape[1] == total and seq_idx.is_contiguous():
        return seq_idx
    return derived(seq_idx, ("padded", total),
                   lambda: _pad_seq_idx_ref(seq_idx.to(torch.int32), total).contiguous())


def _seq_end(seq_idx_padded: torch.Tensor | None, chunk_size: int) -> torch.Tensor | None:
    """(b, nc + 1) int32: column 0 is 0 (the sequence the initial state belongs to), column
    i + 1 the sequence of chunk i's last token; built once per seq_idx tensor (``kernels.derived``)."""
    if seq_idx_padded is None:
        return None

    def build():
        ends = seq_idx_padded[:, chunk_size - 1 :: chunk_size]
        return torch.cat([torch.zeros_like(ends[:, :1]), ends], dim=1).contiguous()

    return derived(seq_idx_padded, ("seq_end", chunk_size), build)


def out_buffer(b: int, L: int, h: int, p: int, like: torch.Tensor, seq_major: bool) -> torch.Tensor:
    """An uninitialised (b, L, h, p) tensor in ``like``'s dtype and device; ``seq_major``: a view of (L, b, h, p)
    memory, so that its first l positions, rearranged to (l, b, h * p), are one contiguous tensor (no copy)."""
    if seq_major:
        return torch.empty([L, b, h, p], dtype=like.dtype, device=like.device).permute(1, 0, 2, 3)
    return torch.empty([b, L, h, p], dtype=like.dtype, device=like.device)


def _contig(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


# ----------------------------------------------------------------------------------------------
# Public pieces
# ----------------------------------------------------------------------------------------------


def _check_dt(dt: torch.Tensor, A: torch.Tensor, dt_bias: torch.Tensor | None) -> tuple[int, int, int]:
    """dt (b, l, h) with A (h,) and dt_bias (h,) or None -> (b, l, h); the cumsum wrappers' input checks."""
    if dt.dim() != 3:
        raise ValueError(f"dt must be (batch, seqlen, nheads), got {tuple(dt.shape)}")
    b, l, h = dt.shape
    if A.shape != (h,):
        raise ValueError(f"A must be ({h},), got {tuple(A.shape)}")
    if dt_bias is not None and dt_bias.shape != (h,):
        raise ValueError(f"dt_bias must be ({h},), got {tuple(dt_bias.shape)}")
    return b, l, h


def ssd_chunk_cumsum_helion(
    dt: torch.Tensor,
    A: torch.Tensor,
    chunk_size: int,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dt (b, l, h), A (h,) -> (dA_cumsum, dt_out), both (b, h, nc, c) fp32 (as ``chunk_cumsum_ref``)."""
    _check_chunk(chunk_size)
    b, l, h = _check_dt(dt, A, dt_bias)
    nc = math.ceil(l / chunk_size)
    dtp = _pad_seq(dt, nc * chunk_size)  # strided zxbcdt slices are read in place
    dims = dict(b=b, l=l, h=h, c=chunk_size)
    return _run(
        "ssd_chunk_cumsum", dims, [h],
        (dtp, A.contiguous(), _contig(dt_bias), chunk_size, l, float(dt_limit[0]), float(dt_limit[1]), bool(dt_softplus)),
        config,
    )


def _check_xbc(x: torch.Tensor, B: torch.Tensor, name: str = "B") -> tuple[int, ...]:
    if x.dim() != 4 or B.dim() != 4:
        raise ValueError(f"x must be (b, l, h, p) and {name} (b, l, g, n); got {tuple(x.shape)}, {tuple(B.shape)}")
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    if B.shape[:2] != (b, l):
        raise ValueError(f"{name} {tuple(B.shape)} does not match x {tuple(x.shape)} in batch/seqlen")
    if h % g != 0:
        raise ValueError(f"nheads {h} must be a multiple of ngroups {g}")
    return b, l, h, p, g, n


def _check_initial_states(initial_states: torch.Tensor | None, b: int, h: int, p: int, n: int) -> None:
    if initial_states is not None and initial_states.shape != (b, h, p, n):
        raise ValueError(f"initial_states must be {(b, h, p, n)}, got {tuple(initial_states.shape)}")


def ssd_chunk_state_helion(
    B: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    dA_cumsum: torch.Tensor,
    seq_idx: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Per-chunk states with zero initial state: (b, nc, h, p, n) fp32 (as ``chunk_state_ref``).

    dt / dA_cumsum are the (b, h, nc, c) outputs of the cumsum piece."""
    b, l, h, p, g, n = _check_xbc(x, B)
    _, _, nc, c = dt.shape
    _check_chunk(c)
    L = nc * c
    dims = dict(b=b, l=L, h=h, p=p, g=g, n=n, c=c)
    return _run(
        "ssd_chunk_state", dims, [p, n, c],
        (_pad_seq(B, L), _pad_seq(x, L), dt.contiguous(), dA_cumsum.contiguous(),
         _pad_seq_idx(seq_idx, L)),
        config,
    )


def ssd_state_passing_helion(
    states: torch.Tensor,
    dA_chunk_cumsum: torch.Tensor,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    chunk_size: int | None = None,
    state_dtype: torch.dtype | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """states (b, nc, h, p, n) fp32, dA_chunk_cumsum (b, h, nc) -> (states_in (b, nc, h, p, n) in
    ``state_dtype`` (default states.dtype), final_states (b, h, p, n) fp32) (as ``state_passing_ref``)."""
    if states.dim() != 5:
        raise ValueError(f"states must be (b, nc, h, p, n), got {tuple(states.shape)}")
    b, nc, h, p, n = states.shape
    if dA_chunk_cumsum.shape != (b, h, nc):
        raise ValueError(f"dA_chunk_cumsum must be {(b, h, nc)}, got {tuple(dA_chunk_cumsum.shape)}")
    _check_initial_states(initial_states, b, h, p, n)
    seq_end = None
    if seq_idx is not None:
        if chunk_size is None:
            raise ValueError("ssd_state_passing_helion needs chunk_size with seq_idx")
        seq_end = _seq_end(_pad_seq_idx(seq_idx, nc * chunk_size), chunk_size)
    dim = p * n
    init = None if initial_states is None else initial_states.reshape(b, h, dim).contiguous()
    like = tuning.dtype_marker(state_dtype or states.dtype, states.device)
    states_in, final_states = _run(
        "ssd_state_passing", dict(b=b, h=h, d=dim, nc=nc), [dim],
        (states.reshape(b, nc, h, dim).contiguous(), dA_chunk_cumsum.contiguous(), init, seq_end, like),
        config,
    )
    return states_in.view(b, nc, h, p, n), final_states.view(b, h, p, n)


def ssd_chunk_state_passing_helion(
    B: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    dA_cumsum: torch.Tensor,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    state_dtype: torch.dtype | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_state + state_passing fused: -> (states_in (b, nc, h, p, n) in ``state_dtype``
    (default B.dtype... i.e. C's dtype in the combined op), final_states (b, h, p, n) fp32).

    One program per (batch, head, p-block, n-block) walks the chunks in order, computes each
    chunk's state with a GEMM and carries the running state in registers."""
    b, l, h, p, g, n = _check_xbc(x, B)
    _, _, nc, c = dt.shape
    _check_chunk(c)
    _check_initial_states(initial_states, b, h, p, n)
    L = nc * c
    sidx = _pad_seq_idx(seq_idx, L)
    like = tuning.dtype_marker(state_dtype or B.dtype, x.device)
    dims = dict(b=b, l=L, h=h, p=p, g=g, n=n, c=c)
    return _run(
        "ssd_chunk_state_passing", dims, [p, n, c],
        (_pad_seq(B, L), _pad_seq(x, L), dt.contiguous(), dA_cumsum.contiguous(),
         _contig(initial_states), sidx, _seq_end(sidx, c), like),
        config,
    )


def ssd_cumsum_states_helion(
    B: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    chunk_size: int,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    state_dtype: torch.dtype | None = None,
    state_passing: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dA_cumsum, dt_out, states_in, final_states): chunk_cumsum then chunk_state_passing.

    dt (b, l, h) is the raw dt (strided slices are read in place); B (b, l, g, n), x (b, l, h, p) and seq_idx may have
    length l or already be padded to nc * c; A, dt_bias, dt_softplus, dt_limit as ``ssd_chunk_cumsum_helion``;
    initial_states, state_dtype as ``ssd_chunk_state_passing_helion``; ``state_passing`` as ``ssd_states_helion``."""
    dA_cumsum, dt_out = ssd_chunk_cumsum_helion(dt, A, chunk_size, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                                dt_limit=dt_limit)
    states_in, final_states = ssd_states_helion(
        B, x, dt_out, dA_cumsum, initial_states=initial_states, seq_idx=seq_idx, state_dtype=state_dtype,
        state_passing=state_passing)
    return dA_cumsum, dt_out, states_in, final_states


# "auto" state passing without tuned times for both paths: the fused kernel's programs at 64 x 64 (headdim x dstate)
# blocks, the blocks of its tuned sm90 configs, against the GPU's SMs. Its tuned times on one H200 (kernels/configs/
# sm90) are larger than the split path's at 1 x 8192 with 8 and 16 heads (16 and 32 programs: 72 vs 37 and 52 us) and
# smaller from 32 heads on (64 programs and more: 70 vs 77 us at 32 heads, 106 vs 242 us at 2 x 8192 with 64 heads),
# except at 80 heads in chunks of 256 (160 programs: 117 vs 104 us), where the tuned times decide.
FUSED_STATE_BLOCK = 64
AUTO_SPLIT_BELOW_SM_FRACTION = 1 / 3


def fused_state_programs(b: int, h: int, p: int, n: int) -> int:
    """The programs of ``ssd_chunk_state_passing`` at (headdim, dstate) blocks of ``FUSED_STATE_BLOCK``: one per
    (batch, head, headdim block, dstate block); each walks all the chunks in order."""
    blk = FUSED_STATE_BLOCK
    return b * h * -(-p // blk) * -(-n // blk)


def choose_state_passing(state_passing: str, dims: dict[str, int], *, arch: str, sm_count: int | None,
                         root=None, cache_root=None) -> tuple[bool, str]:
    """``(fused, why)``: whether the chunk states at ``dims`` (b, l (padded), h, p, g, n, c) run as the fused
    ``ssd_chunk_state_passing`` or as ``ssd_chunk_state`` then ``ssd_state_passing``
    (``HelionSettings.state_passing``). "fused" / "split" decide; "auto" compares the tuned times of the exact
    configs of the three kernels (committed files under ``root``, else the user cache ``cache_root``) where all three
    have one, else splits where the fused kernel has fewer programs (``fused_state_programs``) than
    ``AUTO_SPLIT_BELOW_SM_FRACTION`` of ``sm_count`` SMs; without a GPU (``sm_count`` None) fused."""
    if state_passing not in STATE_PASSING_CHOICES:
        raise ValueError(f"state_passing={state_passing!r}; choose one of {', '.join(STATE_PASSING_CHOICES)}")
    if state_passing != "auto":
        return state_passing == "fused", f"kernels.helion.state_passing={state_passing}"
    b, L, h, p, n, c = (dims[k] for k in ("b", "l", "h", "p", "n", "c"))
    times = [tuning.tuned_time_ms(name, kd, arch, root, cache_root) for name, kd in (
        ("ssd_chunk_state_passing", dims), ("ssd_chunk_state", dims),
        ("ssd_state_passing", dict(b=b, h=h, d=p * n, nc=L // c)))]
    if None not in times:
        t_f, t_cs, t_sp = (t * 1e3 for t in times)
        fused = t_f <= t_cs + t_sp
        return fused, f"tuned times: fused {t_f:.1f} us, split {t_cs:.1f} + {t_sp:.1f} us"
    if sm_count is None:
        return True, "no GPU: the fused kernel"
    progs = fused_state_programs(b, h, p, n)
    fused = progs >= AUTO_SPLIT_BELOW_SM_FRACTION * sm_count
    return fused, (f"no tuned times for both paths; the fused kernel's {progs} programs are "
                   f"{'at least' if fused else 'fewer than'} a third of {sm_count} SMs")


def _state_key(dims: dict[str, int], on_gpu: bool) -> tuple:
    """The runtime's ``decisions`` key of a shape: plain ints, cheap to build on every call."""
    return ("state_passing", on_gpu, *(dims[k] for k in ("b", "l", "h", "p", "g", "n", "c")))


def state_passing_taken(settings, dims: dict[str, int]) -> str | None:
    """"fused" or "split": the path the runtime of ``settings`` (a ``HelionSettings``) took at ``dims`` (b, l
    (padded), h, p, g, n, c) on this process's device, or None where it has not run there (what benchmarks record)."""
    if settings.state_passing != "auto":
        return settings.state_passing
    on_gpu = torch.cuda.is_available() and not tuning.interpret_mode()
    fused = tuning.runtime_for(settings).decisions.get(_state_key(dims, on_gpu))
    return None if fused is None else ("fused" if fused else "split")


def _fused_states_here(state_passing: str | None, B: torch.Tensor, x: torch.Tensor, dt: torch.Tensor) -> bool:
    """``choose_state_passing`` for this call (``state_passing`` None: the current runtime's setting), decided once
    per shape and runtime (the forward and the backward's recompute take the same path); an "auto" decision on a GPU
    is said once per shape."""
    rt = tuning.runtime()
    if state_passing is None:
        state_passing = rt.settings.state_passing
    if state_passing != "auto":
        return choose_state_passing(state_passing, {}, arch="", sm_count=None)[0]
    _, _, nc, c = dt.shape
    on_gpu = x.is_cuda and not tuning.interpret_mode()
    dims = dict(b=x.shape[0], l=nc * c, h=x.shape[2], p=x.shape[3], g=B.shape[2], n=B.shape[3], c=c)
    key = _state_key(dims, on_gpu)
    fused = rt.decisions.get(key)
    if fused is None:
        arch = tuning.current_arch() if on_gpu else "cpu"
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if on_gpu else None
        fused, why = choose_state_passing("auto", dims, arch=arch, sm_count=sms, cache_root=rt.cache_root)
        rt.decisions[key] = fused
        if on_gpu:
            sk = tuning.shape_key(**dims)
            tuning.warn_once("ssd_states", f"auto:{sk}",
                             f"{STATE_PASSING_NOTICE} {sk}: {'fused' if fused else 'split'} "
                             f"({why}; kernels.helion.state_passing=auto)")
    return fused


def ssd_states_helion(
    B: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    dA_cumsum: torch.Tensor,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    state_dtype: torch.dtype | None = None,
    state_passing: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(states_in (b, nc, h, p, n) in ``state_dtype``, final_states (b, h, p, n) fp32) from the cumsum piece's
    dt / dA_cumsum (b, h, nc, c): ``ssd_chunk_state_passing_helion`` (one kernel, ``state_passing="fused"``), or
    ``ssd_chunk_state_helion`` then ``ssd_state_passing_helion`` (two kernels, the per-chunk states in fp32 between
    them, ``"split"``); ``"auto"`` chooses per shape (``choose_state_passing``); None: the setting of the runtime the
    call runs in (``tuning.use``; the defaults' outside one)."""
    if _fused_states_here(state_passing, B, x, dt):
        return ssd_chunk_state_passing_helion(B, x, dt, dA_cumsum, initial_states=initial_states, seq_idx=seq_idx,
                                              state_dtype=state_dtype)
    states = ssd_chunk_state_helion(B, x, dt, dA_cumsum, seq_idx=seq_idx)
    return ssd_state_passing_helion(states, dA_cumsum[..., -1], initial_states=initial_states, seq_idx=seq_idx,
                                    chunk_size=dt.shape[-1], state_dtype=state_dtype or B.dtype)


def ssd_bmm_chunk_helion(
    C: torch.Tensor,
    B: torch.Tensor,
    chunk_size: int,
    seq_idx: torch.Tensor | None = None,
    config: dict | None = None,
    cb_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """CB[b, nc, g, t, s] = C[t] . B[s] per chunk and group, zero across sequences (as ``bmm_chunk_ref``);
    fp32-accumulated, stored in ``cb_dtype`` (fp32, as mamba-ssm; the inputs' 16-bit dtype for the forward's
    chunk_scan, ``forward_cb_dtype``)."""
    _check_chunk(chunk_size)
    if C.dim() != 4 or C.shape != B.shape:
        raise ValueError(f"C and B must both be (b, l, g, n); got {tuple(C.shape)}, {tuple(B.shape)}")
    b, l, g, n = C.shape
    nc = math.ceil(l / chunk_size)
    L = nc * chunk_size
    return _run(
        "ssd_bmm_chunk", dict(b=b, l=L, g=g, n=n, c=chunk_size), [chunk_size, chunk_size, n],
        (_pad_seq(C, L), _pad_seq(B, L), _pad_seq_idx(seq_idx, L), chunk_size,
         tuning.dtype_marker(cb_dtype, C.device)),
        config,
    )


def ssd_chunk_pieces_helion(
    B: torch.Tensor,
    x: torch.Tensor,
    C: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    chunk_size: int,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    state_dtype: torch.dtype | None = None,
    cumsum: tuple[torch.Tensor, torch.Tensor] | None = None,
    cb_dtype: torch.dtype = torch.float32,
    state_passing: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Everything chunk_scan and the backward read: (dA_cumsum, dt_out, states_in, final_states, CB) from the chunk
    cumsum, chunk_state_passing and the bmm. Arguments as ``ssd_cumsum_states_helion`` plus C (b, l, g, n).
    ``cumsum``: (dA_cumsum, dt_out) kept from the forward (the fused op's backward): only chunk_state_passing and the
    bmm run. CB is in ``cb_dtype``."""
    if cumsum is not None:
        dA_cumsum, dt_out = cumsum
        states_in, final_states = ssd_states_helion(
            B, x, dt_out, dA_cumsum, initial_states=initial_states, seq_idx=seq_idx, state_dtype=state_dtype,
            state_passing=state_passing)
    else:
        dA_cumsum, dt_out, states_in, final_states = ssd_cumsum_states_helion(
            B, x, dt, A, chunk_size, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
            initial_states=initial_states, seq_idx=seq_idx, state_dtype=state_dtype,
            state_passing=state_passing)
    CB = ssd_bmm_chunk_helion(C, B, chunk_size, seq_idx=seq_idx, cb_dtype=cb_dtype)
    return dA_cumsum, dt_out, states_in, final_states, CB


def ssd_chunk_scan_helion(
    CB: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    dA_cumsum: torch.Tensor,
    C: torch.Tensor,
    states_in: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    config: dict | None = None,
    seq_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, out_x) (b, l, h, p) in x.dtype; out = out_x * silu(z) with z, else out_x is out
    (as ``chunk_scan_ref``). CB is in ``forward_cb_dtype(x.dtype)``. ``seq_major``: out and out_x are (b, l, h, p)
    views of (l, b, h, p) memory (``out_buffer``), the layout of Megatron's activations."""
    b, l, h, p, g, n = _check_xbc(x, C, "C")
    _, nc, _, c, _ = CB.shape
    _check_chunk(c)
    if CB.shape != (b, nc, g, c, c):
        raise ValueError(f"CB must be {(b, nc, g, c, c)}, got {tuple(CB.shape)}")
    if states_in.shape != (b, nc, h, p, n):
        raise ValueError(f"states_in must be {(b, nc, h, p, n)}, got {tuple(states_in.shape)}")
    if D is not None and D.shape not in ((h,), (h, p)):
        raise ValueError(f"D must be ({h},) or ({h}, {p}), got {tuple(D.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must be {tuple(x.shape)}, got {tuple(z.shape)}")
    L = nc * c
    sidx = _pad_seq_idx(seq_idx, L)
    D2 = None if D is None else (D.contiguous() if D.dim() == 2 else D.reshape(h, 1).expand(h, p))
    dims = dict(b=b, l=L, h=h, p=p, g=g, n=n, c=c)
    want = forward_cb_dtype(x.dtype)
    if CB.dtype != want:
        raise ValueError(f"chunk_scan reads CB in {want} for x in {x.dtype}, got {CB.dtype} "
                         "(ssd_bmm_chunk_helion's cb_dtype; forward_cb_dtype)")
    out = out_buffer(b, L, h, p, x, seq_major)
    out_x = out if z is None else out_buffer(b, L, h, p, x, seq_major)
    out, out_x = _run(
        _chunk_scan_name(x.dtype), dims, [c, p, c],
        (CB.contiguous(), _pad_seq(x, L), dt.contiguous(), dA_cumsum.contiguous(), _pad_seq(C, L),
         states_in.contiguous(), D2, _pad_seq(z, L), sidx, _seq_end(sidx, c), out, out_x),
        config,
    )
    if L != l:
        out, out_x = out[:, :l], out_x[:, :l]
    return out, out_x


# ----------------------------------------------------------------------------------------------
# Whole forward
# ----------------------------------------------------------------------------------------------


def ssd_forward_helion(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    state_dtype: torch.dtype | None = None,
    state_passing: str | None = None,
    seq_major: bool = False,
    return_cb: bool = False,
) -> tuple[torch.Tensor, ...]:
    """All forward pieces, like mamba-ssm's ``_mamba_chunk_scan_combined_fwd``:
    (out, out_x, dt_out, dA_cumsum, states_in, final_states), and with ``return_cb`` the C·Bᵀ the chunk scan read
    ((b, nc, g, c, c), zero across sequences; ``forward_cb_dtype`` of x's dtype) last.

    x (b, l, h, p), dt (b, l, h), A (h,), B/C (b, l, g, n), D (h,) or (h, p), z like x,
    dt_bias (h,), initial_states (b, h, p, n), seq_idx (b, l). ``out_x`` is ``out`` when z is None.
    dt's length is the sequence length l; x, B, C, z and seq_idx may each have length l or, already padded, nc * c
    (``padded_len``; the padded rows are never read into a valid position or the final state). out and out_x
    have x's length.
    states_in is in ``state_dtype`` or C.dtype; final_states, dt_out, dA_cumsum fp32.
    ``state_passing``: chunk_state and state_passing as one kernel ("fused"), as two (the per-chunk fp32 states go
    through memory, "split"), or chosen per shape ("auto"); None takes the runtime's setting (``ssd_states_helion``).
    ``seq_major``: out and out_x in (l, b)
    memory order (``ssd_chunk_scan_helion``)."""
    _check_chunk(chunk_size)
    if x.dim() != 4 or B.dim() != 4 or dt.dim() != 3:
        raise ValueError(f"x must be (b, l, h, p), B (b, l, g, n) and dt (b, l, h); got {tuple(x.shape)}, "
                         f"{tuple(B.shape)}, {tuple(dt.shape)}")
    b, lx, h, p = x.shape
    g, n = B.shape[2:]
    l = dt.shape[1]
    L = padded_len(l, chunk_size)
    if dt.shape != (b, l, h) or lx not in (l, L):
        raise ValueError(f"dt must be {(b, lx, h)} (x's batch, length and heads), got {tuple(dt.shape)}")
    if h % g != 0:
        raise ValueError(f"nheads {h} must be a multiple of ngroups {g}")
    _check_lengths(l, L, B=B, C=C, z=z, seq_idx=seq_idx)
    if (B.shape[0], *B.shape[2:]) != (b, g, n) or C.dim() != 4 or (C.shape[0], *C.shape[2:]) != (b, g, n) \
            or (z is not None and (z.dim() != 4 or (z.shape[0], *z.shape[2:]) != (b, h, p))):
        raise ValueError(f"B {tuple(B.shape)} and C {tuple(C.shape)} must be (b, l, g, n), z "
                         f"{None if z is None else tuple(z.shape)} (b, l, h, p) like x {tuple(x.shape)}")
    # Pad once here so the pieces below see l == nc * c and copy nothing.
    xp, Bp, Cp, zp = (_pad_seq(t, L) for t in (x, B, C, z))
    sidx = _pad_seq_idx(seq_idx, L)
    sdtype = state_dtype or C.dtype
    dA_cumsum, dt_out, states_in, final_states, CB = ssd_chunk_pieces_helion(
        Bp, xp, Cp, dt, A, chunk_size, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
        initial_states=initial_states, seq_idx=sidx, state_dtype=sdtype, cb_dtype=forward_cb_dtype(x.dtype),
        state_passing=state_passing,
    )
    out, out_x = ssd_chunk_scan_helion(CB, xp, dt_out, dA_cumsum, Cp, states_in, D=D, z=zp, seq_idx=sidx,
                                       seq_major=seq_major)
    if lx != L:
        out, out_x = out[:, :lx], out_x[:, :lx]
    if return_cb:
        return out, out_x, dt_out, dA_cumsum, states_in, final_states, CB
    return out, out_x, dt_out, dA_cumsum, states_in, final_states


def mamba_chunk_scan_combined_helion(
    x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
    cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
    return_varlen_states=False, state_dtype=None,
):
    """Forward-only drop-in for mamba-ssm's ``mamba_chunk_scan_combined`` (no autograd)."""
    if cu_seqlens is not None:
        raise NotImplementedError("mamba_chunk_scan_combined_helion: cu_seqlens (varlen states) is not supported")
    if return_varlen_states:
        raise NotImplementedError("mamba_chunk_scan_combined_helion: return_varlen_states is not supported")
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, dt, A, B, C, D, z, dt_bias, initial_states)
    ):
        raise NotImplementedError("mamba_chunk_scan_combined_helion is forward-only (inputs that require grad); the "
                                  "training path's backward is mamba_split_conv1d_scan_combined's")
    if x.dim() == 4 and B.dim() == 4:
        from kernels.shapes import check_supported

        check_supported(nheads=x.shape[2], headdim=x.shape[3], ngroups=B.shape[2], dstate=B.shape[3],
                        chunk_size=chunk_size, dtype=x.dtype, seq_idx=seq_idx, batch=x.shape[0], seqlen=x.shape[1],
                        op="mamba_chunk_scan_combined_helion")
    out, _, _, _, _, final_states = ssd_forward_helion(
        x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
        seq_idx=seq_idx, dt_softplus=dt_softplus, dt_limit=dt_limit, state_dtype=state_dtype,
    )
    return (out, final_states) if return_final_states else out


# ----------------------------------------------------------------------------------------------
# Tuning registry (scripts/tune_kernels.py): model dims (b, l, h, p, g, n, c) -> TuneCase
# ----------------------------------------------------------------------------------------------


def example_inputs(md: dict, device: Any, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Realistic SSD inputs at model dims ``md`` (Megatron-like dt/A ranges, seq_idx=None)."""
    b, l, h, p, g, n = (md[k] for k in ("b", "l", "h", "p", "g", "n"))
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    return dict(
        x=rn(b, l, h, p), z=rn(b, l, h, p), B=rn(b, l, g, n, scale=0.3), C=rn(b, l, g, n, scale=0.3),
        dt=rn(b, l, h, scale=0.5) - 2.0,
        A=-torch.exp(torch.rand(h, generator=gen) * math.log(16.0)).to(device),  # A_log init range [1, 16]
        dt_bias=(torch.rand(h, generator=gen) * 2 - 4).to(device), D=torch.ones(h, device=device),
    )


def _kernel_args(name: str, md: dict, device: Any) -> tuple[tuple, dict]:
    """(args, kernel dims) exactly as the wrappers pass them at model dims ``md``."""
    c = md["c"]
    inp = example_inputs(md, device)
    b, l, h, p, g, n = (md[k] for k in ("b", "l", "h", "p", "g", "n"))
    L = math.ceil(l / c) * c
    nc = L // c
    if name == "ssd_chunk_cumsum":
        # dt as the fused op passes it: the last h columns of the in_proj output zxBCdt (rows of
        # 2*h*p + 2*g*n + h elements), read in place
        row = 2 * h * p + 2 * g * n + h
        zx = torch.zeros(b, L, row, device=device, dtype=inp["dt"].dtype)
        zx[:, :l, row - h:] = inp["dt"]
        dts = zx[..., row - h:]
        return (dts, inp["A"], inp["dt_bias"], c, l, 0.0, float("inf"), True), dict(b=b, l=l, h=h, c=c)
    dA, dto = ssd_chunk_cumsum_helion(inp["dt"], inp["A"], c, dt_bias=inp["dt_bias"], dt_softplus=True) if not tuning.interpret_mode() and device != "cpu" else (None, None)
    if dA is None:  # CPU (code generation checks): values do not matter
        dto = torch.rand(b, h, nc, c, device=device) * 0.1
        dA = torch.cumsum(-dto, dim=-1)
    Bp, Cp, xp = (_pad_seq(inp[k], L).contiguous() for k in ("B", "C", "x"))
    kd = dict(b=b, l=L, h=h, p=p, g=g, n=n, c=c)
    if name == "ssd_chunk_state":
        return (Bp, xp, dto, dA, None), kd
    if name == "ssd_chunk_state_passing":
        return (Bp, xp, dto, dA, None, None, None, torch.empty(0, device=device, dtype=Cp.dtype)), kd
    if name == "ssd_state_passing":
        st = torch.randn(b, nc, h, p * n, device=device) * 0.1
        return (st, dA[..., -1].contiguous(), None, None, torch.empty(0, device=device, dtype=Cp.dtype)), dict(b=b, h=h, d=p * n, nc=nc)
    if name == "ssd_bmm_chunk":
        return (Cp, Bp, None, c, torch.empty(0, device=device)), dict(b=b, l=L, g=g, n=n, c=c)
    if name in ("ssd_chunk_scan", "ssd_chunk_scan_cb16"):
        CB = torch.randn(b, nc, g, c, c, device=device) * 0.3
        if name == "ssd_chunk_scan_cb16":
            CB = CB.to(Cp.dtype)
        st = (torch.randn(b, nc, h, p, n, device=device) * 0.1).to(Cp.dtype)
        D2 = inp["D"].reshape(h, 1).expand(h, p)
        # the outputs as the fused training op allocates them: in the (l, b) order of Megatron's activations
        out, out_x = (out_buffer(b, L, h, p, xp, seq_major=True) for _ in range(2))
        return (CB, xp, dto, dA, Cp, st, D2, _pad_seq(inp["z"], L).contiguous(), None, None, out, out_x), kd
    raise KeyError(name)


# Seeds: partial configs layered over Helion's default by tuner.candidate_configs; each list
# includes the conservative defaults above, so a safe config is always among the candidates.
_SEEDS: dict[str, list[dict]] = {
    # mamba-ssm's autotune picked BLOCK_SIZE_H 8 at 4 warps for the Nano shape (8.0 us in its do_bench): first
    "ssd_chunk_cumsum": [dict(block_sizes=[bh], num_warps=w) for bh in (8, 16, 4, 32, 2, 64, 1) for w in (4, 2, 1, 8)],
    "ssd_chunk_state": [
        dict(block_sizes=[bm, bn, bk], num_warps=w, num_stages=st)
        for bm, bn in ((64, 64), (64, 128), (32, 64), (64, 32), (32, 128))
        for bk in (32, 64, 128) for w in (4, 8) for st in (2, 3)
    ],
    "ssd_state_passing": [dict(block_sizes=[bs], num_warps=w) for bs in (128, 256, 512, 1024, 2048) for w in (2, 4, 8)] + [
        # the chunk loop software-pipelined (the loads of states do not depend on the carried state) and
        # states streamed through L2 once (eviction "first"); the loads are [dA_last, states]
        dict(block_sizes=[bs], num_warps=w, range_num_stages=[0, st], load_eviction_policies=["", ev])
        for bs in (1024, 2048, 512) for w in (4, 8) for st in (2, 3) for ev in ("first", "")
    ],
    "ssd_chunk_state_passing": [
        dict(block_sizes=[bm, bn, bk], num_warps=w, num_stages=st)
        for bm, bn in ((32, 64), (64, 64), (16, 64), (32, 32), (16, 128), (32, 128), (64, 128))
        for bk in (32, 64, 128) for w in (4, 8) for st in (2, 3)
    ],
    "ssd_bmm_chunk": [
        dict(block_sizes=[bm, bn, bk], num_warps=w, num_stages=st)
        for bm, bn in ((64, 64), (128, 64), (64, 128), (128, 128)) for bk in (32, 64, 128) for w in (4, 8) for st in (2, 3)
    ],
    "ssd_chunk_scan": [
        dict(block_sizes=[bm, bn, bk], num_warps=w, num_stages=st)
        for bm, bn in ((64, 64), (128, 64), (32, 64), (64, 32), (128, 32))
        for bk in (32, 64) for w in (4, 8) for st in (1, 2, 3)
    ],
    # chunk_scan's committed config first (its search's best with an fp32 CB)
    "ssd_chunk_scan_cb16": [dict(block_sizes=[64, 64, 32], num_warps=4, num_stages=1)] + [
        dict(block_sizes=[bm, bn, bk], num_warps=w, num_stages=st)
        for bm, bn in ((64, 64), (128, 64), (32, 64), (64, 32), (128, 32))
        for bk in (32, 64) for w in (4, 8) for st in (1, 2, 3)
    ],
}


def _tune_case(name: str):
    def build(md: dict, device: Any):
        args, kd = _kernel_args(name, md, device)
        seeds = [DEFAULT_CONFIGS[name]] + [s for s in _SEEDS[name] if s != DEFAULT_CONFIGS[name]]
        # CB/states in chunk_scan and the long serial sums are fp32-accumulated; bf16 outputs.
        return tuner.TuneCase(
            kernel=get_kernel(name), args=args, dims=kd, default=DEFAULT_CONFIGS[name], seeds=seeds,
            atol=2e-2, rtol=2e-2, n_random=8,
        )

    return build


def _kernel_dims(name: str, md: dict) -> dict:
    """The kernel dims ``_kernel_args`` gives kernel ``name`` at model dims ``md`` (nothing allocated or run)."""
    b, l, h, p, g, n, c = (md[k] for k in ("b", "l", "h", "p", "g", "n", "c"))
    L = padded_len(l, c)
    if name == "ssd_chunk_cumsum":
        return dict(b=b, l=l, h=h, c=c)
    if name == "ssd_state_passing":
        return dict(b=b, h=h, d=p * n, nc=L // c)
    if name == "ssd_bmm_chunk":
        return dict(b=b, l=L, g=g, n=n, c=c)
    if name in ("ssd_chunk_state", "ssd_chunk_state_passing", "ssd_chunk_scan", "ssd_chunk_scan_cb16"):
        return dict(b=b, l=L, h=h, p=p, g=g, n=n, c=c)
    raise KeyError(name)


TUNABLE_KERNELS = {name: tuner.TunableKernel(_tune_case(name), functools.partial(_kernel_dims, name))
                   for name in _BODIES}
