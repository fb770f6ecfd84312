"""Helion SSD forward (kernels/ssd_helion.py) against the torch reference (kernels/ssd.py).

CPU: Helion interpret mode (HELION_INTERPRET=1, set by conftest) on small shapes, each piece and the
whole forward; plus Triton code generation for every kernel at the Nano shape with its default and
seed configs (catches Helion compile errors without a GPU).
GPU (@pytest.mark.gpu): the Nano shape against an fp32 torch reference and mamba-ssm, bf16 tolerances.
"""

from __future__ import annotations


import pytest
import torch

import helion

from kernels import ssd
from kernels import ssd_helion as sh

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _inputs(b, l, h, p, g, n, dtype=torch.float32, seed=0, seq_breaks=(), device=DEV):
    gen = torch.Generator().manual_seed(seed)

    def rn(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(device=device, dtype=dtype)

    seq_idx = torch.zeros(b, l, dtype=torch.int32)
    for i, brk in enumerate(seq_breaks):
        seq_idx[:, brk:] = i + 1
    return dict(
        x=rn(b, l, h, p), dt=rn(b, l, h, scale=0.5) - 1.0, A=-(torch.rand(h, generator=gen) + 0.5).to(device),
        B=rn(b, l, g, n, scale=0.5), C=rn(b, l, g, n, scale=0.5), z=rn(b, l, h, p),
        D=torch.randn(h, generator=gen).to(device), Dp=torch.randn(h, p, generator=gen).to(device),
        dt_bias=(torch.rand(h, generator=gen) - 0.5).to(device), init=rn(b, h, p, n, scale=0.5).float(),
        seq_idx=seq_idx.to(device),
    )


def _close(a, b, tol, what):
    a, b = a.float(), b.float()
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    err = (a - b).abs().max().item()
    scale = b.abs().max().item() + 1e-6
    assert err <= tol * max(1.0, scale), f"{what}: max abs err {err:.3g} (ref max {scale:.3g}, tol {tol})"


# (b, l, h, p, g, n, c, seq_breaks)
CASES = {
    "g1": (2, 64, 2, 16, 1, 16, 32, ()),
    "g2_odd": (1, 75, 4, 16, 2, 32, 32, ()),
    "g4_seq": (2, 96, 4, 32, 4, 16, 32, (20, 41, 64)),
    "g2_odd_seq_c16": (1, 53, 4, 16, 2, 16, 16, (7, 30)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.skipif(CUDA, reason="CPU interpret-mode test")
def test_pieces_match_reference(case):
    b, l, h, p, g, n, c, brk = CASES[case]
    t = _inputs(b, l, h, p, g, n, seq_breaks=brk)
    seq = t["seq_idx"] if brk else None
    dA_r, dt_r = ssd.chunk_cumsum_ref(t["dt"], t["A"], c, dt_bias=t["dt_bias"], dt_softplus=True, dt_limit=(0.05, 2.0))
    dA, dto = sh.ssd_chunk_cumsum_helion(t["dt"], t["A"], c, dt_bias=t["dt_bias"], dt_softplus=True, dt_limit=(0.05, 2.0))
    _close(dto, dt_r, 1e-5, "dt_out")
    _close(dA, dA_r, 1e-5, "dA_cumsum")
    # padded positions carry dt = 0
    if l % c:
        assert torch.all(dto.reshape(b, h, -1)[:, :, l:] == 0)

    st_r = ssd.chunk_state_ref(t["B"], t["x"], dt_r, dA_r, seq_idx=seq)
    st = sh.ssd_chunk_state_helion(t["B"], t["x"], dto, dA, seq_idx=seq)
    _close(st, st_r, 1e-4, "chunk_state")
    assert st.dtype == torch.float32

    sin_r, fin_r = ssd.state_passing_ref(st_r, dA_r[..., -1], initial_states=t["init"], seq_idx=seq, chunk_size=c)
    sin, fin = sh.ssd_state_passing_helion(st, dA[..., -1], initial_states=t["init"], seq_idx=seq, chunk_size=c)
    _close(sin, sin_r, 1e-4, "states_in")
    _close(fin, fin_r, 1e-4, "final_states")
    sin2, fin2 = sh.ssd_chunk_state_passing_helion(t["B"], t["x"], dto, dA, initial_states=t["init"], seq_idx=seq)
    _close(sin2, sin_r, 1e-4, "fused states_in")
    _close(fin2, fin_r, 1e-4, "fused final_states")
    assert fin2.dtype == torch.float32

    CB_r = ssd.bmm_chunk_ref(t["C"], t["B"], c, seq_idx=seq)
    CB = sh.ssd_bmm_chunk_helion(t["C"], t["B"], c, seq_idx=seq)
    _close(CB, CB_r, 1e-5, "CB")

    for D in (None, t["D"], t["Dp"]):
        for z in (None, t["z"]):
            o_r, ox_r = ssd.chunk_scan_ref(CB_r, t["x"], dt_r, dA_r, t["C"], sin_r, D=D, z=z, seq_idx=seq)
            o, ox = sh.ssd_chunk_scan_helion(CB, t["x"], dto, dA, t["C"], sin, D=D, z=z, seq_idx=seq)
            tag = f"chunk_scan D={None if D is None else tuple(D.shape)} z={z is not None}"
            _close(o, o_r, 1e-4, tag + " out")
            _close(ox, ox_r, 1e-4, tag + " out_x")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.skipif(CUDA, reason="CPU interpret-mode test")
def test_forward_matches_reference_and_recurrence(case, fuse):
    b, l, h, p, g, n, c, brk = CASES[case]
    t = _inputs(b, l, h, p, g, n, seed=1, seq_breaks=brk)
    kw = dict(D=t["Dp"] if fuse else t["D"], z=t["z"], dt_bias=t["dt_bias"], initial_states=t["init"],
              seq_idx=t["seq_idx"] if brk else None, dt_softplus=True, dt_limit=(0.0, 1.5))
    ref = ssd.ssd_forward_ref(t["x"], t["dt"], t["A"], t["B"], t["C"], c, **kw)
    got = sh.ssd_forward_helion(t["x"], t["dt"], t["A"], t["B"], t["C"], c, fuse_state_passing=fuse, **kw)
    for name, a, r in zip(["out", "out_x", "dt_out", "dA_cumsum", "states_in", "final_states"], got, ref):
        _close(a, r, 1e-4, name)
    y64, fin64 = ssd.ssd_recurrence_fp64(t["x"], t["dt"], t["A"], t["B"], t["C"], **kw)
    _close(got[0], y64, 1e-4, "out vs fp64 recurrence")
    _close(got[5], fin64, 1e-4, "final_states vs fp64 recurrence")


# (b, l, h, p, g, n, c, seq_breaks, dt_bias, dt_limit, softplus, initial states). p or n of 32 gives several p/n
# blocks per head with the small blocks (16), and heads of 4 several head blocks in the chunk cumsum.
FWD_CASES = {
    "g1": (2, 64, 2, 16, 1, 16, 32, (), True, (0.0, float("inf")), True, False),
    "g2_odd_nobias_limit": (1, 75, 4, 32, 2, 32, 32, (), False, (0.05, 1.5), True, True),
    "g4_seq_init": (2, 96, 4, 32, 4, 16, 32, (20, 41, 64), True, (0.0, 1.5), True, True),
    "g2_odd_seq_c16": (1, 53, 4, 16, 2, 32, 16, (7, 30), True, (0.0, float("inf")), True, True),
    "g2_nosoftplus": (1, 64, 4, 32, 2, 32, 32, (), True, (0.0, float("inf")), False, False),
}
_FWD_NAMES = ["out", "out_x", "dt_out", "dA_cumsum", "states_in", "final_states"]


def _small_blocks(monkeypatch):
    """Interpret mode runs every register_block_size at its maximum (one program per head, one k-block);
    this makes them 16 (the cumsum's head block 1): several programs per head and several k-blocks per chunk."""
    import helion.language as hl

    monkeypatch.setattr(hl.register_block_size, "_ref_fn", lambda lo, hi=None: lo)


def _fwd_args(case, seed=3):
    b, l, h, p, g, n, c, brk, bias, lim, sp, init = FWD_CASES[case]
    t = _inputs(b, l, h, p, g, n, seed=seed, seq_breaks=brk)
    if not sp:
        # dt (+ dt_bias >= -0.5) used as is: kept positive, since the kernels clamp at dt_min = 0 always (as
        # mamba-ssm) while the torch reference clamps only for a non-default dt_limit
        t["dt"] = t["dt"].abs() * 0.5 + 0.5
    kw = dict(D=t["D"], z=t["z"], dt_bias=t["dt_bias"] if bias else None, initial_states=t["init"] if init else None,
              seq_idx=t["seq_idx"] if brk else None, dt_softplus=sp, dt_limit=lim)
    return (t["x"], t["dt"], t["A"], t["B"], t["C"], c), kw


def _to16(args, kw):
    """_fwd_args with x, B, C and z in bf16 (the inputs' dtype decides CB's)."""
    x, dt, A, B, C, c = args
    return (x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), c), dict(kw, z=kw["z"].bfloat16())


@pytest.mark.parametrize("case", list(FWD_CASES))
@pytest.mark.parametrize("small_blocks", [False, True])
@pytest.mark.skipif(CUDA, reason="CPU interpret-mode test")
def test_forward_blocks_dt_options_match_reference(case, small_blocks, monkeypatch):
    """The forward with dt_bias / dt_limit / softplus options, seq_idx and initial states, at whole-extent and at
    small blocks: fp32 inputs give the reference's six outputs to 1e-4 of their scale; bf16 inputs (CB in bf16
    between the bmm and chunk_scan) give them to 2e-2 (dt_out / dA_cumsum to 1e-5: the cumsum reads dt only)."""
    if small_blocks:
        _small_blocks(monkeypatch)
    args, kw = _fwd_args(case)
    ref = ssd.ssd_forward_ref(*args, **kw)
    got = sh.ssd_forward_helion(*args, **kw)
    for name, a, r in zip(_FWD_NAMES, got, ref):
        _close(a, r, 1e-4, name)
    args16, kw16 = _to16(args, kw)
    got16 = sh.ssd_forward_helion(*args16, **kw16)
    ref16 = ssd.ssd_forward_ref(*args16, **kw16)
    for name, a, r in zip(_FWD_NAMES, got16, ref16):
        _close(a, r, 1e-5 if name in ("dt_out", "dA_cumsum") else 2e-2, f"bf16 {name}")


def _record_kernels(monkeypatch):
    names = []
    real = sh._run

    def run(name, *a, **kw):
        names.append(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(sh, "_run", run)
    return names


@pytest.mark.skipif(CUDA, reason="CPU interpret-mode test")
def test_forward_launches_and_cb_dtype(monkeypatch):
    """The forward launches the chunk cumsum, chunk_state_passing, the bmm and chunk_scan (ssd_chunk_scan_cb16 for
    bf16 inputs, with CB in bf16; ssd_chunk_scan with an fp32 CB for fp32 inputs); chunk_scan refuses a CB of the
    other dtype; the unfused state path runs chunk_state and state_passing instead."""
    names = _record_kernels(monkeypatch)
    args32, kw32 = _fwd_args("g1")
    args, kw = _to16(args32, kw32)
    sh.ssd_forward_helion(*args, **kw)
    assert names == ["ssd_chunk_cumsum", "ssd_chunk_state_passing", "ssd_bmm_chunk", "ssd_chunk_scan_cb16"], names
    names.clear()
    sh.ssd_forward_helion(*args32, **kw32)
    assert names == ["ssd_chunk_cumsum", "ssd_chunk_state_passing", "ssd_bmm_chunk", "ssd_chunk_scan"], names
    names.clear()
    sh.ssd_forward_helion(*args32, fuse_state_passing=False, **kw32)
    assert names == ["ssd_chunk_cumsum", "ssd_chunk_state", "ssd_state_passing", "ssd_bmm_chunk", "ssd_chunk_scan"]
    assert sh.forward_cb_dtype(torch.bfloat16) == torch.bfloat16 and sh.forward_cb_dtype(torch.float32) == torch.float32
    x, dt, A, B, C, c = args
    CB = sh.ssd_bmm_chunk_helion(C, B, c)
    CB16 = sh.ssd_bmm_chunk_helion(C, B, c, cb_dtype=torch.bfloat16)
    assert CB.dtype == torch.float32 and CB16.dtype == torch.bfloat16
    assert torch.equal(CB16, CB.to(torch.bfloat16))
    dA, dto = sh.ssd_chunk_cumsum_helion(dt, A, c, dt_bias=kw["dt_bias"], dt_softplus=True)
    st = torch.zeros(x.shape[0], CB.shape[1], x.shape[2], x.shape[3], C.shape[3], dtype=x.dtype)
    with pytest.raises(ValueError, match="reads CB in torch.bfloat16"):
        sh.ssd_chunk_scan_helion(CB, x, dto, dA, C, st)
    with pytest.raises(ValueError, match="reads CB in torch.float32"):
        sh.ssd_chunk_scan_helion(CB16, x.float(), dto, dA, C.float(), st.float())


@pytest.mark.skipif(CUDA, reason="CPU interpret-mode test")
def test_combined_entry_and_state_dtype():
    b, l, h, p, g, n, c = 1, 40, 2, 16, 1, 16, 16
    t = _inputs(b, l, h, p, g, n, seed=2)
    kw = dict(D=t["D"], z=t["z"], dt_bias=t["dt_bias"], dt_softplus=True)
    out, fin = sh.mamba_chunk_scan_combined_helion(t["x"], t["dt"], t["A"], t["B"], t["C"], c, return_final_states=True, **kw)
    out_r, fin_r = ssd.mamba_chunk_scan_combined_ref(t["x"], t["dt"], t["A"], t["B"], t["C"], c, return_final_states=True, **kw)
    _close(out, out_r, 1e-4, "combined out")
    _close(fin, fin_r, 1e-4, "combined final")
    assert sh.mamba_chunk_scan_combined_helion(t["x"], t["dt"], t["A"], t["B"], t["C"], c, **kw).shape == out.shape
    # bf16 inputs: states_in in C.dtype (mamba-ssm's default), or state_dtype when given
    tb = {k: (v.bfloat16() if k in ("x", "B", "C", "z") else v) for k, v in t.items()}
    res = sh.ssd_forward_helion(tb["x"], tb["dt"], tb["A"], tb["B"], tb["C"], c, **{**kw, "z": tb["z"]})
    assert res[0].dtype == torch.bfloat16 and res[4].dtype == torch.bfloat16 and res[5].dtype == torch.float32
    assert res[2].dtype == torch.float32 and res[3].dtype == torch.float32
    res32 = sh.ssd_forward_helion(tb["x"], tb["dt"], tb["A"], tb["B"], tb["C"], c, state_dtype=torch.float32, **{**kw, "z": tb["z"]})
    assert res32[4].dtype == torch.float32
    ref = ssd.ssd_forward_ref(tb["x"], tb["dt"], tb["A"], tb["B"], tb["C"], c, **{**kw, "z": tb["z"]})
    _close(res32[0], ref[0], 2e-2, "bf16 out")


# ---------------------------------------------------------------------------------------------- fused forward

# (b, l, h, p, g, n, c, seq_breaks, dt_bias, dt_limit, softplus, initial states, per-(h, p) D, z)
FUSED_CASES = {
    # packed documents: one of length 1 (position 5), boundaries inside chunks (5, 6, 20, 70; 20 in the chunk's second
    # row tile at blocks of 16), one on a chunk start (32); a partial last chunk (75 = 2 * 32 + 11); initial states
    "seq_len1_partial": (2, 75, 4, 32, 2, 16, 32, (5, 6, 20, 32, 70), True, (0.0, float("inf")), True, True, False,
                         True),
    # seqlen shorter than one chunk, initial states, no z, D per (head, headdim), dt limits
    "short": (1, 11, 4, 16, 2, 32, 32, (), True, (0.05, 1.5), True, True, True, False),
    # no seq_idx, no initial states, no dt_bias, several chunks, ngroups 1
    "g1_plain": (2, 64, 2, 16, 1, 16, 16, (), False, (0.0, float("inf")), True, False, False, True),
    # dt used as is (no softplus); documents starting on a row tile (16, at blocks of 16) and on a chunk start (32)
    "nosoftplus_seq": (1, 64, 4, 16, 4, 16, 32, (16, 32), True, (0.0, float("inf")), False, True, False, True),
}
_FUSED_NAMES = ["out", "out_x", "dt_out", "dA_cumsum", "final_states"]


def _fused_args(case, seed=11):
    b, l, h, p, g, n, c, brk, bias, lim, sp, init, D2, with_z = FUSED_CASES[case]
    t = _inputs(b, l, h, p, g, n, seed=seed, seq_breaks=brk)
    if not sp:
        t["dt"] = t["dt"].abs() * 0.5 + 0.5  # kept positive (the kernels clamp at dt_min = 0 always)
    kw = dict(D=t["Dp"] if D2 else t["D"], z=t["z"] if with_z else None, dt_bias=t["dt_bias"] if bias else None,
              initial_states=t["init"] if init else None, seq_idx=t["seq_idx"] if brk else None, dt_softplus=sp,
              dt_limit=lim)
    return (t["x"], t["dt"], t["A"], t["B"], t["C"], c), kw


def _fused_blocks(monkeypatch, blocks):
    """The fused kernel's four block sizes (block_p, block_m, block_k, block_s) in interpret mode, in the order its
    register_block_size calls run; call before each fused forward (and leave no other kernel in between)."""
    import helion.language as hl

    it = iter(blocks)
    monkeypatch.setattr(hl.register_block_size, "_ref_fn", lambda lo, hi=None: next(it))


def _fused_vs(args, kw, tol, tag, blocks=None, monkeypatch=None):
    """The fused forward's five outputs against the torch reference's and the chunked helion forward's (to ``tol``;
    dt_out / dA_cumsum to 1e-5); returns the fused outputs. ``blocks``: the fused kernel's block sizes (else the
    current register_block_size behaviour)."""
    if blocks is not None:
        _fused_blocks(monkeypatch, blocks)
    got = sh.ssd_forward_fused_helion(*args, **kw)
    if blocks is not None:
        monkeypatch.undo()
    ref = ssd.ssd_forward_ref(*args, **kw)
    chk = sh.ssd_forward_helion(*args, **kw)
    for i, name in enumerate(_FUSED_NAMES):
        j = 5 if name == "final_states" else i
        t = 1e-5 if name in ("dt_out", "dA_cumsum") else tol
        _close(got[i], ref[j], t, f"{tag} fused {name} vs reference")
        _close(got[i], chk[j], t, f"{tag} fused {name} vs chunked helion")
        assert got[i].dtype == chk[j].dtype and got[i].shape == chk[j].shape, (tag, name)
    return got


@pytest.mark.parametrize("case", list(FUSED_CASES))
@pytest.mark.parametrize("blocks", ["whole", "small", "mixed"])
@pytest.mark.skipif(CUDA, reason="CPU interpret-mode test")
def test_fused_forward_matches_reference_and_chunked(case, blocks, monkeypatch):
    """ssd_forward_fused_helion (one launch) gives the reference's and the chunked helion forward's out, out_x,
    dt_out, dA_cumsum and final states: fp32 inputs to 1e-4 of their scale, bf16 x/B/C/z to 2e-2; at whole-extent
    blocks, at blocks of 16 (several headdim blocks, row, column and state-update tiles per chunk) and at mixed
    blocks (column tiles wider than row tiles: the causal bound masks part of a column tile)."""
    if blocks == "small":
        _small_blocks(monkeypatch)
    fused_blocks = [16, 16, 32, 64] if blocks == "mixed" else None
    if blocks == "mixed" and FUSED_CASES[case][6] < 32:
        pytest.skip("mixed blocks need a chunk of 32 or more")
    args, kw = _fused_args(case)
    got = _fused_vs(args, kw, 1e-4, "fp32", fused_blocks, monkeypatch)
    names = _record_kernels(monkeypatch)
    if fused_blocks is not None:
        _fused_blocks(monkeypatch, fused_blocks)
    sh.ssd_forward_fused_helion(*args, **kw)
    assert names == ["ssd_fused_fwd"], names
    # the fp64 recurrence (step by step, no chunks)
    y64, fin64 = ssd.ssd_recurrence_fp64(*args[:5], **kw)
    _close(got[0], y64, 1e-4, "fused out vs fp64 recurrence")
    _close(got[4], fin64, 1e-4, "fused final_states vs fp64 recurrence")
    if kw["seq_idx"] is not None:
        # the document boundaries matter at these inputs: without seq_idx the output differs
        if fused_blocks is not None:
            _fused_blocks(monkeypatch, fused_blocks)
        other = sh.ssd_forward_fused_helion(*args, **dict(kw, seq_idx=None))
        assert (other[0] - got[0]).abs().max() > 1e-2
    x, dt, A, B, C, c = args
    kw16 = dict(kw, z=None if kw["z"] is None else kw["z"].bfloat16())
    _fused_vs((x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), c), kw16, 2e-2, "bf16", fused_blocks, monkeypatch)


@pytest.mark.skipif(CUDA, reason="CPU interpret-mode test")
def test_fused_forward_one_launch_and_combined_entry(monkeypatch):
    """The fused forward is one launch (seq_idx, initial states, z, l a multiple of the chunk); the combined entry
    runs it with ``HelionSettings(ssd_fwd="fused")`` and gives the chunked entry's out and final states."""
    from kernels.settings import HelionSettings

    names = _record_kernels(monkeypatch)
    b, l, h, p, g, n, c = 1, 32, 2, 16, 1, 16, 16
    t = _inputs(b, l, h, p, g, n, seed=2, seq_breaks=(9,))
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"], c)
    kw = dict(D=t["D"], z=t["z"], dt_bias=t["dt_bias"], initial_states=t["init"], seq_idx=t["seq_idx"],
              dt_softplus=True)
    sh.ssd_forward_fused_helion(*args, **kw)
    assert names == ["ssd_fused_fwd"], names
    names.clear()
    out_f, fin_f = sh.mamba_chunk_scan_combined_helion(*args, return_final_states=True,
                                                       settings=HelionSettings(ssd_fwd="fused"), **kw)
    assert names == ["ssd_fused_fwd"], names
    names.clear()
    out_c, fin_c = sh.mamba_chunk_scan_combined_helion(*args, return_final_states=True, **kw)
    assert "ssd_fused_fwd" not in names and len(names) == 4, names
    _close(out_f, out_c, 1e-5, "combined fused vs chunked out")
    _close(fin_f, fin_c, 1e-5, "combined fused vs chunked final states")
    with pytest.raises(ValueError, match="seq_idx must be"):
        sh.ssd_forward_fused_helion(*args, seq_idx=t["seq_idx"][:, :8])
    with pytest.raises(ValueError, match="chunk_size"):
        sh.ssd_forward_fused_helion(*args[:5], 24)
    with pytest.raises(ValueError, match="initial_states must be"):
        sh.ssd_forward_fused_helion(*args, initial_states=t["init"][:, :1])


def _op_case(b, l, h, p, g, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dim = h * p
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(
        zxbcdt=r(b, l, 2 * dim + 2 * g * n + h), conv1d_weight=r(dim + 2 * g * n, 4) * 0.5,
        conv1d_bias=r(dim + 2 * g * n), dt_bias=r(h), A=-torch.rand(h, generator=gen) - 0.5, D=r(h),
    )


@pytest.mark.skipif(CUDA, reason="CPU interpret-mode test")
def test_fused_op_grads_same_with_fused_forward(monkeypatch):
    """The fused training op with ``ssd_fwd="fused"``: output, final states and every gradient (the backward is
    shared; it reads the forward's out_x, dt_out and dA_cumsum) equal the chunked forward's to 1e-5 of their scale,
    and the forward launches ssd_fused_fwd instead of the four chunked kernels. seq_idx (a boundary inside a
    chunk), initial states, a partial last chunk."""
    from kernels import mamba_split_helion as msh
    from kernels.settings import HelionSettings

    b, l, h, p, g, n, c = 2, 37, 4, 8, 2, 16, 16
    si = torch.zeros(b, l, dtype=torch.int32)
    si[:, 20:] = 1
    res = {}
    for mode in ("chunked", "fused"):
        names = _record_kernels(monkeypatch)
        t = _op_case(b, l, h, p, g, n, seed=3)
        t0 = torch.randn(b, h, p, n, generator=torch.Generator().manual_seed(5))
        ins = list(t.values()) + [t0]
        for v in ins:
            v.requires_grad_(True)
        o, f = msh.mamba_split_conv1d_scan_combined_helion(
            *t.values(), chunk_size=c, initial_states=t0, seq_idx=si, headdim=p, ngroups=g, return_final_states=True,
            settings=HelionSettings(ssd_fwd=mode))
        fwd_names = list(names)
        gen = torch.Generator().manual_seed(9)
        loss = (o * torch.randn(o.shape, generator=gen)).sum() + (f * torch.randn(f.shape, generator=gen)).sum()
        res[mode] = [o, f, *torch.autograd.grad(loss, ins)]
        if mode == "fused":
            assert fwd_names == ["ssd_fused_fwd"], fwd_names
        else:
            assert "ssd_fused_fwd" not in fwd_names and len(fwd_names) == 4, fwd_names
        monkeypatch.undo()
    labels = ["out", "final_states"] + [f"d{k}" for k in t] + ["dinitial_states"]
    for name, a, r in zip(labels, res["fused"], res["chunked"]):
        assert r.abs().max() > 0, name
        _close(a, r, 1e-5, f"ssd_fwd=fused vs chunked: {name}")


def test_bad_input_fails_early():
    t = _inputs(1, 32, 4, 16, 2, 16, device="cpu")
    with pytest.raises(ValueError, match="chunk_size"):
        sh.ssd_forward_helion(t["x"], t["dt"], t["A"], t["B"], t["C"], 24)
    with pytest.raises(ValueError, match="multiple of ngroups"):
        sh.ssd_forward_helion(t["x"][:, :, :3], t["dt"][:, :, :3], t["A"][:3], t["B"], t["C"], 16)
    with pytest.raises(ValueError, match="dt must be"):
        sh.ssd_forward_helion(t["x"], t["dt"][:, :8], t["A"], t["B"], t["C"], 16)
    with pytest.raises(ValueError, match="D must be"):
        CB = torch.zeros(1, 2, 2, 16, 16)
        sh.ssd_chunk_scan_helion(CB, t["x"], torch.zeros(1, 4, 2, 16), torch.zeros(1, 4, 2, 16), t["C"],
                                 torch.zeros(1, 2, 4, 16, 16), D=torch.zeros(3))
    with pytest.raises(ValueError, match="seq_idx must be"):
        sh.ssd_forward_helion(t["x"], t["dt"], t["A"], t["B"], t["C"], 16, seq_idx=t["seq_idx"][:, :8])
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        sh.mamba_chunk_scan_combined_helion(t["x"], t["dt"], t["A"], t["B"], t["C"], 16, cu_seqlens=torch.tensor([0, 32]))


@pytest.mark.parametrize("name", list(sh.TUNABLE_KERNELS))
def test_triton_codegen_nano_shape(name, monkeypatch):
    """Every kernel generates Triton code at the Nano chunk/head shape for its default config and a
    sample of its tuning seeds (Helion-side compile errors show up here, on CPU)."""
    monkeypatch.delenv("HELION_INTERPRET", raising=False)
    md = dict(b=1, l=256, h=8, p=64, g=2, n=128, c=128)  # Nano per-chunk dims, fewer heads/chunks
    args, _ = sh._kernel_args(name, md, "cpu")
    kern = helion.kernel(sh._BODIES[name], static_shapes=True, ignore_warnings=[helion.exc.TensorOperationInWrapper])
    bound = kern.bind(args)
    seeds = sh._SEEDS[name]
    for cfg in [sh.DEFAULT_CONFIGS[name]] + seeds[:: max(1, len(seeds) // 6)]:
        code = bound.to_triton_code(helion.Config(**cfg))
        assert "@triton.jit" in code, f"{name}: no Triton kernel for {cfg}"
        assert code.count("def _helion_") == 1, f"{name}: expected one device kernel"
        if name in ("ssd_chunk_state", "ssd_chunk_state_passing", "ssd_bmm_chunk", "ssd_chunk_scan",
                    "ssd_chunk_scan_cb16", "ssd_fused_fwd"):
            assert "tl.dot" in code and "out_dtype=tl.float32" in code, f"{name}: GEMM not lowered to tl.dot fp32"


def test_tunable_registry_and_defaults():
    from kernels import tuning

    found = tuning.discover_tunable_kernels()
    for name in sh._BODIES:
        assert found[name][0] == "kernels.ssd_helion"
        tc = sh.TUNABLE_KERNELS[name](dict(b=1, l=64, h=4, p=16, g=2, n=16, c=32), "cpu")
        assert tc.seeds[0] == sh.DEFAULT_CONFIGS[name] and tc.kernel is sh.get_kernel(name)
    # clipping keeps block sizes within the tiled extents at small shapes
    assert sh._clip_blocks("x", dict(block_sizes=[64, 64, 64]), [16, 128, 32])["block_sizes"] == [16, 64, 32]


# ---------------------------------------------------------------------------------------------- GPU


def _mamba_ssm():
    import sys
    import types

    if "selective_scan_cuda" not in sys.modules:
        sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")
    from mamba_ssm.ops.triton import ssd_combined

    return ssd_combined


NANO = dict(b=2, l=8192, h=64, p=64, g=8, n=128, c=128)



def _nano_gpu_case(with_seq: bool) -> tuple[dict, dict]:
    """Nano-shape bf16 inputs on CUDA and the forward's keyword arguments: D, z, dt_bias, softplus, random
    initial states and, with ``with_seq``, three packed sequences (boundaries at 3000 and 5123)."""
    md = NANO
    inp = sh.example_inputs(md, "cuda")
    seq_idx = None
    if with_seq:
        seq_idx = torch.zeros(md["b"], md["l"], dtype=torch.int32, device="cuda")
        seq_idx[:, 3000:] = 1
        seq_idx[:, 5123:] = 2
    init = torch.randn(md["b"], md["h"], md["p"], md["n"], device="cuda") * 0.1
    return inp, dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], initial_states=init, seq_idx=seq_idx,
                     dt_softplus=True)


def _fp32_forward_ref(args: tuple, kw: dict):
    """The torch reference forward on fp32 copies of the floating-point inputs (the GPU tests' fp32 baseline)."""
    return ssd.ssd_forward_ref(*(a.float() if torch.is_tensor(a) else a for a in args), **{
        k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kw.items()})


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("with_seq", [False, True])
def test_gpu_nano_vs_fp32_reference_and_mamba_ssm(with_seq):
    """bf16 inputs at the Nano shape. Tolerances (max abs error relative to max |ref|):
    out/out_x 2e-2 vs the fp32 torch reference and vs mamba-ssm; final_states 1e-2; dt/dA 1e-5."""
    md = NANO
    inp, kw = _nano_gpu_case(with_seq)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], md["c"])
    got = sh.ssd_forward_helion(*args, **kw)
    ref = _fp32_forward_ref(args, kw)
    _close(got[2], ref[2], 1e-5, "dt_out")
    _close(got[3], ref[3], 1e-4, "dA_cumsum")
    _close(got[5], ref[5], 1e-2, "final_states vs fp32")
    _close(got[0], ref[0], 2e-2, "out vs fp32")
    _close(got[1], ref[1], 2e-2, "out_x vs fp32")
    try:
        ssd_combined = _mamba_ssm()
    except ImportError as e:  # pragma: no cover - reported, not hidden
        pytest.skip(f"mamba_ssm not importable: {e}")
    m = ssd_combined._mamba_chunk_scan_combined_fwd(*args, **kw)
    _close(got[0], m[0], 2e-2, "out vs mamba-ssm")
    _close(got[5], m[5], 1e-2, "final_states vs mamba-ssm")
    _close(got[4].float(), m[4].float(), 2e-2, "states_in vs mamba-ssm")
    # the fused and unfused state paths agree
    unf = sh.ssd_forward_helion(*args, fuse_state_passing=False, **kw)
    _close(unf[0], got[0], 1e-2, "unfused vs fused out")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("with_seq", [False, True])
def test_gpu_nano_fused_vs_fp32_reference_mamba_ssm_and_chunked(with_seq):
    """The one-launch forward (ssd_forward_fused_helion) at the Nano shape, bf16 inputs, tuned or default config:
    out/out_x 2e-2 and final_states 1e-2 vs the fp32 torch reference, mamba-ssm and the chunked Helion forward;
    dt_out 1e-5, dA_cumsum 1e-4; bitwise repeatable (deterministic: no atomics)."""
    md = NANO
    inp, kw = _nano_gpu_case(with_seq)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], md["c"])
    got = sh.ssd_forward_fused_helion(*args, **kw)
    ref = _fp32_forward_ref(args, kw)
    _close(got[2], ref[2], 1e-5, "fused dt_out")
    _close(got[3], ref[3], 1e-4, "fused dA_cumsum")
    _close(got[4], ref[5], 1e-2, "fused final_states vs fp32")
    _close(got[0], ref[0], 2e-2, "fused out vs fp32")
    _close(got[1], ref[1], 2e-2, "fused out_x vs fp32")
    del ref
    chk = sh.ssd_forward_helion(*args, **kw)
    _close(got[0], chk[0], 2e-2, "fused vs chunked out")
    _close(got[4], chk[5], 1e-2, "fused vs chunked final_states")
    _close(got[3], chk[3], 1e-5, "fused vs chunked dA_cumsum")
    again = sh.ssd_forward_fused_helion(*args, **kw)
    for i, name in enumerate(_FUSED_NAMES):
        assert torch.equal(again[i], got[i]), f"fused {name} not bitwise repeatable"
    try:
        ssd_combined = _mamba_ssm()
    except ImportError as e:  # pragma: no cover - reported, not hidden
        pytest.skip(f"mamba_ssm not importable: {e}")
    m = ssd_combined._mamba_chunk_scan_combined_fwd(*args, **kw)
    _close(got[0], m[0], 2e-2, "fused out vs mamba-ssm")
    _close(got[4], m[5], 1e-2, "fused final_states vs mamba-ssm")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_fused_op_grads_match_chunked_nano():
    """The fused training op at the Nano shape in bf16 with ssd_fwd="fused": output and every gradient within
    2e-2 (relative L2) of ssd_fwd="chunked" (the backward is shared; only the forward's out_x, dt_out, dA_cumsum
    feed it)."""
    from kernels import mamba_split_helion as msh
    from kernels.settings import HelionSettings

    b, l, h, p, g, n, c = (NANO[k] for k in ("b", "l", "h", "p", "g", "n", "c"))
    gen = torch.Generator().manual_seed(0)
    dim = h * p
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale)  # noqa: E731
    t = dict(zxbcdt=r(b, l, 2 * dim + 2 * g * n + h).cuda().bfloat16(),
             conv1d_weight=(r(dim + 2 * g * n, 4) * 0.5).cuda().bfloat16(),
             conv1d_bias=r(dim + 2 * g * n).cuda().bfloat16(), dt_bias=(r(h) * 0.5 - 3.0).cuda(),
             A=-torch.exp(torch.rand(h, generator=gen) * 2.7).cuda(), D=torch.ones(h).cuda())
    do = r(b, l, dim).cuda().bfloat16()
    res = {}
    for mode in ("chunked", "fused"):
        ins = [v.detach().clone().requires_grad_(True) for v in t.values()]
        o = msh.mamba_split_conv1d_scan_combined_helion(*ins, chunk_size=c, headdim=p, ngroups=g,
                                                        settings=HelionSettings(ssd_fwd=mode))
        res[mode] = [o, *torch.autograd.grad((o.float() * do.float()).sum(), ins)]
    for name, a, ref in zip(["out"] + list(t), res["fused"], res["chunked"]):
        rel = ((a.float() - ref.float()).norm() / (ref.float().norm() + 1e-12)).item()
        assert rel <= 2e-2, f"{name}: relative L2 {rel:.3e}"
