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


@pytest.mark.parametrize("case", ["g1", "g4_seq", "g2_odd_seq_c16"])
@pytest.mark.parametrize("small_blocks", [False, True])
@pytest.mark.skipif(CUDA, reason="CPU interpret-mode test")
def test_forward_variant_v2_matches_reference(case, small_blocks, monkeypatch):
    """variant="v2" (ssd_chunk_scan_v2) gives the reference forward; small_blocks runs the
    multi-tile causal path (interpret mode otherwise uses one tile of the whole chunk)."""
    if small_blocks:
        import helion.language as hl

        monkeypatch.setattr(hl.register_block_size, "_ref_fn", lambda lo, hi=None: lo)
    b, l, h, p, g, n, c, brk = CASES[case]
    t = _inputs(b, l, h, p, g, n, seed=1, seq_breaks=brk)
    kw = dict(D=t["Dp"], z=t["z"], dt_bias=t["dt_bias"], initial_states=t["init"],
              seq_idx=t["seq_idx"] if brk else None, dt_softplus=True, dt_limit=(0.0, 1.5))
    ref = ssd.ssd_forward_ref(t["x"], t["dt"], t["A"], t["B"], t["C"], c, **kw)
    got = sh.ssd_forward_helion(t["x"], t["dt"], t["A"], t["B"], t["C"], c, variant="v2", **kw)
    for name, a, r in zip(["out", "out_x"], got, ref):
        _close(a, r, 1e-4, name)
    assert sh.get_variant() == sh.DEFAULT_VARIANT
    with pytest.raises(ValueError, match="unknown SSD forward variant"):
        sh.set_variant("v3")


# forward variant v5 (ssd_chunk_cumsum_state_passing): (b, l, h, p, g, n, c, seq_breaks, dt_bias, dt_limit, softplus,
# initial states). p or n of 32 gives several p/n blocks per head with the small blocks (16), i.e. several
# programs per (b, h) of which exactly one writes dt_out / dA_cumsum.
V5_CASES = {
    "g1": (2, 64, 2, 16, 1, 16, 32, (), True, (0.0, float("inf")), True, False),
    "g2_odd_nobias_limit": (1, 75, 4, 32, 2, 32, 32, (), False, (0.05, 1.5), True, True),
    "g4_seq_init": (2, 96, 4, 32, 4, 16, 32, (20, 41, 64), True, (0.0, 1.5), True, True),
    "g2_odd_seq_c16": (1, 53, 4, 16, 2, 32, 16, (7, 30), True, (0.0, float("inf")), True, True),
    "g2_nosoftplus": (1, 64, 4, 32, 2, 32, 32, (), True, (0.0, float("inf")), False, False),
}
_FWD_NAMES = ["out", "out_x", "dt_out", "dA_cumsum", "states_in", "final_states"]


def _small_blocks(monkeypatch):
    """Interpret mode runs every register_block_size at its maximum (one program per head, one k-block);
    this makes them 16: several p/n programs per head and several k-blocks per chunk."""
    import helion.language as hl

    monkeypatch.setattr(hl.register_block_size, "_ref_fn", lambda lo, hi=None: lo)


def _v5_args(case, seed=3):
    b, l, h, p, g, n, c, brk, bias, lim, sp, init = V5_CASES[case]
    t = _inputs(b, l, h, p, g, n, seed=seed, seq_breaks=brk)
    if not sp:
        # dt (+ dt_bias >= -0.5) used as is: kept positive, since the kernels clamp at dt_min = 0 always (as
        # mamba-ssm) while the torch reference clamps only for a non-default dt_limit
        t["dt"] = t["dt"].abs() * 0.5 + 0.5
    kw = dict(D=t["D"], z=t["z"], dt_bias=t["dt_bias"] if bias else None, initial_states=t["init"] if init else None,
              seq_idx=t["seq_idx"] if brk else None, dt_softplus=sp, dt_limit=lim)
    return (t["x"], t["dt"], t["A"], t["B"], t["C"], c), kw


@pytest.mark.parametrize("case", list(V5_CASES))
@pytest.mark.parametrize("small_blocks", [False, True])
@pytest.mark.skipif(CUDA, reason="CPU interpret-mode test")
def test_forward_variant_v5_matches_v1(case, small_blocks, monkeypatch):
    """variant="v5" (the chunk cumsum computed inside chunk_state_passing) gives v1's six forward outputs:
    bitwise with interpret mode's whole-extent blocks (one k-block: the same fp32 operations as the two
    kernels), to 1e-5 of their scale with blocks of 16 (the cumsum carried across k-blocks, the accumulator
    rescaled per block); and the reference forward to 1e-4."""
    if small_blocks:
        _small_blocks(monkeypatch)
    args, kw = _v5_args(case)
    v1 = sh.ssd_forward_helion(*args, variant="v1", **kw)
    v5 = sh.ssd_forward_helion(*args, variant="v5", **kw)
    ref = ssd.ssd_forward_ref(*args, **kw)
    for name, a, r1, r in zip(_FWD_NAMES, v5, v1, ref):
        assert a.dtype == r1.dtype and a.shape == r1.shape, name
        if small_blocks:
            _close(a, r1, 1e-5, f"{name} v5 vs v1")
        else:
            assert torch.equal(a, r1), f"{name}: v5 differs from v1 (max {(a.float() - r1.float()).abs().max():.3g})"
        _close(a, r, 1e-4, f"{name} v5 vs reference")
    assert sh.get_variant() == sh.DEFAULT_VARIANT


@pytest.mark.parametrize("small_blocks", [False, True])
@pytest.mark.skipif(CUDA, reason="CPU interpret-mode test")
def test_chunk_cumsum_state_passing_piece(small_blocks, monkeypatch):
    """The fused piece on dt read in place from a zxBCdt-shaped buffer (strided), odd seqlen, seq_idx and
    initial states, states_in in bf16 and fp32: the values of ssd_chunk_cumsum_helion followed by
    ssd_chunk_state_passing_helion, dt_out zero past the sequence end."""
    if small_blocks:
        _small_blocks(monkeypatch)
    b, l, h, p, g, n, c = 2, 45, 4, 32, 2, 32, 16
    t = _inputs(b, l, h, p, g, n, seed=4, seq_breaks=(11, 30))
    row = 2 * h * p + 2 * g * n + h
    zx = torch.randn(b, l, row, generator=torch.Generator().manual_seed(5))
    zx[..., row - h:] = t["dt"]
    dt = zx[..., row - h:]
    assert not dt.is_contiguous()
    kw = dict(dt_bias=t["dt_bias"], dt_softplus=True, dt_limit=(0.01, 3.0))
    for sdtype in (torch.bfloat16, torch.float32):
        dA, dto = sh.ssd_chunk_cumsum_helion(dt, t["A"], c, variant="v1", **kw)  # v5 fuses v1's cumsum
        sin, fin = sh.ssd_chunk_state_passing_helion(t["B"], t["x"], dto, dA, initial_states=t["init"],
                                                     seq_idx=t["seq_idx"], state_dtype=sdtype)
        got = sh.ssd_chunk_cumsum_state_passing_helion(t["B"], t["x"], dt, t["A"], c, initial_states=t["init"],
                                                       seq_idx=t["seq_idx"], state_dtype=sdtype, **kw)
        for name, a, r in zip(["dA_cumsum", "dt_out", "states_in", "final_states"], got, (dA, dto, sin, fin)):
            assert a.dtype == r.dtype and a.shape == r.shape, name
            if small_blocks:
                _close(a, r, 1e-5, name)
            else:
                assert torch.equal(a, r), name
        assert got[2].dtype == sdtype and torch.all(got[1].reshape(b, h, -1)[:, :, l:] == 0)
    # the dispatcher picks the fused kernel for v5 and the two kernels for v1
    for v in ("v1", "v5"):
        res = sh.ssd_cumsum_states_helion(t["B"], t["x"], dt, t["A"], c, initial_states=t["init"],
                                          seq_idx=t["seq_idx"], variant=v, **kw)
        for a, r in zip(res, got[:2]):
            _close(a, r, 1e-5, f"dispatch {v}")


def _record_kernels(monkeypatch):
    names = []
    real = sh._run

    def run(name, *a, **kw):
        names.append(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(sh, "_run", run)
    return names


@pytest.mark.skipif(CUDA, reason="CPU interpret-mode test")
def test_variant_v5_launches_the_fused_kernel(monkeypatch):
    """v5 replaces the cumsum and chunk_state_passing launches by one, through variant= and set_variant; the
    unfused state path (fuse_state_passing=False) keeps the separate cumsum; v1 is unchanged."""
    assert sh.VARIANTS["v5"] == {"ssd_chunk_cumsum": "ssd_chunk_cumsum_state_passing",
                                 "ssd_chunk_state_passing": "ssd_chunk_cumsum_state_passing"}
    names = _record_kernels(monkeypatch)
    from kernels import tuning

    dims = {}
    real_get = tuning.get_config

    def get_config(name, d, default, **k):
        dims.setdefault(name, dict(d))
        return real_get(name, d, default, **k)

    monkeypatch.setattr(tuning, "get_config", get_config)
    args, kw = _v5_args("g2_odd_nobias_limit")
    sh.ssd_forward_helion(*args, variant="v5", **kw)
    assert names == ["ssd_chunk_cumsum_state_passing", "ssd_bmm_chunk", "ssd_chunk_scan"], names
    # its config is looked up under chunk_state_passing's shape key (l padded to whole chunks), the dims tuning uses
    b, l, h, p, g, n, c = V5_CASES["g2_odd_nobias_limit"][:7]
    md = dict(b=b, l=l, h=h, p=p, g=g, n=n, c=c)
    assert dims["ssd_chunk_cumsum_state_passing"] == dims["ssd_chunk_scan"] == dict(md, l=96)
    assert sh.TUNABLE_KERNELS["ssd_chunk_cumsum_state_passing"](md, "cpu").dims == dict(md, l=96)
    args, kw = _v5_args("g1")
    names.clear()
    sh.ssd_forward_helion(*args, variant="v1", **kw)
    assert names == ["ssd_chunk_cumsum", "ssd_chunk_state_passing", "ssd_bmm_chunk", "ssd_chunk_scan"], names
    names.clear()
    try:
        sh.set_variant("v5")
        sh.mamba_chunk_scan_combined_helion(*args, **kw)
        assert names[0] == "ssd_chunk_cumsum_state_passing" and "ssd_chunk_cumsum" not in names, names
        names.clear()
        sh.ssd_forward_helion(*args, fuse_state_passing=False, **kw)
        assert names[:3] == ["ssd_chunk_cumsum", "ssd_chunk_state", "ssd_state_passing"], names
    finally:
        sh.set_variant(sh.DEFAULT_VARIANT)


def _to16(args, kw):
    """_v5_args with x, B, C and z in bf16 (the inputs' dtype decides CB's in v8 / v10)."""
    x, dt, A, B, C, c = args
    return (x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), c), dict(kw, z=kw["z"].bfloat16())


@pytest.mark.parametrize("case", ["g1", "g4_seq_init", "g2_odd_seq_c16", "g2_nosoftplus"])
@pytest.mark.parametrize("small_blocks", [False, True])
@pytest.mark.skipif(CUDA, reason="CPU interpret-mode test")
def test_forward_variants_v8_v9_v10(case, small_blocks, monkeypatch):
    """fp32 inputs: v8 (CB in the inputs' dtype between the bmm and chunk_scan) is v1 bitwise; v9 / v10
    (ssd_chunk_cumsum_t: the cumsum on (heads, chunk) tiles, softplus as log(1 + exp2(d log2 e))) give v1's six outputs
    to 1e-5 of their scale and the reference's to 1e-4. bf16 inputs: v8 and v10 (CB in bf16) give v1's out / out_x
    to 2e-2 of their scale and its other four outputs exactly (v8) or to 1e-5 (v10)."""
    if small_blocks:
        _small_blocks(monkeypatch)
    args, kw = _v5_args(case)
    v1 = sh.ssd_forward_helion(*args, variant="v1", **kw)
    ref = ssd.ssd_forward_ref(*args, **kw)
    for v in ("v8", "v9", "v10"):
        got = sh.ssd_forward_helion(*args, variant=v, **kw)
        for name, a, r1, r in zip(_FWD_NAMES, got, v1, ref):
            assert a.dtype == r1.dtype and a.shape == r1.shape, (v, name)
            if v == "v8":
                assert torch.equal(a, r1), f"{v} {name}: differs from v1"
            else:
                _close(a, r1, 1e-5, f"{v} {name} vs v1")
                _close(a, r, 1e-4, f"{v} {name} vs reference")
    args16, kw16 = _to16(args, kw)
    v1 = sh.ssd_forward_helion(*args16, variant="v1", **kw16)
    for v in ("v8", "v10"):
        got = sh.ssd_forward_helion(*args16, variant=v, **kw16)
        for i, (name, a, r1) in enumerate(zip(_FWD_NAMES, got, v1)):
            assert a.dtype == r1.dtype and a.shape == r1.shape, (v, name)
            if i < 2:
                _close(a, r1, 2e-2, f"bf16 {v} {name} vs v1")
            elif v == "v8":
                assert torch.equal(a, r1), f"bf16 {v} {name}: differs from v1"
            else:
                _close(a, r1, 1e-5, f"bf16 {v} {name} vs v1")
    assert sh.get_variant() == sh.DEFAULT_VARIANT == "v10"


@pytest.mark.skipif(CUDA, reason="CPU interpret-mode test")
def test_variants_v8_v9_v10_launch_their_kernels(monkeypatch):
    """The kernels each variant launches with bf16 inputs (fp32 inputs keep v1's chunk_scan and an fp32 CB); the
    bmm writes CB in bf16 exactly when chunk_scan_cb16 reads it, and chunk_scan refuses a CB of the other dtype."""
    names = _record_kernels(monkeypatch)
    args, kw = _to16(*_v5_args("g1"))
    expect = {
        "v1": ["ssd_chunk_cumsum", "ssd_chunk_state_passing", "ssd_bmm_chunk", "ssd_chunk_scan"],
        "v8": ["ssd_chunk_cumsum", "ssd_chunk_state_passing", "ssd_bmm_chunk", "ssd_chunk_scan_cb16"],
        "v9": ["ssd_chunk_cumsum_t", "ssd_chunk_state_passing", "ssd_bmm_chunk", "ssd_chunk_scan"],
        "v10": ["ssd_chunk_cumsum_t", "ssd_chunk_state_passing", "ssd_bmm_chunk", "ssd_chunk_scan_cb16"],
    }
    for v, want in expect.items():
        names.clear()
        sh.ssd_forward_helion(*args, variant=v, **kw)
        assert names == want, (v, names)
        assert sh.forward_cb_dtype(v, torch.bfloat16) == (torch.bfloat16 if v in ("v8", "v10") else torch.float32)
        assert sh.forward_cb_dtype(v, torch.float32) == torch.float32
    names.clear()
    sh.ssd_forward_helion(*_v5_args("g1")[0], variant="v10", **_v5_args("g1")[1])  # fp32 inputs
    assert names == ["ssd_chunk_cumsum_t", "ssd_chunk_state_passing", "ssd_bmm_chunk", "ssd_chunk_scan"], names
    x, dt, A, B, C, c = args
    CB = sh.ssd_bmm_chunk_helion(C, B, c)
    CB16 = sh.ssd_bmm_chunk_helion(C, B, c, cb_dtype=torch.bfloat16)
    assert CB.dtype == torch.float32 and CB16.dtype == torch.bfloat16
    assert torch.equal(CB16, CB.to(torch.bfloat16))
    dA, dto = sh.ssd_chunk_cumsum_helion(dt, A, c, dt_bias=kw["dt_bias"], dt_softplus=True)
    st = torch.zeros(x.shape[0], CB.shape[1], x.shape[2], x.shape[3], C.shape[3], dtype=x.dtype)
    with pytest.raises(ValueError, match="reads CB in torch.bfloat16"):
        sh.ssd_chunk_scan_helion(CB, x, dto, dA, C, st, variant="v8")
    with pytest.raises(ValueError, match="reads CB in torch.float32"):
        sh.ssd_chunk_scan_helion(CB16, x, dto, dA, C, st, variant="v1")


@pytest.mark.skipif(CUDA, reason="CPU interpret-mode test")
def test_fwd_variant_env_default():
    """NANO_HELION_SSD_FWD_VARIANT sets the module default at import; an unknown name fails with the known ones."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = "from kernels import ssd_helion as sh; print(sh.get_variant())"
    for val, ok in (("v5", True), ("v7", False)):
        env = {**os.environ, "NANO_HELION_SSD_FWD_VARIANT": val, "PYTHONPATH": str(root)}
        r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
        if ok:
            assert r.returncode == 0 and r.stdout.strip() == val, r.stderr[-2000:]
        else:
            assert r.returncode != 0 and "unknown SSD forward variant" in r.stderr and "'v5'" in r.stderr


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
    with pytest.raises(ValueError, match="does not match dt"):
        sh.ssd_chunk_cumsum_state_passing_helion(t["B"], t["x"], t["dt"][:, :8], t["A"], 16)
    with pytest.raises(ValueError, match="seq_idx must be"):
        sh.ssd_chunk_cumsum_state_passing_helion(t["B"], t["x"], t["dt"], t["A"], 16, seq_idx=t["seq_idx"][:, :8])
    with pytest.raises(ValueError, match="unknown SSD forward variant"):
        sh.ssd_forward_helion(t["x"], t["dt"], t["A"], t["B"], t["C"], 16, variant="v3")
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
        if name in ("ssd_chunk_state", "ssd_chunk_state_passing", "ssd_chunk_cumsum_state_passing", "ssd_bmm_chunk",
                    "ssd_chunk_scan", "ssd_chunk_scan_v2", "ssd_chunk_scan_cb16"):
            assert "tl.dot" in code and "out_dtype=tl.float32" in code, f"{name}: GEMM not lowered to tl.dot fp32"


def _enclosing_block(lines: list[str], i: int) -> str:
    """The statement that opens the block line i of generated code sits in (nearest less-indented code line)."""
    ind = len(lines[i]) - len(lines[i].lstrip())
    for j in range(i - 1, -1, -1):
        t = lines[j].strip()
        if t and not t.startswith("#") and len(lines[j]) - len(lines[j].lstrip()) < ind:
            return t
    return ""


def _sm90_cubin(code: str, host_name: str, args: tuple) -> dict:
    """Compile Helion's generated Triton module for sm90 with Triton's own compiler and ptxas (no GPU needed):
    the host wrapper runs with a launcher that records the device kernel's arguments instead of launching."""
    import importlib.util
    import tempfile
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    d = Path(tempfile.mkdtemp())
    (d / "gen.py").write_text(code)
    spec = importlib.util.spec_from_file_location("helion_gen_sm90", d / "gen.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    got = {}

    def launcher(kernel, grid, *a, **kw):
        got.update(kernel=kernel, grid=grid, args=a, kw=kw)

    getattr(mod, host_name)(*args, _launcher=launcher)
    jit = got["kernel"]
    sig, const = {}, {}
    for name, param, val in zip(jit.arg_names, jit.params, got["args"]):
        if param.is_constexpr:
            sig[name], const[name] = "constexpr", val
        else:
            sig[name] = mangle_type(val)
    ck = triton.compile(ASTSource(jit, sig, const), target=GPUTarget("cuda", 90, 32),
                        options={k: got["kw"][k] for k in ("num_warps", "num_stages") if k in got["kw"]})
    return ck.asm


@pytest.mark.parametrize("block_k", [128, 64])
def test_cumsum_state_passing_codegen_one_writer_sm90(block_k, monkeypatch):
    """ssd_chunk_cumsum_state_passing at the Nano shape (dt strided in a zxBCdt row, as the fused op passes it):
    the stores of dt_out and dA_cumsum sit in a scalar `if` on the p-block and n-block offsets both being 0 (one
    writer per (b, h, chunk)); states_in / final_states are stored by every program; the Triton module compiles
    for sm90 down to a cubin (Triton's front end and ptxas, no GPU)."""
    import re

    monkeypatch.delenv("HELION_INTERPRET", raising=False)
    name = "ssd_chunk_cumsum_state_passing"
    md = dict(b=2, l=256, h=8, p=64, g=2, n=128, c=128)
    args, _ = sh._kernel_args(name, md, "cpu")
    assert args[2].stride(1) == 2 * 8 * 64 + 2 * 2 * 128 + 8  # dt read in place from the zxBCdt row
    kern = helion.kernel(sh._BODIES[name], static_shapes=True, ignore_warnings=[helion.exc.TensorOperationInWrapper])
    cfg = dict(sh.DEFAULT_CONFIGS[name], block_sizes=[64, 64, block_k])
    code = kern.bind(args).to_triton_code(helion.Config(**cfg))
    lines = code.splitlines()

    def stores(t):
        return [i for i, ln in enumerate(lines) if ln.strip().startswith(f"tl.store({t} +")]

    # the p / n tile offsets: those of the index vectors of the states_in store
    (si,) = stores("states_in")
    tile_idx = re.findall(r"indices_(\d+)\[", lines[si])
    assert len(tile_idx) == 2, lines[si]
    offs = {f"offset_{k}" for k in tile_idx}
    for t in ("dt_out", "dA_cumsum"):
        (i,) = stores(t)
        m = re.fullmatch(r"if (\w+):", _enclosing_block(lines, i))
        assert m, f"{t} store not under an if: {_enclosing_block(lines, i)!r}"
        (cond,) = [ln.strip() for ln in lines[:i] if re.fullmatch(rf"{m.group(1)} = \w+ and \w+", ln.strip())]
        parts = cond.split(" = ", 1)[1].split(" and ")
        tested = set()
        for part in parts:
            (defn,) = [ln.strip() for ln in lines[:i] if ln.strip().startswith(f"{part} = ")]
            mm = re.fullmatch(rf"{part} = (offset_\d+) == 0", defn)
            assert mm, defn
            tested.add(mm.group(1))
        assert tested == offs, (tested, offs)
    for t in ("states_in", "final_states"):
        (i,) = stores(t)
        assert not _enclosing_block(lines, i).startswith("if "), t
    asm = _sm90_cubin(code, sh._BODIES[name].__name__, args)
    assert len(asm["cubin"]) > 0 and "wgmma" in asm["ptx"] and ".target sm_90" in asm["ptx"]


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


def _close_to_v1(got, v1, variant: str) -> None:
    """A forward variant's outputs against v1's: same dtypes and shapes; dt_out / dA_cumsum / final_states / states
    within 1e-6 / 1e-5 / 1e-3 / 1e-2, out / out_x within 1e-2 (of v1's scale)."""
    for i, tol in ((2, 1e-6), (3, 1e-5), (5, 1e-3), (4, 1e-2), (0, 1e-2), (1, 1e-2)):
        assert got[i].dtype == v1[i].dtype and got[i].shape == v1[i].shape, _FWD_NAMES[i]
        _close(got[i], v1[i], tol, f"{_FWD_NAMES[i]} {variant} vs v1")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("with_seq", [False, True])
def test_gpu_nano_variant_v5_matches_v1(with_seq):
    """Forward variant v5 (cumsum inside chunk_state_passing) at the Nano shape, bf16, dt read strided from a
    zxBCdt-shaped buffer (as the fused op passes it): v1's outputs (dt_out 1e-6, dA_cumsum 1e-5, final_states
    1e-3, states_in (bf16) / out / out_x 1e-2 of their scale) and the fp32 reference (as the v1 test)."""
    md = NANO
    inp, kw = _nano_gpu_case(with_seq)
    (_, _, dts, *_), _ = sh._kernel_args("ssd_chunk_cumsum_state_passing", md, "cuda")
    assert not dts.is_contiguous()
    args = (inp["x"], dts, inp["A"], inp["B"], inp["C"], md["c"])
    v1 = sh.ssd_forward_helion(*args, variant="v1", **kw)
    v5 = sh.ssd_forward_helion(*args, variant="v5", **kw)
    _close_to_v1(v5, v1, "v5")
    ref = _fp32_forward_ref(args, kw)
    _close(v5[2], ref[2], 1e-5, "dt_out vs fp32")
    _close(v5[3], ref[3], 1e-4, "dA_cumsum vs fp32")
    _close(v5[5], ref[5], 1e-2, "final_states vs fp32")
    _close(v5[0], ref[0], 2e-2, "out vs fp32")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("variant", ["v8", "v9", "v10"])
def test_gpu_nano_variants_v8_v9_v10(variant):
    """Forward variants v8 (CB in bf16), v9 (cumsum on (heads, chunk) tiles) and v10 (both) at the Nano shape, bf16,
    seq_idx and initial states, dt read strided from a zxBCdt-shaped buffer: v1's dt_out / dA_cumsum / states /
    final_states (1e-6 / 1e-5 / 1e-2 / 1e-3) and out / out_x within 1e-2 of v1's scale; against the fp32 reference
    the v1 test's tolerances, and the error of out against the fp32 reference at most 1.25x v1's + 1e-4 (relative
    L2), the accuracy check that bf16 CB needs."""
    md = NANO
    inp, kw = _nano_gpu_case(True)
    (dts, *_), _ = sh._kernel_args("ssd_chunk_cumsum", md, "cuda")
    args = (inp["x"], dts, inp["A"], inp["B"], inp["C"], md["c"])
    v1 = sh.ssd_forward_helion(*args, variant="v1", **kw)
    got = sh.ssd_forward_helion(*args, variant=variant, **kw)
    _close_to_v1(got, v1, variant)
    ref = _fp32_forward_ref(args, kw)
    _close(got[0], ref[0], 2e-2, "out vs fp32")
    _close(got[1], ref[1], 2e-2, "out_x vs fp32")

    def rel(a, r):
        return ((a.float() - r.float()).norm() / r.float().norm()).item()

    e1, ev = rel(v1[0], ref[0]), rel(got[0], ref[0])
    print(f"{variant}: out rel. L2 vs fp32 reference {ev:.3e} (v1 {e1:.3e})")
    assert ev <= 1.25 * e1 + 1e-4, (ev, e1)
