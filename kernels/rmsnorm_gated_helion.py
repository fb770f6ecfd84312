"""Gated grouped RMSNorm: the Helion kernels and their autograd wiring.

Semantics and the torch reference (``rmsnorm_gated_ref`` / ``RMSNormGatedRef``): ``kernels/rmsnorm_gated.py``.
"""

from __future__ import annotations

import functools

import helion
import helion.language as hl
import torch
from helion.autotuner import PowerOfTwoFragment

from kernels import first_use, tuner, tuning
from kernels.rmsnorm_gated import _RMSNormGatedModule
from kernels.shapes import padded_len

# ================================================================================================
# Helion kernels
#
# Layout: x, z, y, dy are viewed as (M, G, D) with M = rows, G = ngroups, D = group_size (the whole
# group is one register tile; Nano: D = 512). rstd is saved as (M, G) fp32.
#
# Forward grid: tiles of `block_sizes[0]` rows x 1 group. Backward grid: `rows_per_program` rows x 1
# group (a tuned integer, the knob mamba-ssm fixes at ceil(SMs*ceil(4/num_warps)/ngroups) programs),
# each program walks its rows in tiles of `block_sizes[0]`, accumulating its share of dweight in fp32
# registers and writing one partial row; the partials (cdiv(M, rows_per_program), G, D) are summed
# by torch in a fixed order (rmsnorm_dweight_sum: fp32 sum, then weight's dtype). Every
# row belongs to exactly one program and no atomics are used, so the result is deterministic
# (bitwise repeatable for a given config) and correct under every config.
# ================================================================================================


@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def rmsnorm_gated_fwd_kernel(
    x: torch.Tensor,  # (M, G, D)
    weight: torch.Tensor,  # (G, D)
    z: torch.Tensor,  # (M, G, D); ignored unless has_z
    eps: float,
    has_z: hl.constexpr,
    norm_before_gate: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor]:
    m, g, d = x.size()
    d = hl.specialize(d)
    y = torch.empty_like(x)
    rstd = torch.empty([m, g], dtype=torch.float32, device=x.device)
    for tm, tg in hl.tile([m, g], block_size=[None, 1]):
        xt = x[tm, tg, :].to(torch.float32)
        if has_z and not norm_before_gate:
            zt = z[tm, tg, :].to(torch.float32)
            xt = xt * (zt * torch.sigmoid(zt))
        r = torch.rsqrt(torch.mean(xt * xt, dim=-1) + eps)
        out = xt * r[:, :, None] * weight[tg, :].to(torch.float32)[None, :, :]
        if has_z and norm_before_gate:
            zt2 = z[tm, tg, :].to(torch.float32)
            out = out * (zt2 * torch.sigmoid(zt2))
        y[tm, tg, :] = out.to(y.dtype)
        rstd[tm, tg] = r
    return y, rstd


@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def rmsnorm_gated_bwd_kernel(
    dy: torch.Tensor,  # (M, G, D)
    x: torch.Tensor,  # (M, G, D)
    weight: torch.Tensor,  # (G, D)
    z: torch.Tensor,  # (M, G, D); ignored unless has_z
    rstd: torch.Tensor,  # (M, G) fp32
    dx: torch.Tensor,  # (M, G, D) written (any row stride)
    dz: torch.Tensor,  # (M, G, D) written (any row stride); without z the (1, 1, 1) dummy, never written
    has_z: hl.constexpr,
    norm_before_gate: hl.constexpr,
) -> torch.Tensor:
    m, g, d = x.size()
    d = hl.specialize(d)
    rows = hl.register_tunable("rows_per_program", PowerOfTwoFragment(1, 16384, 64))
    dw_partial = torch.empty([helion.cdiv(m, rows), g, d], dtype=torch.float32, device=x.device)
    for tp, tg in hl.tile([m, g], block_size=[rows, 1]):
        dw_acc = hl.zeros([tg, d], dtype=torch.float32)
        wt = weight[tg, :].to(torch.float32)[None, :, :]
        for tm in hl.tile(tp.begin, tp.end):
            xt = x[tm, tg, :].to(torch.float32)
            dyt = dy[tm, tg, :].to(torch.float32)
            r = rstd[tm, tg][:, :, None]
            if has_z:
                zt = z[tm, tg, :].to(torch.float32)
                sig = torch.sigmoid(zt)
                silu_z = zt * sig
                dsilu_z = sig * (1.0 + zt * (1.0 - sig))
            if has_z and not norm_before_gate:
                xin = xt * silu_z
            else:
                xin = xt
            xhat = xin * r
            if has_z and norm_before_gate:
                dz[tm, tg, :] = (dyt * xhat * wt * dsilu_z).to(dz.dtype)
                dyt = dyt * silu_z
            dw_acc = dw_acc + torch.sum(dyt * xhat, dim=0)
            wdy = dyt * wt
            c = torch.mean(xhat * wdy, dim=-1)
            dxin = (wdy - xhat * c[:, :, None]) * r
            if has_z and not norm_before_gate:
                dx[tm, tg, :] = (dxin * silu_z).to(dx.dtype)
                dz[tm, tg, :] = (dxin * xt * dsilu_z).to(dz.dtype)
            else:
                dx[tm, tg, :] = dxin.to(dx.dtype)
        dw_partial[tp.id, tg, :] = dw_acc
    return dw_partial


# Generic configs used when no tuned file entry exists (also the search's reference).
RMSNORM_FWD_DEFAULT = helion.Config(block_sizes=[4], num_warps=4)
RMSNORM_BWD_DEFAULT = helion.Config(block_sizes=[4], num_warps=4, rows_per_program=64)
# Groups wider than WIDE_GROUP (Mamba2's single group of 5120): a program holds block_sizes[0] x next_pow2(group)
# fp32 values per tensor, so one row over 8 warps keeps them in registers where 4 rows over 4 warps spill (wide tiles
# at Mamba2-2.7B compile for over 15 s each, longer than a first-use search can spend on one candidate)
WIDE_GROUP = 1024
RMSNORM_FWD_WIDE_DEFAULT = helion.Config(block_sizes=[1], num_warps=8)
RMSNORM_BWD_WIDE_DEFAULT = helion.Config(block_sizes=[1], num_warps=8, rows_per_program=64)


def default_configs(group: int) -> tuple[helion.Config, helion.Config]:
    """The (forward, backward) generic configs for groups of ``group`` channels."""
    if group > WIDE_GROUP:
        return RMSNORM_FWD_WIDE_DEFAULT, RMSNORM_BWD_WIDE_DEFAULT
    return RMSNORM_FWD_DEFAULT, RMSNORM_BWD_DEFAULT

def _norm_dims(m: int, g: int, d: int, has_z: bool, nbg: bool, dtype: torch.dtype) -> dict:
    return dict(m=m, g=g, gs=d, z=bool(has_z), nbg=bool(nbg), dt=str(dtype).replace("torch.", ""))


# (x.shape, x.dtype, x.device, weight.shape, group_size, has_z, nbg) -> _Plan: what depends only on
# shapes (validation, dims, the z dummy), derived once per shape instead of per call
_PLANS: dict[tuple, _Plan] = {}


class _Plan:
    __slots__ = ("bwd_default", "d", "dims", "fwd_default", "g", "m", "shape3", "wshape2", "zdummy")

    def __init__(self, x, weight, has_z, group_size, nbg):
        if x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
            raise ValueError(f"weight must be ({x.shape[-1]},), got {tuple(weight.shape)}")
        n = x.shape[-1]
        d = n if group_size is None else int(group_size)
        if d <= 0 or n % d != 0:
            raise ValueError(f"hidden size {n} is not a multiple of group_size {d}")
        g = n // d
        self.m, self.g, self.d = x.numel() // n, g, d
        self.shape3 = (self.m, g, d)
        self.wshape2 = (g, d)
        self.dims = _norm_dims(self.m, g, d, has_z, nbg, x.dtype)
        self.fwd_default, self.bwd_default = default_configs(d)
        # the backward's z and dz arguments without z: a (1, 1, 1) dummy the kernel never reads or writes
        self.zdummy = None if has_z else torch.empty((1, 1, 1), dtype=x.dtype, device=x.device)


def _plan(x, weight, z, group_size, nbg) -> _Plan:
    key = (x.shape, x.dtype, x.device, weight.shape, group_size, z is not None, nbg)
    p = _PLANS.get(key)
    if p is None:
        p = _PLANS[key] = _Plan(x, weight, z is not None, group_size, nbg)
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    return p


def _view3(t, shape3):
    """``t`` as (M, G, D): a view when possible (any row strides); copies only when the last dim is strided."""
    t3 = t.reshape(shape3)
    return t3 if t3.stride(-1) == 1 else t3.contiguous()


def tuning_name(kind: str, has_z: bool) -> str:
    """The tuning name (config file) of the norm's ``kind`` ("fwd" / "bwd") kernel: "rmsnorm_<kind>" for Megatron's
    norm module after the gated SSD (no z), "rmsnorm_<kind>_z" for the norm that applies the gate (z given: the fused
    op's norm, ``model.mamba_fused_norm``)."""
    return f"rmsnorm_{kind}_z" if has_z else f"rmsnorm_{kind}"


def _fwd(x3, w2, z3, eps, nbg, p: _Plan):
    args = (x3, w2, x3 if z3 is None else z3, eps, z3 is not None, nbg)
    return first_use.tuned_call(tuning_name("fwd", z3 is not None), rmsnorm_gated_fwd_kernel, args, p.dims,
                                p.fwd_default)


def rmsnorm_dweight_sum(dw_partial: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dweight (G*D,) in weight's dtype from the backward's (P, G, D) fp32 partials (fixed-order torch
    sum, no atomics). A one-launch Helion reduction would save ~1 us of device time (H200, bench_norm_conv
    --profile), while the backward is host-bound there, so it stays two torch ops (docs/kernels_tried.md)."""
    return dw_partial.sum(0).reshape(-1).to(weight.dtype)


def _bwd(dy, x3, w2, z3, rstd, nbg, p: _Plan, dz_out=None):
    """(dx, dz or None, dweight); dz is written into ``dz_out`` ((M, G, D), any row stride) when given."""
    dy3 = _view3(dy, p.shape3)
    has_z = z3 is not None
    dx = torch.empty(p.shape3, dtype=x3.dtype, device=x3.device)
    if not has_z:
        dz = p.zdummy
    elif dz_out is None:
        dz = torch.empty(p.shape3, dtype=z3.dtype, device=z3.device)
    else:
        if dz_out.shape != p.shape3 or dz_out.stride(-1) != 1:
            raise ValueError(f"dz_out must be {p.shape3} with a unit last stride, got {tuple(dz_out.shape)} "
                             f"strides {dz_out.stride()}")
        dz = dz_out
    args = (dy3, x3, w2, z3 if has_z else p.zdummy, rstd, dx, dz, has_z, nbg)
    dw_partial = first_use.tuned_call(tuning_name("bwd", has_z), rmsnorm_gated_bwd_kernel, args, p.dims, p.bwd_default,
                                      finalize=rmsnorm_bwd_final, prepare=rmsnorm_bwd_prepare)
    return dx, (dz if has_z else None), rmsnorm_dweight_sum(dw_partial, w2)


def rmsnorm_gated_fwd_helion(x, weight, z=None, eps=1e-5, group_size=None, norm_before_gate=True):
    """Forward: returns ``(y, rstd)`` with y of x's shape/dtype and rstd (M, G) fp32."""
    nbg = bool(norm_before_gate)
    p = _plan(x, weight, z, group_size, nbg)
    z3 = None if z is None else _view3(z, p.shape3)
    y, rstd = _fwd(_view3(x, p.shape3), _view3(weight, p.wshape2), z3, float(eps), nbg, p)
    return y.reshape(x.shape), rstd


def rmsnorm_gated_bwd_helion(dy, x, weight, rstd, z=None, group_size=None, norm_before_gate=True, dz_out=None):
    """Backward: returns ``(dx, dz or None, dweight)``; dweight has weight's dtype. ``dz_out`` (z's shape, a view that
    reshapes to rows x groups without a copy, e.g. a slice of a wider gradient buffer): dz is written into it."""
    nbg = bool(norm_before_gate)
    p = _plan(x, weight, z, group_size, nbg)
    if rstd.shape != (p.m, p.g):
        raise ValueError(f"rstd must be {(p.m, p.g)}, got {tuple(rstd.shape)}")
    z3 = None if z is None else _view3(z, p.shape3)
    dz3 = None
    if dz_out is not None:
        if z is None or dz_out.shape != z.shape:
            raise ValueError(f"dz_out must have z's shape, got {tuple(dz_out.shape)}")
        try:
            dz3 = dz_out.view(p.shape3)
        except RuntimeError as e:
            raise ValueError(f"dz_out (strides {dz_out.stride()}) must reshape to {p.shape3} without a copy") from e
    dx, dz, dweight = _bwd(dy, _view3(x, p.shape3), _view3(weight, p.wshape2), z3, rstd, nbg, p, dz_out=dz3)
    return dx.reshape(x.shape), (None if dz is None else (dz_out if dz_out is not None else dz.reshape(x.shape))), \
        dweight


def rmsnorm_bwd_final(out, args):
    """Config-independent results of ``rmsnorm_gated_bwd_kernel``: (dx, [dz,] dweight fp32 (G, D)).
    ``out`` is its dweight partials, ``args`` the kernel's (dy, x, weight, z, rstd, dx, dz, has_z,
    norm_before_gate), whose dx / dz buffers it wrote. dweight is the fp32 sum of the partials (what
    rmsnorm_dweight_sum computes before its cast to weight's dtype); dz is left out without z (the
    (1, 1, 1) dummy the kernel does not write)."""
    dx, dz, has_z = args[5], args[6], args[7]
    return (dx, dz, out.sum(0)) if has_z else (dx, out.sum(0))


def rmsnorm_bwd_prepare(args):
    """Fill the result buffers with NaN before a search candidate runs: a config that leaves rows unwritten fails
    the comparison instead of passing on the previous candidate's values."""
    args[5].fill_(float("nan"))
    if args[7]:
        args[6].fill_(float("nan"))


class RMSNormGatedHelionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, z=None, eps=1e-5, group_size=None, norm_before_gate=True):
        nbg = bool(norm_before_gate)
        p = _plan(x, weight, z, group_size, nbg)
        x3 = _view3(x, p.shape3)
        w2 = _view3(weight, p.wshape2)
        z3 = None if z is None else _view3(z, p.shape3)
        y, rstd = _fwd(x3, w2, z3, float(eps), nbg, p)
        ctx.settings = tuning.runtime().settings  # the backward (autograd's thread) runs under the same runtime
        # the (M, G, D) views (or copies) are saved, so the backward derives nothing again
        ctx.save_for_backward(x3, w2, z3, rstd)
        ctx.plan, ctx.nbg, ctx.x_shape = p, nbg, x.shape
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x3, w2, z3, rstd = ctx.saved_tensors
        with tuning.use(ctx.settings):
            dx, dz, dw = _bwd(dy, x3, w2, z3, rstd, ctx.nbg, ctx.plan)
        shape = ctx.x_shape
        return dx.reshape(shape), dw, (None if dz is None else dz.reshape(shape)), None, None, None


def rmsnorm_fn_helion(x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """``mamba_ssm.ops.triton.layernorm_gated.rmsnorm_fn`` signature (bias must be None: RMSNorm has none)."""
    if bias is not None:
        raise NotImplementedError("rmsnorm_fn_helion: bias is not supported (mamba-ssm's RMSNorm has no bias; a gated norm with bias is its LayerNorm)")
    return RMSNormGatedHelionFn.apply(x, weight, z, eps, group_size, norm_before_gate)


def layernorm_fn_helion(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True, is_rms_norm=False):
    """``mamba_ssm.ops.triton.layernorm_gated.layernorm_fn`` signature: only its RMSNorm form (``is_rms_norm=True``,
    bias None) is implemented; the gated LayerNorm raises NotImplementedError."""
    if not is_rms_norm:
        raise NotImplementedError("layernorm_fn_helion: is_rms_norm=False (the gated LayerNorm) is not supported; "
                                  "only the gated RMSNorm is")
    return rmsnorm_fn_helion(x, weight, bias, z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)


class RMSNormGatedHelion(_RMSNormGatedModule):
    """Drop-in for ``mamba_ssm.ops.triton.layernorm_gated.RMSNorm`` on the Helion kernels. ``settings``: the
    ``HelionSettings`` its kernels run under (the registry makes one subclass per backend; None: the active ones)."""

    settings = None

    def forward(self, x, z=None):
        with tuning.use(self.settings):
            return rmsnorm_fn_helion(x, self.weight, None, z=z, eps=self.eps, group_size=self.group_size,
                                     norm_before_gate=self.norm_before_gate)


# Position of each load in the kernels' load_eviction_policies list at the tuned call (z=None,
# norm_before_gate=False), read from the generated code: fwd [x, weight, -, -, -], bwd [weight, x, dy, rstd]
# (the "-" entries belong to no load there).
_EV_SLOTS = {"fwd": {"x": 0, "weight": 1}, "bwd": {"weight": 0, "x": 1, "dy": 2, "rstd": 3}}


def _access_seeds(kind: str, n_ev: int, bases: list[dict]) -> list[dict]:
    """Per base config: TMA for every access (indexing="tensor_descriptor"), streamed loads evicted
    first (x, dy, rstd "first", weight "last": each byte of x/dy is read once, the weight row by every
    program), the same with TMA, and x/dy "last" (the contrast). ``n_ev``: the list's length (0 under
    HELION_INTERPRET=1, whose config space has no loads: then TMA only; interpret mode ignores it)."""
    slots = _EV_SLOTS[kind]
    if n_ev <= max(slots.values()):
        return [{**b, "indexing": "tensor_descriptor"} for b in bases]

    def ev(stream: str) -> list[str]:
        e = [""] * n_ev
        for name, i in slots.items():
            e[i] = "last" if name == "weight" else stream
        return e

    out = []
    for b in bases:
        for extra in ({"indexing": "tensor_descriptor"}, {"load_eviction_policies": ev("first")},
                      {"indexing": "tensor_descriptor", "load_eviction_policies": ev("first")},
                      {"load_eviction_policies": ev("last")}):
            out.append({**b, **extra})
    return out


def _n_eviction(kernel, args) -> int:
    return len(kernel.bind(tuple(args)).config_spec.default_config().config.get("load_eviction_policies", []))


def _seeds(kind: str, gated: bool, kernel, args, bases: list[dict]) -> list[dict]:
    """``_access_seeds`` of ``bases`` for the ungated kernels (whose load order ``_EV_SLOTS`` records); for the gated ones
    (z adds loads) the bases with TMA for every access, then as they are."""
    if not gated:
        return _access_seeds(kind, _n_eviction(kernel, args), bases)
    return [{**b, "indexing": "tensor_descriptor"} for b in bases] + list(bases)


def _dedup(seeds: list[dict]) -> list[dict]:
    out, seen = [], set()
    for s in seeds:
        k = repr(sorted(s.items()))
        if k not in seen:
            seen.add(k)
            out.append(s)
    return out


def _rmsnorm_case(kind: str, gated: bool = False):
    """The search case of the norm's ``kind`` kernel at model dims: Megatron's norm module (z None) or, ``gated``, the
    fused op's norm that applies the gate (z given); norm_before_gate False in both (Megatron's and Nemotron's)."""
    def build(dims: dict, device) -> tuner.TuneCase:
        m, n = _rows(dims, gated), dims["h"] * dims["p"]
        g, d = dims["g"], n // dims["g"]
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(m, g, d, generator=gen).to(device=device, dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(g, d, generator=gen)).to(device=device, dtype=torch.bfloat16)
        z = torch.randn(m, g, d, generator=gen).to(device=device, dtype=torch.bfloat16) if gated else None
        kd = _norm_dims(m, g, d, gated, False, torch.bfloat16)
        fwd_default, bwd_default = default_configs(d)
        wide = d > WIDE_GROUP
        # Seeds: the TMA / eviction-policy variants of the best shapes first (the H200 winners first:
        # fwd [8] 1 warp; bwd [4] 2 warps 128 rows stages [0, 2]), then a plain grid around them; <= 60 each.
        if kind == "fwd":
            args = (x, w, x if z is None else z, 1e-5, gated, False)
            bases = [dict(block_sizes=[8], num_warps=1), dict(block_sizes=[4], num_warps=4),
                     dict(block_sizes=[4], num_warps=1), dict(block_sizes=[8], num_warps=2),
                     dict(block_sizes=[16], num_warps=2), dict(block_sizes=[2], num_warps=1)]
            grid = dict(block_sizes=[[1], [2], [4], [8], [16]], num_warps=[1, 2, 4, 8])
            if wide:  # one or two rows over 4-16 warps (WIDE_GROUP), 2 warps in the plain grid
                bases = [dict(block_sizes=[b], num_warps=w) for b in (1, 2) for w in (8, 16, 4)]
                grid = dict(block_sizes=[[1], [2]], num_warps=[2, 4, 8, 16])
            seeds = _seeds(kind, gated, rmsnorm_gated_fwd_kernel, args, bases) + tuner.grid_seeds(**grid)
            # seeds only: on the H200 one random candidate hung inside Triton's native compile (which
            # no Python-level time limit interrupts), so the search stays on these seeds
            return tuner.TuneCase(rmsnorm_gated_fwd_kernel, args, kd, fwd_default, _dedup(seeds), atol=2e-2,
                                   rtol=2e-2, n_random=0)
        xin = x.float() if z is None else x.float() * torch.nn.functional.silu(z.float())
        rstd = torch.rsqrt(xin.square().mean(-1) + 1e-5)
        dy = torch.randn(m, g, d, generator=gen).to(device=device, dtype=torch.bfloat16)
        # without z: the (1, 1, 1) dummies the wrappers pass for z and dz (the tuned call is the one that runs)
        dummy = torch.empty((1, 1, 1), dtype=x.dtype, device=x.device)
        args = (dy, x, w, dummy if z is None else z, rstd, torch.empty_like(x),
                dummy if z is None else torch.empty_like(z), gated, False)
        # rows per program: 2601 row groups was the best forced count in the baseline (~6 rows each
        # at M=16384). Software-pipelined inner row loop (range_num_stages of the inner loop > 0: the
        # next rows' loads are in flight while this tile computes): the H200 winner has [0, 2].
        bases = [dict(block_sizes=[4], num_warps=2, rows_per_program=128, range_num_stages=[0, 2]),
                 dict(block_sizes=[4], num_warps=2, rows_per_program=64, range_num_stages=[0, 2]),
                 dict(block_sizes=[4], num_warps=2, rows_per_program=128, range_num_stages=[0, 3]),
                 dict(block_sizes=[8], num_warps=4, rows_per_program=128, range_num_stages=[0, 2]),
                 dict(block_sizes=[2], num_warps=2, rows_per_program=128, range_num_stages=[0, 2]),
                 dict(block_sizes=[4], num_warps=2, rows_per_program=256, range_num_stages=[0, 2])]
        grid = dict(rows_per_program=[32, 64, 128, 256], block_sizes=[[2], [4], [8]], num_warps=[2, 4],
                    range_num_stages=[[0, 2], [0, 3]])
        if wide:
            # one or two rows over 4-16 warps (WIDE_GROUP), 2 warps in the plain grid; no random candidates, whose
            # wider tiles each compile for longer than the search's budget allows
            bases = [dict(block_sizes=[1], num_warps=w, rows_per_program=r, range_num_stages=[0, 2])
                     for w in (8, 16) for r in (64, 128)] + [
                     dict(block_sizes=[2], num_warps=8, rows_per_program=128, range_num_stages=[0, 2])]
            grid = dict(rows_per_program=[32, 64, 128, 256], block_sizes=[[1], [2]], num_warps=[4, 8, 16],
                        range_num_stages=[[0, 2]])
        seeds = _seeds(kind, gated, rmsnorm_gated_bwd_kernel, args, bases) + tuner.grid_seeds(**grid)
        seeds = [s for s in _dedup(seeds) if s["block_sizes"][0] <= s["rows_per_program"]][:60]
        # Compared on the final results (dx, dz when gated, summed dweight): the partials' count
        # depends on rows_per_program, and dz is never written without z.
        return tuner.TuneCase(rmsnorm_gated_bwd_kernel, args, kd, bwd_default, seeds, atol=5e-2, rtol=2e-2,
                               n_random=0 if wide else 16, finalize=rmsnorm_bwd_final,
                               prepare=rmsnorm_bwd_prepare)

    return build


def _rows(dims: dict, gated: bool) -> int:
    """Rows the norm runs over at model dims: b * l for Megatron's module, b * l padded to the chunk for the fused op's
    norm (the op runs on zxbcdt padded once)."""
    return dims["b"] * (padded_len(dims["l"], dims["c"]) if gated else dims["l"])


def _rmsnorm_case_dims(dims: dict, gated: bool = False) -> dict:
    """The kernel dims of ``_rmsnorm_case`` at model dims ``dims`` (Megatron's norm module: no z, norm after the gate;
    ``gated``: the fused op's norm, with z)."""
    n = dims["h"] * dims["p"]
    return _norm_dims(_rows(dims, gated), dims["g"], n // dims["g"], gated, False, torch.bfloat16)


TUNABLE_KERNELS = {tuning_name(kind, gated): tuner.TunableKernel(_rmsnorm_case(kind, gated),
                                                                 functools.partial(_rmsnorm_case_dims, gated=gated))
                   for gated in (False, True) for kind in ("fwd", "bwd")}
