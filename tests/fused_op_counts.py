"""Count the aten ops the Helion fused Mamba op runs *outside* its Helion kernels (CPU, interpret mode).

    python -m pytest -q -s tests/test_mamba_split_helion.py -k op_count     (asserts and prints the counts)

(a test helper: interpret mode needs the ``aten::mm.dtype`` CPU shim of tests/conftest.py).

Every aten op dispatched during forward and backward is recorded with a TorchDispatchMode; ops
issued inside a Helion kernel (``kernels.tuning.run_interpret``, which every eager kernel run goes
through) are not counted (they are the kernel body in interpret mode) and each kernel launch is
counted once as ``helion:<kernel>``.
Ops are classified as ``view`` (metadata only, no GPU work), ``alloc`` (empty/empty_like/..., no
kernel) and ``work`` (everything else: on a GPU each is at least one aten kernel launch).
Shapes are tiny (the count does not depend on them, only on the code path).
"""

from __future__ import annotations

import collections
import os

os.environ.setdefault("HELION_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from kernels import tuning  # noqa: E402

VIEW_OPS = {
    "view", "_unsafe_view", "split", "split_with_sizes", "transpose", "t", "permute", "slice", "select",
    "expand", "unsqueeze", "squeeze", "as_strided", "alias", "detach", "unbind", "diagonal", "view_as_real",
    "_reshape_alias", "reshape", "lift_fresh", "set_",
}
ALLOC_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _install(counter: _Counter):
    orig = tuning.run_interpret

    def wrapped(kernel, args, config):
        counter.ops.append("helion:" + (getattr(kernel, "name", None) or kernel.fn.__name__))
        counter.inside += 1
        try:
            return orig(kernel, args, config)
        finally:
            counter.inside -= 1

    tuning.run_interpret = wrapped
    return orig


def classify(ops: list[str]) -> dict:
    c = collections.Counter(ops)
    view = {k: v for k, v in c.items() if k in VIEW_OPS}
    alloc = {k: v for k, v in c.items() if k in ALLOC_OPS}
    hel = {k: v for k, v in c.items() if k.startswith("helion:")}
    work = {k: v for k, v in c.items() if k not in VIEW_OPS and k not in ALLOC_OPS and not k.startswith("helion:")}
    return dict(n_work=sum(work.values()), n_alloc=sum(alloc.values()), n_view=sum(view.values()),
                n_helion=sum(hel.values()), work=dict(sorted(work.items())), alloc=alloc, helion=hel,
                view=dict(sorted(view.items())))


def count(seq: bool = False, init: bool = False, l: int = 32, b: int = 1, settings=None, earlier: int = 0,
          fused_norm: bool = False) -> dict:
    """Counts of one forward and backward at (b, l) with chunk 16 (``l`` 32 is two whole chunks), with the op's
    ``settings`` (a ``HelionSettings``; None: the defaults), after ``earlier`` uncounted calls on the same inputs
    (as the later layers of a step, which get the same seq_idx tensor); ``fused_norm``: with the gated norm in the op
    (its weight passed as rmsnorm_weight)."""
    from kernels import mamba_split_helion as msh

    h, p, g, n, c = 4, 8, 2, 16, 16
    dim = h * p
    gen = torch.Generator().manual_seed(0)
    zxbcdt = torch.randn(b, l, 2 * dim + 2 * g * n + h, generator=gen).bfloat16().requires_grad_()
    w = (0.5 * torch.randn(dim + 2 * g * n, 4, generator=gen)).bfloat16().requires_grad_()
    bias = torch.randn(dim + 2 * g * n, generator=gen).bfloat16().requires_grad_()
    dt_bias = torch.randn(h, generator=gen).requires_grad_()
    A = (-torch.rand(h, generator=gen) - 0.5).requires_grad_()
    D = torch.randn(h, generator=gen).requires_grad_()
    si = None
    if seq:
        si = torch.zeros(b, l, dtype=torch.int32)
        si[:, l // 2:] = 1
    init_s = torch.randn(b, h, p, n, generator=gen).requires_grad_() if init else None
    dout = torch.randn(b, l, dim, generator=gen).bfloat16()
    norm_w = torch.ones(dim, dtype=torch.bfloat16, requires_grad=True) if fused_norm else None

    def op():
        return msh.mamba_split_conv1d_scan_combined_helion(
            zxbcdt, w, bias, dt_bias, A, D, c, initial_states=init_s, seq_idx=si, headdim=p, ngroups=g,
            settings=settings, rmsnorm_weight=norm_w, rmsnorm_eps=1e-5, norm_before_gate=False)

    tuning._ZEROS.clear()  # the zero gradients kept for the process (tuning.zeros_input): made by the first call here
    for _ in range(earlier):
        op().backward(dout)
    for leaf in (zxbcdt, w, bias, dt_bias, A, D, init_s, norm_w):
        if leaf is not None:
            leaf.grad = None  # the counted backward stores its gradients as the first does (no accumulation)
    counter = _Counter()
    orig = _install(counter)
    try:
        with counter:
            y = op()
        fwd = list(counter.ops)
        counter.ops.clear()
        with counter:
            y.backward(dout)
        bwd = list(counter.ops)
    finally:
        tuning.run_interpret = orig
    return dict(forward=classify(fwd), backward=classify(bwd))
