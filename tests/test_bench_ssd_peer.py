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
