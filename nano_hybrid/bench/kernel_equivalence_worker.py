"""The worker of ``kernel_equivalence``: the default helion fused mixer op + gated RMSNorm, forward and backward,
from the ``kernels`` package first on ``PYTHONPATH``, on fixed inputs; every output and gradient saved with


``torch.save``. Run as a file (``python -P <this file> --shape S --seed N --device D --worker-out F``): it imports
only torch and ``kernels``, so the tree under test needs no ``nano_hybrid``."""

from __future__ import annotations

import argparse

# (b, l, h, p, g, n, c, conv width); "nano" is Nemotron-3 Nano's mixer at micro-batch 2, sequence 8192
SHAPES = {
    "nano": (2, 8192, 64, 64, 8, 128, 128, 4),
    "tiny": (2, 80, 4, 16, 2, 16, 32, 4),
}
# megatron_layout: as Megatron's mixer calls the op (no seq_idx): zxbcdt a (b, l, d) view of (l, b, d) memory, the norm
# on y rearranged to a contiguous (l, b, d) tensor, the gradient in (l, b, d)
CASES = ("no_seq_idx", "seq_idx", "megatron_layout")


def _inputs(shape: tuple, seed: int, device: str):
    """Fixed inputs (CPU generator, then moved): the fused op's arguments, the norm weight and the output grads."""
    import math

    import torch

    b, l, h, p, g, n, c, w = shape
    dim = h * p
    conv_dim = dim + 2 * g * n
    gen = torch.Generator().manual_seed(seed)

    def rn(*s, scale=1.0):
        return torch.randn(*s, generator=gen) * scale

    bf = torch.bfloat16
    t = dict(
        zxbcdt=rn(b, l, 2 * dim + 2 * g * n + h).to(bf),
        conv1d_weight=rn(conv_dim, w, scale=0.5).to(bf),
        conv1d_bias=rn(conv_dim, scale=0.1).to(bf),
        dt_bias=torch.rand(h, generator=gen) * 2 - 4,
        A=-torch.exp(torch.rand(h, generator=gen) * math.log(16.0)),
        D=torch.ones(h) + rn(h, scale=0.1),
        norm_weight=(1 + rn(dim, scale=0.1)).to(bf),
    )
    dy = rn(b, l, dim).to(bf)
    # documents of several lengths, ending inside chunks, one of 2 tokens (below the conv width)
    cuts = sorted({min(l - 1, max(1, round(l * f))) for f in (0.13, 0.4, 0.4 + 2 / l, 0.77)})
    seq = torch.zeros(b, l, dtype=torch.int32)
    for i, cut in enumerate(cuts):
        seq[:, cut:] = i + 1
    seq[1] = seq[1].flip(0).max() - seq[1].flip(0)  # the second row: the same documents in reverse order
    return {k: v.to(device) for k, v in t.items()}, dy.to(device), seq.to(device)


def run_tree(shape_name: str, seed: int, device: str, out_path: str) -> None:
    """Worker: the fused op + gated norm forward and backward of the ``kernels`` package on sys.path."""
    import torch

    import kernels
    from kernels.mamba_split_helion import mamba_split_conv1d_scan_combined_helion

    try:
        from kernels.rmsnorm_gated_helion import RMSNormGatedHelion
    except ModuleNotFoundError as e:  # a tree whose kernels/rmsnorm_gated.py holds the reference and the Helion kernels
        if e.name != "kernels.rmsnorm_gated_helion":
            raise
        from kernels.rmsnorm_gated import RMSNormGatedHelion

    shape = SHAPES[shape_name]
    b, l, h, p, g, n, c, w = shape
    res = {"kernels_file": kernels.__file__, "cases": {}}
    for case in CASES:
        t, dy, seq = _inputs(shape, seed, device)
        lbd = case == "megatron_layout"
        if lbd:
            t["zxbcdt"] = t["zxbcdt"].transpose(0, 1).contiguous().transpose(0, 1)
            dy = dy.transpose(0, 1).contiguous()
        leaves = {k: v.detach().requires_grad_(True) for k, v in t.items()}
        norm = RMSNormGatedHelion(h * p, eps=1e-5, group_size=h * p // g, norm_before_gate=False,
                                  device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(leaves["norm_weight"])
        y = mamba_split_conv1d_scan_combined_helion(
            leaves["zxbcdt"], leaves["conv1d_weight"], leaves["conv1d_bias"], leaves["dt_bias"], leaves["A"],
            leaves["D"], c, seq_idx=seq if case == "seq_idx" else None, activation="silu", headdim=p, ngroups=g,
            norm_before_gate=False)
        out = norm(y.transpose(0, 1).contiguous() if lbd else y)
        names = ["zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D"]
        grads = torch.autograd.grad(out, [leaves[k] for k in names] + [norm.weight], dy)
        tensors = {"mixer_out": y, "norm_out": out}
        tensors.update({f"grad_{k}": gk for k, gk in zip(names + ["norm_weight"], grads)})
        if lbd:  # compared in the (b, l, d) orientation of the other cases
            tensors["norm_out"] = out.transpose(0, 1)
        res["cases"][case] = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        del t, leaves, y, out, grads, tensors
    torch.save(res, out_path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", required=True, choices=("cuda", "cpu"))
    ap.add_argument("--worker-out", required=True)
    a = ap.parse_args(argv)
    run_tree(a.shape, a.seed, a.device, a.worker_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
