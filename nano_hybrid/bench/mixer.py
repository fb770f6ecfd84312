"""The Mamba-2 mixer op under test: its shapes (``SHAPES``; ``GRID``, the shape grid), random parameters with Megatron's init ranges,
and ``MixerOp``, one kernel backend's fused split-conv1d-scan + gated RMSNorm bound to shared inputs (the
timed closures ``OPS``), with the relative L2 error used to compare two backends.

Layouts are those of the model's mixer (``nano_hybrid.model.mixer``): in the default ``zxbcdt_layout="megatron"``
the op's input zxbcdt is a (b, l, d) view of (l, b, d) memory, as Megatron's in_proj produces it, handed to a
backend with ``strided_zxbcdt`` as it is and to any other as a contiguous copy (``op_zxbcdt``); the op's output is
made a contiguous (l, b, d) tensor for the norm. ``zxbcdt_layout="contiguous"`` stores zxbcdt as a contiguous
(b, l, d) tensor instead (the same values)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MixerShape:
    batch: int
    seqlen: int
    nheads: int
    headdim: int
    ngroups: int
    d_state: int
    d_conv: int = 4
    chunk_size: int = 128

    @property
    def d_inner(self) -> int:
        return self.nheads * self.headdim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.ngroups * self.d_state

    @property
    def zxbcdt_dim(self) -> int:
        return 2 * self.d_inner + 2 * self.ngroups * self.d_state + self.nheads

    @property
    def group_size(self) -> int:
        return self.d_inner // self.ngroups

    def model_dims(self) -> dict[str, int]:
        """The shape as the kernels' tuning keys name model dims (b, l, h, p, g, n, c, w)."""
        return dict(b=self.batch, l=self.seqlen, h=self.nheads, p=self.headdim, g=self.ngroups, n=self.d_state,
                    c=self.chunk_size, w=self.d_conv)


# Nano 30B-A3B mixer shapes (docs/ARCHITECTURE.md). tp2 / tp8 = one rank's share at tensor-parallel 2 / 8.
SHAPES = {
    "nano": MixerShape(batch=2, seqlen=8192, nheads=64, headdim=64, ngroups=8, d_state=128),
    "tp2": MixerShape(batch=2, seqlen=8192, nheads=32, headdim=64, ngroups=4, d_state=128),
    "tp8": MixerShape(batch=1, seqlen=8192, nheads=8, headdim=64, ngroups=1, d_state=128),
    "l4096b4": MixerShape(batch=4, seqlen=4096, nheads=64, headdim=64, ngroups=8, d_state=128),
    # CPU smoke-test size only (not a benchmark).
    "tiny": MixerShape(batch=1, seqlen=256, nheads=4, headdim=16, ngroups=2, d_state=16, chunk_size=64),
}

# The shape grid of bench_shape_grid.py (and tune_kernels.py --shapes), name -> shape: Nano (64 heads, 8 groups) per
# tensor-parallel rank and at other batch x length splits; packed documents (seq_idx); Mamba2 layers (1 group, chunk
# 256; 2.7B: 80 heads of 64, 130M-like: 24 heads); Nemotron-H 8B (128 heads, 8 groups); a long-context micro-batch.
_NANO = dict(headdim=64, d_state=128)
def state_passing_taken(backend, shape: MixerShape) -> str | None:
    """The chunk-state path ("fused" / "split", ``kernels.helion.state_passing``) the helion ``backend`` took at
    ``shape``; None for another backend, or a shape it has not run."""
    settings = getattr(backend, "settings", None)
    if settings is None:
        return None
    from kernels.shapes import padded_len
    from kernels.ssd_helion import state_passing_taken as taken

    return taken(settings, dict(b=shape.batch, l=padded_len(shape.seqlen, shape.chunk_size), h=shape.nheads,
                                p=shape.headdim, g=shape.ngroups, n=shape.d_state, c=shape.chunk_size))


GRID: dict[str, tuple[MixerShape, int]] = {  # (shape, documents per sequence; 1: no seq_idx)
    "nano_tp1": (MixerShape(batch=1, seqlen=8192, nheads=64, ngroups=8, **_NANO), 1),
    "nano_tp2": (MixerShape(batch=1, seqlen=8192, nheads=32, ngroups=4, **_NANO), 1),
    "nano_tp4": (MixerShape(batch=1, seqlen=8192, nheads=16, ngroups=2, **_NANO), 1),
    "nano_tp8": (MixerShape(batch=1, seqlen=8192, nheads=8, ngroups=1, **_NANO), 1),
    "nano_b8_l2048": (MixerShape(batch=8, seqlen=2048, nheads=64, ngroups=8, **_NANO), 1),
    "nano_b4_l4096": (MixerShape(batch=4, seqlen=4096, nheads=64, ngroups=8, **_NANO), 1),
    "nano_b2_l8192": (MixerShape(batch=2, seqlen=8192, nheads=64, ngroups=8, **_NANO), 1),
    "nano_b2_l8192_docs8": (MixerShape(batch=2, seqlen=8192, nheads=64, ngroups=8, **_NANO), 8),
    "nano_b2_l3000": (MixerShape(batch=2, seqlen=3000, nheads=64, ngroups=8, **_NANO), 1),
    "m2_2p7b_c256": (MixerShape(batch=1, seqlen=8192, nheads=80, ngroups=1, chunk_size=256, **_NANO), 1),
    "m2_2p7b_c128": (MixerShape(batch=1, seqlen=8192, nheads=80, ngroups=1, chunk_size=128, **_NANO), 1),
    "m2_small_c256": (MixerShape(batch=8, seqlen=2048, nheads=24, ngroups=1, chunk_size=256, **_NANO), 1),
    "nemh_8b": (MixerShape(batch=1, seqlen=8192, nheads=128, ngroups=8, **_NANO), 1),
    "nemh_8b_docs4": (MixerShape(batch=1, seqlen=8192, nheads=128, ngroups=8, **_NANO), 4),
    # model=nano_proxy as recipe convergence_seeds_h200 runs it (16 heads of Nano's dims, micro-batch 4 x 1024)
    "nano_proxy": (MixerShape(batch=4, seqlen=1024, nheads=16, ngroups=8, **_NANO), 1),
    # a long-context micro-batch (e.g. 512k tokens at context parallel 2): zxbcdt's (l, b, d) memory spans 2.7e9
    # elements, past 32-bit offsets; last in the grid's order
    "nano_b1_l262144": (MixerShape(batch=1, seqlen=262144, nheads=64, ngroups=8, **_NANO), 1),
    # CPU smoke-test size only (torch backend)
    "tiny": (MixerShape(batch=1, seqlen=200, nheads=4, headdim=16, ngroups=2, d_state=16, chunk_size=64), 2),
}


def grid_model_dims(name: str) -> dict[str, int]:
    """The model dims of grid shape ``name`` as the tuner takes them: ``MixerShape.model_dims`` and, where it packs
    documents, "docs" (documents per sequence: the kernels that take seq_idx are tuned with it)."""
    shape, docs = GRID[name]
    return {**shape.model_dims(), **({"docs": docs} if docs > 1 else {})}


OPS = ("split_fwd", "split_fwdbwd", "norm_fwdbwd", "mixer_fwdbwd")
ZXBCDT_LAYOUTS = ("megatron", "contiguous")


def add_zxbcdt_layout_arg(parser) -> None:
    """The benchmarks' ``--zxbcdt-layout`` option (``make_params``'s ``zxbcdt_layout``)."""
    parser.add_argument("--zxbcdt-layout", default="megatron", choices=ZXBCDT_LAYOUTS,
                        help="zxbcdt a (b, l, d) view of (l, b, d) memory as Megatron's in_proj produces it (megatron, "
                             "default) or a contiguous (b, l, d) tensor")


def zxbcdt_leaf_name(p: dict) -> str:
    """The key of the tensor that holds zxbcdt's gradient: the (l, b, d) ``zxbcdt_lbd`` under the megatron layout,
    else ``zxbcdt``."""
    return "zxbcdt_lbd" if "zxbcdt_lbd" in p else "zxbcdt"


def zxbcdt_leaf(p: dict):
    """The tensor that holds zxbcdt's gradient (``zxbcdt_leaf_name``)."""
    return p[zxbcdt_leaf_name(p)]


def op_zxbcdt(backend, p: dict):
    """zxbcdt as MambaMixer hands it to ``backend``'s fused op: the (b, l, d) view as it is when the backend takes
    strided input (``strided_zxbcdt``), else a contiguous copy (none under the contiguous layout)."""
    return p["zxbcdt"] if backend.strided_zxbcdt else p["zxbcdt"].contiguous()


def grad_of(p: dict, name: str):
    """The gradient of input ``name`` as a contiguous fp32 copy in p[name]'s shape ((b, l, d) for zxbcdt)."""
    import torch

    g = (zxbcdt_leaf(p).grad.transpose(0, 1) if name == "zxbcdt" and "zxbcdt_lbd" in p else p[name].grad)
    return g.detach().float().clone(memory_format=torch.contiguous_format)


class MixerOp:
    """One backend's split-conv1d-scan + gated-norm, bound to shared inputs and parameters; ``seq_idx`` (b, l) int32
    ids of packed documents, or None; ``fused_norm``: the mixer runs the norm inside the op (its weight passed as
    rmsnorm_weight, ``model.mamba_fused_norm``) instead of as a module after the gated op."""

    def __init__(self, backend, shape: MixerShape, params: dict, device, dtype, seq_idx=None, fused_norm: bool = False):
        import torch

        self.backend = backend
        self.shape = shape
        self.p = params
        self.seq_idx = seq_idx
        self.fused_norm = fused_norm
        self.norm = backend.RMSNormGated(shape.d_inner, eps=1e-5, group_size=shape.group_size,
                                         norm_before_gate=False, device=device, dtype=dtype)
        with torch.no_grad():
            self.norm.weight.copy_(params["norm_weight"])

    def split(self, norm: bool = False):
        import torch

        p, s = self.p, self.shape
        A = -torch.exp(p["A_log"].float())
        return self.backend.mamba_split_conv1d_scan_combined(
            op_zxbcdt(self.backend, p), p["conv_w"], p["conv_b"], p["dt_bias"].float(), A, D=p["D"],
            chunk_size=s.chunk_size, seq_idx=self.seq_idx, activation="silu", headdim=s.headdim, ngroups=s.ngroups,
            norm_before_gate=False,
            **({"rmsnorm_weight": self.norm.weight, "rmsnorm_eps": self.norm.eps} if norm else {}),
        )

    def mixer(self):
        # as in MambaMixer._ssm_training: the op's (b, l, d) output is made a contiguous (l, b, d) tensor for the
        # norm and out_proj (no copy when the op wrote it in (l, b) memory order)
        if self.fused_norm:
            return self.split(norm=True).transpose(0, 1).contiguous()
        return self.norm(self.split().transpose(0, 1).contiguous())

    def leaves(self):
        return [zxbcdt_leaf(self.p)] + [self.p[k] for k in ("conv_w", "conv_b", "dt_bias", "A_log", "D")] + [
            self.norm.weight]

    def zero_grad(self):
        for t in self.leaves() + [self.p["norm_in"]]:
            t.grad = None

    # the four timed closures -------------------------------------------------------------------
    def split_fwd(self):
        return self.split()

    def split_fwdbwd(self):
        self.zero_grad()
        self.split().backward(self.p["dy"])

    def norm_fwdbwd(self):
        self.zero_grad()
        self.norm(self.p["norm_in"]).backward(self.p["dy_lbd"])

    def mixer_fwdbwd(self):
        self.zero_grad()
        self.mixer().backward(self.p["dy_lbd"])

    def outputs_and_grads(self) -> dict:
        self.zero_grad()
        y = self.mixer()
        y.backward(self.p["dy_lbd"])
        out = {"y": y.detach().float()}
        for n in ("zxbcdt", "conv_w", "conv_b", "dt_bias", "A_log", "D"):
            out[f"d_{n}"] = grad_of(self.p, n)
        out["d_norm_weight"] = self.norm.weight.grad.detach().float().clone()
        self.zero_grad()
        return out


def make_params(shape: MixerShape, device, dtype, seed: int, zxbcdt_layout: str = "megatron") -> dict:
    """Random inputs and parameters with Megatron's init ranges (never zeros). zxbcdt (b, l, d) is, with
    ``zxbcdt_layout`` "megatron", a view of the leaf ``zxbcdt_lbd`` (l, b, d), as Megatron's in_proj output reaches
    the op, and with "contiguous" a contiguous leaf; both layouts hold the same values for one seed."""
    import math

    import torch

    if zxbcdt_layout not in ZXBCDT_LAYOUTS:
        raise ValueError(f"zxbcdt_layout must be one of {ZXBCDT_LAYOUTS}, got {zxbcdt_layout!r}")

    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*size, scale=1.0, dt=dtype):
        return (torch.randn(*size, generator=g) * scale).to(device=device, dtype=dt)

    s = shape
    # dt bias so that softplus(dt_bias) lies in [1e-3, 0.1] (MambaMixer init), A in [1, 16].
    dt = torch.exp(torch.rand(s.nheads, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    dt_bias = (dt + torch.log(-torch.expm1(-dt))).to(device=device, dtype=dtype)
    A_log = torch.log(torch.empty(s.nheads).uniform_(1, 16, generator=g)).to(device=device, dtype=dtype)
    p = {
        "zxbcdt": rnd(s.batch, s.seqlen, s.zxbcdt_dim),
        "conv_w": (torch.rand(s.conv_dim, s.d_conv, generator=g) - 0.5).to(device=device, dtype=dtype),
        "conv_b": rnd(s.conv_dim, scale=0.1),
        "dt_bias": dt_bias,
        "A_log": A_log,
        "D": (1.0 + 0.1 * torch.randn(s.nheads, generator=g)).to(device=device, dtype=dtype),
        "norm_weight": (1.0 + 0.1 * torch.randn(s.d_inner, generator=g)).to(device=device, dtype=dtype),
        "norm_in": rnd(s.seqlen, s.batch, s.d_inner),
        # the gradients as Megatron's mixer hands them back: the norm and out_proj run on (l, b, d), so the
        # norm gets a contiguous (l, b, d) gradient and the op a (b, l, d) view of one
        "dy_lbd": rnd(s.seqlen, s.batch, s.d_inner),
    }
    p["dy"] = p["dy_lbd"].transpose(0, 1)
    for k in ("zxbcdt", "conv_w", "conv_b", "dt_bias", "A_log", "D", "norm_in"):
        p[k].requires_grad_(True)
    if zxbcdt_layout == "megatron":
        p["zxbcdt_lbd"] = p.pop("zxbcdt").detach().transpose(0, 1).clone(memory_format=torch.contiguous_format)
        p["zxbcdt_lbd"].requires_grad_(True)
        p["zxbcdt"] = p["zxbcdt_lbd"].transpose(0, 1)
    return p


def rel_err(a, b) -> float:
    import torch

    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def check_against(ref: dict, cand: dict) -> dict:
    return {k: rel_err(cand[k], ref[k]) for k in ref}
