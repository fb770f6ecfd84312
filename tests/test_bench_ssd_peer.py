"""bench_ssd_peer.py on CPU: argument checks, the fp32 reference it scores every arm against, and its report."""

import pytest
import torch

from nano_hybrid.bench import bench_ssd_peer as bp


def test_bad_arguments_stop_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bp.parse_args(["--peer-file", str(tmp_path / "missing.py")])
    assert e.value.code == 2 and "no such file" in capsys.readouterr().err
    peer = tmp_path / "ssd_fused5.py"
    peer.write_text("")
    with pytest.raises(SystemExit):
        bp.parse_args(["--peer-file", str(peer), "--shapes", "nano,huge"])
    assert "unknown shape(s) ['huge']" in capsys.readouterr().err
    assert bp.parse_args(["--peer-file", str(peer), "--shapes", "tp2"]).shapes == ["tp2"]


def test_reference_matches_the_step_by_step_recurrence():
    """The fp32 chunked reference that scores the arms equals the fp64 recurrence at a small shape."""
    from kernels.ssd import ssd_recurrence_fp64

    shape = dict(b=1, l=2 * bp.CHUNK + 5, h=2, p=4, g=1, n=8)
    t = bp.inputs(shape, device="cpu", dtype=torch.float32)
    out = bp.reference(t)
    assert out.shape == (1, shape["l"], 2, 4)
    exact = ssd_recurrence_fp64(t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"], dt_bias=t["dt_bias"],
                                dt_softplus=True)
    exact = exact[0] if isinstance(exact, tuple) else exact
    torch.testing.assert_close(out.double(), exact.double(), rtol=1e-4, atol=1e-4)


def test_markdown_reports_every_arm_with_its_ratio_and_error():
    t = {"median": 1.0, "p10": 0.9, "p90": 1.1}
    sp = {"speedup": 2.0, "ci_lo": 1.9, "ci_hi": 2.1}
    res = {"env": {"gpu": "NVIDIA H200"}, "chunk_size": 128, "args": {"dtype": "bf16"}, "arms": ["mamba_ssm", "helion", "mamba_ssm#2"],
           "shapes": {"nano": {"shape": bp.SHAPES["nano"], "arms": ["mamba_ssm", "helion", "mamba_ssm#2"], "failed": {"peer_medium": "ValueError: bf16"}, "times_ms": {a: t for a in ["mamba_ssm", "helion", "mamba_ssm#2"]},
                               "speedup_vs_mamba_ssm": {"helion": sp, "mamba_ssm#2": sp},
                               "device_us_per_call": {"mamba_ssm": 700.0, "helion": 455.0},
                               "max_err_vs_fp32_ref": {"mamba_ssm": 2e-3, "helion": 2e-3}}}}
    md = bp.markdown(res)
    assert "| helion | 1.000 | 0.900-1.100 | 455.0 | 2.000x [1.900, 2.100] | 2.00e-03 |" in md
    assert "| mamba_ssm#2 | 1.000 | 0.900-1.100 | - | 2.000x [1.900, 2.100] | - |" in md
    assert "- peer_medium does not run here: ValueError: bf16" in md


def test_open_peer_arguments_compute_the_plain_ssd(tmp_path, capsys):
    """bench_ssd_helion_example.py's peer arguments (q = C, k = B per head, v = x dt, g = A dt) put into simple GLA's
    contract, o_t = sum_{s<=t} q_t.k_s exp(G_t - G_s) v_s with G the cumulative sum of g (flash-linear-attention's
    ``chunk_simple_gla`` at scale 1), give the plain SSD of the fp32 reference; the Helion example's are the same,
    head-first. A run needs at least one peer folder, and each folder must hold its package."""
    from kernels.ssd import mamba_chunk_scan_combined_ref
    from nano_hybrid.bench import bench_ssd_helion_example as bx

    t = {k: (v.float() if v.is_floating_point() else v) for k, v in
         bx.inputs(dict(b=2, l=40, h=4, p=3, g=2, n=5), device="cpu", dtype=torch.float32).items()}
    e = bx.peer_inputs(t)
    G = e["g"].cumsum(1)  # (b, l, h)
    causal = torch.tril(torch.ones(40, 40, dtype=torch.bool))
    decay = torch.where(causal, (G.transpose(1, 2)[..., :, None] - G.transpose(1, 2)[..., None, :]), float("-inf")).exp()
    scores = torch.einsum("bthk,bshk->bhts", e["q"], e["k"]) * decay
    o = torch.einsum("bhts,bshv->bthv", scores, e["v"])
    ref = mamba_chunk_scan_combined_ref(t["x"], t["dt"], t["A"], t["B"], t["C"], 16, D=None, dt_softplus=False)
    assert torch.allclose(o, ref, rtol=1e-4, atol=1e-5)
    ex = bx.example_inputs(t)
    assert all(torch.equal(ex[k], e[k].transpose(1, 2)) for k in e)
    with pytest.raises(SystemExit):
        bx.parse_args([])
    assert "give --example-dir (the Helion example) and/or --fla-dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bx.parse_args(["--fla-dir", str(tmp_path)])
    assert "no fla/ops/simple_gla/chunk.py there" in capsys.readouterr().err
    (tmp_path / "fla" / "ops" / "simple_gla").mkdir(parents=True)
    (tmp_path / "fla" / "ops" / "simple_gla" / "chunk.py").write_text("")
    assert bx.parse_args(["--fla-dir", str(tmp_path)]).example_dir is None
