"""The Mamba-2 mixer op under test: its shapes (``SHAPES``; ``GRID``, the shape grid), random parameters with Megatron's init ranges,
and ``MixerOp``, one kernel backend's fused split-conv1d-scan + gated RMSNorm bound to shared inputs (the
timed closures ``OPS``), with the relative L2 error used to compare two backends."""

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


# Nano 30B-A3B mixer shapes (docs/ARCHITECTURE.md). tp2 = one rank's share at tensor-parallel 2.
SHAPES = {
    "nano": MixerShape(batch=2, seqlen=8192, nheads=64, headdim=64, ngroups=8, d_state=128),
    "tp2": MixerShape(batch=2, seqlen=8192, nheads=32, headdim=64, ngroups=4, d_state=128),
    "l4096b4": MixerShape(batch=4, seqlen=4096, nheads=64, headdim=64, ngroups=8, d_state=128),
    # CPU smoke-test size only (not a benchmark).
    "tiny": MixerShape(batch=1, seqlen=256, nheads=4, headdim=16, ngroups=2, d_state=16, chunk_size=64),
}

# The shape grid of bench_shape_grid.py (and tune_kernels.py --shapes), name -> shape: Nano (64 heads, 8 groups) per
# tensor-parallel rank and at other batch x length splits; packed documents (seq_idx); Mamba2 layers (1 group, chunk
# 256; 2.7B: 80 heads of 64, 130M-like: 24 heads); Nemotron-H 8B (128 heads, 8 groups).
_NANO = dict(headdim=64, d_state=128)
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
    # CPU smoke-test size only (torch backend)
    "tiny": (MixerShape(batch=1, seqlen=200, nheads=4, headdim=16, ngroups=2, d_state=16, chunk_size=64), 2),
}

OPS = ("split_fwd", "split_fwdbwd", "norm_fwdbwd", "mixer_fwdbwd")


class MixerOp:
    """One backend's split-conv1d-scan + gated-norm, bound to shared inputs and parameters."""

    def __init__(self, backend, shape: MixerShape, params: dict, device, dtype):
        import torch

        self.backend = backend
        self.shape = shape
        self.p = params
        self.norm = backend.RMSNormGated(shape.d_inner, eps=1e-5, group_size=shape.group_size,
                                         norm_before_gate=False, device=device, dtype=dtype)
        with torch.no_grad():
            self.norm.weight.copy_(params["norm_weight"])

    def split(self):
        import torch

        p, s = self.p, self.shape
        A = -torch.exp(p["A_log"].float())
        return self.backend.mamba_split_conv1d_scan_combined(
            p["zxbcdt"], p["conv_w"], p["conv_b"], p["dt_bias"].float(), A, D=p["D"],
            chunk_size=s.chunk_size, activation="silu", headdim=s.headdim, ngroups=s.ngroups,
            norm_before_gate=False,
        )

    def mixer(self):
        # as in MambaMixer._ssm_training: the op's (b, l, d) output is copied to (l, b, d) for the norm and out_proj
        return self.norm(self.split().transpose(0, 1).contiguous())

    def leaves(self):
        return [self.p[k] for k in ("zxbcdt", "conv_w", "conv_b", "dt_bias", "A_log", "D")] + [self.norm.weight]

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
        names = ["zxbcdt", "conv_w", "conv_b", "dt_bias", "A_log", "D", "norm_weight"]
        out = {"y": y.detach().float()}
        for n, t in zip(names, self.leaves()):
            out[f"d_{n}"] = t.grad.detach().float().clone()
        self.zero_grad()
        return out


def make_params(shape: MixerShape, device, dtype, seed: int) -> dict:
    """Random inputs and parameters with Megatron's init ranges (never zeros)."""
    import math

    import torch

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
    return p


def rel_err(a, b) -> float:
    import torch

    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def check_against(ref: dict, cand: dict) -> dict:
    return {k: rel_err(cand[k], ref[k]) for k in ref}
