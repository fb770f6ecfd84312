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
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "split"])
@pytest.mark.skipif(CUDA, reason="CPU interpret-mode test")
def test_forward_matches_reference_and_recurrence(case, fuse):
    b, l, h, p, g, n, c, brk = CASES[case]
    t = _inputs(b, l, h, p, g, n, seed=1, seq_breaks=brk)
    kw = dict(D=t["Dp"] if fuse else t["D"], z=t["z"], dt_bias=t["dt_bias"], initial_states=t["init"],
              seq_idx=t["seq_idx"] if brk else None, dt_softplus=True, dt_limit=(0.0, 1.5))
    ref = ssd.ssd_forward_ref(t["x"], t["dt"], t["A"], t["B"], t["C"], c, **kw)
    got = sh.ssd_forward_helion(t["x"], t["dt"], t["A"], t["B"], t["C"], c, state_passing="fused" if fuse else "split", **kw)
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
    sh.ssd_forward_helion(*args32, state_passing="split", **kw32)
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


def _store_times(root, arch, times_us, dims):
    """Committed-style config files under ``root`` with one exact entry per state kernel at ``dims``."""
    from kernels import tuning

    b, L, h, p, n, c = (dims[k] for k in ("b", "l", "h", "p", "n", "c"))
    kdims = {"ssd_chunk_state_passing": dims, "ssd_chunk_state": dims,
             "ssd_state_passing": dict(b=b, h=h, d=p * n, nc=L // c)}
    for name, t in times_us.items():
        tuning.record(name, kdims[name], {"block_sizes": [16, 16, 16]}, t / 1e3, arch=arch, root=root)


def test_state_passing_choice(tmp_path):
    """``state_passing``: "fused" / "split" decide; "auto" takes the smaller sum of the three kernels' tuned times
    where all three have exact entries (committed, else the user cache), else splits where the fused kernel's
    programs are fewer than a third of the SMs, and runs the fused kernel without a GPU; a bad value is refused."""
    from kernels.settings import HelionSettings, HelionSettingsError

    tp8 = dict(b=1, l=8192, h=8, p=64, g=1, n=128, c=128)
    nano = dict(b=2, l=8192, h=64, p=64, g=8, n=128, c=128)
    kw = dict(arch="sm90", sm_count=132, root=tmp_path / "committed", cache_root=tmp_path / "cache")
    assert sh.choose_state_passing("fused", tp8, **kw)[0] is True
    assert sh.choose_state_passing("split", nano, **kw)[0] is False
    with pytest.raises(ValueError, match="state_passing='on'; choose one of auto, fused, split"):
        sh.choose_state_passing("on", tp8, **kw)
    with pytest.raises(HelionSettingsError, match="kernels.helion.state_passing=True; choose one of auto, fused, split"):
        HelionSettings(state_passing=True)
    # no tuned times: the programs of the fused kernel (b * h * (p / 64) * (n / 64)) against a third of the SMs
    assert sh.fused_state_programs(1, 8, 64, 128) == 16 and sh.fused_state_programs(2, 64, 64, 128) == 256
    fused, why = sh.choose_state_passing("auto", tp8, **kw)
    assert fused is False and "16 programs are fewer than a third of 132 SMs" in why
    assert sh.choose_state_passing("auto", dict(tp8, h=32), **kw)[0] is True  # 64 programs >= 44
    assert sh.choose_state_passing("auto", dict(tp8, h=32), **dict(kw, sm_count=200))[0] is False  # 64 < 66.7
    assert sh.choose_state_passing("auto", tp8, **dict(kw, sm_count=None)) == (True, "no GPU: the fused kernel")
    # tuned times for two of the three kernels are not enough
    _store_times(kw["root"], "sm90", {"ssd_chunk_state_passing": 40.0, "ssd_chunk_state": 12.0}, tp8)
    assert sh.choose_state_passing("auto", tp8, **kw)[1].startswith("no tuned times for both paths")
    # the third in the user cache: the sums decide (40 < 12 + 30), also against the rule
    _store_times(kw["cache_root"], "sm90", {"ssd_state_passing": 30.0}, tp8)
    fused, why = sh.choose_state_passing("auto", tp8, **kw)
    assert fused is True and why == "tuned times: fused 40.0 us, split 12.0 + 30.0 us"
    _store_times(kw["root"], "sm90", {"ssd_chunk_state_passing": 45.0}, tp8)  # now 45 > 42
    assert sh.choose_state_passing("auto", tp8, **kw)[0] is False
    # another arch reads its own files only
    assert sh.choose_state_passing("auto", tp8, **dict(kw, arch="sm100"))[1].startswith("no tuned times")
    # a non-finite stored time is no time
    _store_times(kw["root"], "sm90", {"ssd_chunk_state_passing": float("nan")}, dict(tp8, h=16))
    _store_times(kw["root"], "sm90", {"ssd_chunk_state": 1.0, "ssd_state_passing": 1.0}, dict(tp8, h=16))
    assert sh.choose_state_passing("auto", dict(tp8, h=16), **kw)[1].startswith("no tuned times")


def test_state_passing_auto_on_the_committed_sm90_configs():
    """The committed sm90 tuned times make "auto" split at Nano's TP8 and TP4 ranks (1 x 8192, 8 and 16 heads) and at
    Mamba2-2.7B's chunk 256 (80 heads, 1 group), and fuse at TP1 / TP2 and at Nano's 2 x 8192 (64 heads)."""
    want = {(1, 8, 1, 128): False, (1, 16, 2, 128): False, (1, 32, 4, 128): True, (1, 64, 8, 128): True,
            (2, 64, 8, 128): True, (1, 80, 1, 256): False}
    for (b, h, g, c), fused in want.items():
        dims = dict(b=b, l=8192, h=h, p=64, g=g, n=128, c=c)
        got, why = sh.choose_state_passing("auto", dims, arch="sm90", sm_count=132)
        assert got is fused and why.startswith("tuned times"), (b, h, c, why)


@pytest.mark.skipif(CUDA, reason="CPU interpret-mode test")
def test_state_passing_is_decided_once_per_shape(monkeypatch):
    """The fused op's forward and its backward's recompute (``save_conv_states=false``) take the path decided at the
    first call of a shape, once per runtime; "auto" on the CPU runs the fused kernel."""
    from fused_op_counts import count

    from kernels import tuning
    from kernels.settings import HelionSettings

    calls, launched = [], []
    real_choose, real_run = sh.choose_state_passing, sh._run
    monkeypatch.setattr(sh, "choose_state_passing",
                        lambda mode, dims, **kw: calls.append((mode, dims, kw)) or (False, "test"))
    monkeypatch.setattr(sh, "_run", lambda name, *a, **kw: launched.append(name) or real_run(name, *a, **kw))
    settings = HelionSettings(cache_dir="/nonexistent/auto-test", save_conv_states=False)
    tuning.runtime_for(settings).clear()
    count(settings=settings)
    count(settings=settings)
    assert len(calls) == 1 and calls[0][0] == "auto" and calls[0][2]["sm_count"] is None
    assert calls[0][1] == dict(b=1, l=32, h=4, p=8, g=2, n=16, c=16)
    assert launched.count("ssd_chunk_state") == launched.count("ssd_state_passing") == 4  # 2 x (fwd + recompute)
    assert "ssd_chunk_state_passing" not in launched
    tuning.runtime_for(settings).clear()
    monkeypatch.setattr(sh, "choose_state_passing", real_choose)
    assert sh.choose_state_passing("auto", calls[0][1], **calls[0][2])[0] is True


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
                    "ssd_chunk_scan_cb16"):
            assert "tl.dot" in code and "out_dtype=tl.float32" in code, f"{name}: GEMM not lowered to tl.dot fp32"


def test_tunable_registry_and_defaults():
    from kernels import tuner, tuning

    found = tuner.discover_tunable_kernels()
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
@pytest.mark.gpu_mem(12)
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
    unf = sh.ssd_forward_helion(*args, state_passing="split", **kw)
    _close(unf[0], got[0], 1e-2, "unfused vs fused out")
