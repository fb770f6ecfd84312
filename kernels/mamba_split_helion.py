"""The fused Mamba-2 training op with the Helion SSD: split -> causal conv1d -> SSD (+z gate).

``mamba_split_conv1d_scan_combined_helion`` has mamba-ssm 2.3.2's ``mamba_split_conv1d_scan_combined``
signature. Its forward saves what mamba-ssm's ``MambaSplitConv1dScanCombinedFn`` saves (zxbcdt, the conv
weight/bias, out_x, dt_bias, A, D, initial_states / seq_idx), the two small fp32 (b, h, l) tensors dA_cumsum and
dt_out (``HelionSettings.save_cumsum``) and, by default (``HelionSettings.save_conv_states``), the conv output and
the states entering each chunk: the backward then recomputes only C.B^T (in fp32, as mamba-ssm; with
``HelionSettings.save_cb`` it reads the forward's, in x's dtype, instead) and runs the Helion backward of
``kernels/ssd_helion_bwd.py``. With save_conv_states off the forward keeps neither and the backward
recomputes the conv and chunk_state+state_passing (in ``HelionSettings.bwd_states_dtype``), as mamba-ssm does: less
activation memory, bitwise the same gradients.
``settings`` (a ``kernels.settings.HelionSettings``; the backend binds its own) picks those dtypes and options.

With ``rmsnorm_weight`` the gated RMSNorm runs inside the op, as in mamba-ssm: the SSD's output stays ungated
(the chunk scan reads no z and writes one output), the norm reads it with z, and its backward writes dz into
d_zxbcdt and hands the SSD backward the ungated output's gradient (``ssd_bwd_dstates`` instead of
``ssd_bwd_dz_dstates``). Megatron's mixer passes it with ``model.mamba_fused_norm``; by default the norm runs as its
own module after the op. ``outproj_weight`` raises NotImplementedError.

Everything runs on Helion kernels (conv1d fwd/bwd of ``kernels/causal_conv1d_helion.py``, the SSD
forward pieces and backward). Around them the op only takes views: z, xBC, dt are strided slices of
zxbcdt and x, B, C slices of the conv output, passed to the kernels as they are (no ``.contiguous()``
copies, no fp32 casts); the backward allocates d_zxbcdt once and the kernels write dz, dxBC (conv
backward) and ddt straight into its slices, as mamba-ssm does (no ``torch.cat``).
Layouts follow zxbcdt's: when it is a (b, l, d) view of (l, b, d) memory (Megatron's in_proj output, transposed),
y is one too (``seq_major``), so Megatron's ``rearrange(y, "b l d -> l b d").contiguous()`` copies nothing, and d_zxbcdt
has zxbcdt's strides; the incoming gradient is read in whatever layout it arrives with a unit last stride.
A length that is not a multiple of the chunk is padded once: zxbcdt is copied into a zero-tailed nc * c long buffer in
its own layout, the conv and the SSD run on that buffer's slices (dt keeps its length l, so the tail changes no state
and gets no gradient); the backward pads the incoming gradient the same way, writes into a padded d_zxbcdt and
returns its first l rows.
What is left outside
the kernels: the deterministic sums of per-program partials (dweight, dbias, dA, dD, ddt_bias) and the
small mask/zero tensors of the SSD backward (``tests/test_mamba_split_helion.py::test_op_count_fused_path``
holds the count: 5 Helion kernels forward, 10 backward).
"""

from __future__ import annotations

import torch

from kernels import tuning
from kernels.causal_conv1d_helion import causal_conv1d_bwd_helion, causal_conv1d_fwd_helion
from kernels.mamba_split import split_dims
from kernels.rmsnorm_gated_helion import rmsnorm_gated_bwd_helion, rmsnorm_gated_fwd_helion
from kernels.settings import HelionSettings
from kernels.shapes import check_supported, padded_len
from kernels.ssd_helion import (_pad_seq_idx, ssd_bmm_chunk_helion, ssd_chunk_cumsum_helion, ssd_chunk_pieces_helion,
                                ssd_forward_helion)
from kernels.ssd_helion_bwd import ssd_backward_helion


def _conv_fwd(xBC: torch.Tensor, weight, bias, seq_idx, activation) -> torch.Tensor:
    """xBC (b, l, d) (a strided zxbcdt slice) -> act(conv(xBC)) (b, l, d) contiguous (Helion kernel)."""
    return causal_conv1d_fwd_helion(xBC.transpose(1, 2), weight, bias, seq_idx, activation).transpose(1, 2)


def seq_major(t: torch.Tensor) -> bool:
    """Whether (b, l, d) ``t`` is a view of (l, b, d) memory (Megatron's activation layout), batch 2 and up."""
    return t.shape[0] > 1 and t.shape[1] > 1 and t.stride(0) < t.stride(1)


def _rows(t: torch.Tensor, sm: bool) -> torch.Tensor:
    """(b, L, ...) -> its rows in memory order: the (L, b, ...) view when ``sm`` (seq-major), else ``t``. The gated
    norm works per row, so x, z, dy and their results only need one row order, and these views are reshaped to
    (rows, groups, group) without a copy."""
    return t.transpose(0, 1) if sm else t


def pad_rows(t: torch.Tensor, total: int) -> torch.Tensor:
    """(b, l, d) -> (b, total, d) with zero rows after l, in t's memory order ((l, b, d) stays (l, b, d)); t itself
    when l == total."""
    b, l, d = t.shape
    if l == total:
        return t
    out = t.new_empty(total, b, d).transpose(0, 1) if seq_major(t) else t.new_empty(b, total, d)
    out[:, :l] = t
    out[:, l:] = 0
    return out


class MambaSplitConv1dScanCombinedHelionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states, seq_idx,
                dt_limit, return_final_states, activation, headdim, ngroups, settings, rmsnorm_weight, rmsnorm_eps,
                norm_before_gate):
        with tuning.use(settings):
            return MambaSplitConv1dScanCombinedHelionFn._forward(
                ctx, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states, seq_idx, dt_limit,
                return_final_states, activation, headdim, ngroups, settings, rmsnorm_weight, rmsnorm_eps,
                norm_before_gate)

    @staticmethod
    def _forward(ctx, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states, seq_idx,
                 dt_limit, return_final_states, activation, headdim, ngroups, settings, rmsnorm_weight, rmsnorm_eps,
                 norm_before_gate):
        nheads, headdim, dim, dstate = split_dims(zxbcdt, conv1d_weight, D, headdim, ngroups)
        if activation not in ("silu", "swish", None):
            raise ValueError(f"activation must be 'silu', 'swish' or None, got {activation!r}")
        b, l, _ = zxbcdt.shape
        L = padded_len(l, chunk_size)
        zxbcdt = pad_rows(zxbcdt, L)
        seq_idx_padded = _pad_seq_idx(seq_idx, L)  # what the conv reads; the SSD takes it as it is
        z, xBC, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
        xBC_conv = _conv_fwd(xBC, conv1d_weight, conv1d_bias, seq_idx_padded, activation)
        x, B, C = torch.split(xBC_conv, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
        norm = rmsnorm_weight is not None  # the gate belongs to the norm: the SSD's output is not gated
        sm = seq_major(zxbcdt)
        out, out_x, dt_out, dA_cumsum, states_in, final_states, CB = ssd_forward_helion(
            x.reshape(b, L, nheads, headdim), dt[:, :l], A, B.reshape(b, L, ngroups, dstate),
            C.reshape(b, L, ngroups, dstate), chunk_size, D=D, z=None if norm else z.reshape(b, L, nheads, headdim),
            dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx_padded, dt_softplus=True,
            dt_limit=dt_limit, state_passing=settings.state_passing, seq_major=sm, return_cb=True,
        )
        rstd = None
        if norm:  # y = rmsnorm(out_x * silu(z)) * w (or rmsnorm(out_x) * w * silu(z)), over row-major views
            out, rstd = rmsnorm_gated_fwd_helion(
                _rows(out_x.reshape(b, L, dim), sm), rmsnorm_weight, z=_rows(z, sm), eps=rmsnorm_eps,
                group_size=dim // ngroups, norm_before_gate=norm_before_gate)
            out = _rows(out, sm)
        ctx.settings = settings
        if not settings.save_cumsum:
            dt_out = dA_cumsum = None
        if not settings.save_conv_states:
            xBC_conv = states_in = None
        if not settings.save_cb:
            CB = None
        # zxbcdt, out_x and seq_idx padded (when l is not a chunk multiple): the backward pads none of them again
        ctx.save_for_backward(zxbcdt, conv1d_weight, conv1d_bias, out_x, A, D, dt_bias, initial_states,
                              seq_idx_padded, dt_out, dA_cumsum, xBC_conv, states_in, CB, rmsnorm_weight, rstd)
        ctx.norm = (rmsnorm_weight is not None, norm_before_gate)
        ctx.dims = (nheads, headdim, dim, dstate, ngroups, chunk_size, l)
        ctx.dt_limit = dt_limit
        ctx.activation = activation
        ctx.return_final_states = return_final_states
        out = out[:, :l].reshape(b, l, dim)
        return (out, final_states) if return_final_states else out

    @staticmethod
    def backward(ctx, dout, *args):
        with tuning.use(ctx.settings):  # autograd runs this on its own thread: the runtime is entered again
            return MambaSplitConv1dScanCombinedHelionFn._backward(ctx, dout, *args)

    @staticmethod
    def _backward(ctx, dout, *args):
        (zxbcdt, conv1d_weight, conv1d_bias, out_x, A, D, dt_bias, initial_states, seq_idx, dt_out,
         dA_cumsum, xBC_conv, states_in, CB, rmsnorm_weight, rstd) = ctx.saved_tensors
        norm, norm_before_gate = ctx.norm
        nheads, headdim, dim, dstate, ngroups, chunk_size, l = ctx.dims
        dfinal = args[0] if ctx.return_final_states else None
        b, L, _ = zxbcdt.shape  # padded to the chunk (l valid rows)
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dout = pad_rows(dout, L)  # in its own memory order (Megatron's (l, b, d) stays a plain copy)
        splits = [dim, dim + 2 * ngroups * dstate, nheads]
        z, xBC, dt = torch.split(zxbcdt, splits, dim=-1)
        dt = dt[:, :l]
        if xBC_conv is None:  # recompute (save_conv_states keeps it from the forward)
            xBC_conv = _conv_fwd(xBC, conv1d_weight, conv1d_bias, seq_idx, ctx.activation)
        x, B, C = torch.split(xBC_conv, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
        x = x.reshape(b, L, nheads, headdim)
        B = B.reshape(b, L, ngroups, dstate)
        C = C.reshape(b, L, ngroups, dstate)
        if states_in is None:
            dA_cumsum, dt_out, states_in, _, CB = ssd_chunk_pieces_helion(
                B, x, C, dt, A, chunk_size, dt_bias=dt_bias, dt_softplus=True, dt_limit=ctx.dt_limit,
                initial_states=initial_states, seq_idx=seq_idx,
                state_dtype=torch.float32 if ctx.settings.bwd_states_dtype == "fp32" else x.dtype,
                cumsum=None if dA_cumsum is None else (dA_cumsum, dt_out),
                state_passing=ctx.settings.state_passing)
        else:  # the forward's states (x's dtype, as bwd_states_dtype=input recomputes them): only C.B^T runs
            if dA_cumsum is None:
                dA_cumsum, dt_out = ssd_chunk_cumsum_helion(dt, A, chunk_size, dt_bias=dt_bias, dt_softplus=True,
                                                            dt_limit=ctx.dt_limit)
            if CB is None:  # recompute in fp32 (save_cb keeps the forward's, in x's dtype)
                CB = ssd_bmm_chunk_helion(C, B, chunk_size, seq_idx=seq_idx, cb_dtype=torch.float32)
        # d_zxbcdt is allocated once; its z / dt slices and the conv input grad are written in place.
        dzxbcdt = torch.empty_like(zxbcdt)
        dz, dxBC_given, ddt = torch.split(dzxbcdt, splits, dim=-1)
        dxBC = torch.empty_like(xBC_conv)  # grad of the conv output (x | B | C), fed to the conv bwd
        dx, dB, dC = torch.split(dxBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
        out = dict(dx=dx.reshape(b, L, nheads, headdim), dB=dB.reshape(b, L, ngroups, dstate),
                   dC=dC.reshape(b, L, ngroups, dstate), ddt=ddt)
        drmsnorm_weight = None
        if norm:  # the norm's backward writes dz into d_zxbcdt and hands the SSD the gradient of its ungated output
            sm = seq_major(zxbcdt)
            dout, _, drmsnorm_weight = rmsnorm_gated_bwd_helion(
                _rows(dout, sm), _rows(out_x.reshape(b, L, dim), sm), rmsnorm_weight, rstd, z=_rows(z, sm),
                group_size=dim // ngroups, norm_before_gate=norm_before_gate, dz_out=_rows(dz, sm))
            dout = _rows(dout, sm)
            zh = None
        else:
            zh = z.reshape(b, L, nheads, headdim)
            out["dz"] = dz.reshape(b, L, nheads, headdim)
        g = ssd_backward_helion(
            dout.reshape(b, L, nheads, headdim), x, zh, out_x, dt, A, B, C, D, dt_bias,
            dt_out, dA_cumsum, states_in, CB, chunk_size, seq_idx=seq_idx, dfinal_states=dfinal, dt_softplus=True,
            dt_limit=ctx.dt_limit, return_dinitial_states=initial_states is not None,
            dstates_dtype=ctx.settings.bwd_dstates_dtype, out=out,
        )
        del states_in, CB, dt_out, dA_cumsum, xBC_conv
        _, dweight, dbias = causal_conv1d_bwd_helion(
            xBC.transpose(1, 2), conv1d_weight, conv1d_bias, dxBC.transpose(1, 2), seq_idx, ctx.activation,
            dx=dxBC_given.transpose(1, 2))
        return (dzxbcdt[:, :l], dweight, dbias, g["ddt_bias"], g["dA"], g["dD"], None, g["dinitial_states"], None,
                None, None, None, None, None, None, drmsnorm_weight, None, None)


def mamba_split_conv1d_scan_combined_helion(
    zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None, seq_idx=None,
    dt_limit=(0.0, float("inf")), return_final_states=False, activation="silu", rmsnorm_weight=None,
    rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None, ngroups=1, norm_before_gate=True,
    settings: HelionSettings | None = None,
):
    """mamba-ssm 2.3.2 ``mamba_split_conv1d_scan_combined`` on the Helion SSD kernels.

    zxbcdt (b, l, 2*dim + 2*ngroups*dstate + nheads) -> y (b, l, dim) (and final_states (b, h, p, n)).
    With ``rmsnorm_weight`` (dim,), as in mamba-ssm, the SSD's output is not gated and the gated RMSNorm over groups of
    dim // ngroups channels (``norm_before_gate``, ``rmsnorm_eps``) runs inside the op on the Helion norm kernels:
    y = rmsnorm(out_x * silu(z)) * w with norm_before_gate False, rmsnorm(out_x) * w * silu(z) with True."""
    for name, value in (("outproj_weight", outproj_weight), ("outproj_bias", outproj_bias)):
        if value is not None:
            raise NotImplementedError(
                f"mamba_split_conv1d_scan_combined_helion: {name} is not supported (Megatron's training path passes "
                "no outproj_weight / outproj_bias; apply out_proj as a separate module)")
    if zxbcdt.dim() != 3:
        raise ValueError(f"zxbcdt must be (batch, seqlen, width), got {tuple(zxbcdt.shape)}")
    nheads, p, dim, dstate = split_dims(zxbcdt, conv1d_weight, D, headdim, ngroups)
    if rmsnorm_weight is not None and tuple(rmsnorm_weight.shape) != (dim,):
        raise ValueError(f"rmsnorm_weight must be ({dim},), got {tuple(rmsnorm_weight.shape)}")
    check_supported(nheads=nheads, headdim=p, ngroups=ngroups, dstate=dstate, chunk_size=chunk_size,
                    dtype=zxbcdt.dtype, conv_width=conv1d_weight.shape[-1], seq_idx=seq_idx, batch=zxbcdt.shape[0],
                    seqlen=zxbcdt.shape[1], op="mamba_split_conv1d_scan_combined_helion")
    return MambaSplitConv1dScanCombinedHelionFn.apply(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states, seq_idx, dt_limit,
        return_final_states, activation, headdim, ngroups, HelionSettings() if settings is None else settings,
        rmsnorm_weight, float(rmsnorm_eps), bool(norm_before_gate),
    )
