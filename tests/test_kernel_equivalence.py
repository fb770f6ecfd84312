"""scripts/kernel_equivalence.py: the comparison, its exit status, and one end-to-end run on CPU (interpret mode)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nano_hybrid.bench import kernel_equivalence as ke
from nano_hybrid.bench import kernel_equivalence_worker as kew

REPO = Path(__file__).resolve().parents[1]
# the test-only aten::mm.dtype shim of tests/conftest.py, for the tool's worker processes (interpret mode on CPU)
_SHIM = """import torch
try:
    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl("mm.dtype", lambda a, b, out_dtype: torch.mm(a.float(), b.float()).to(out_dtype), "CPU")
except RuntimeError:
    pass
"""


def test_compare_reports_bitwise_equality_and_max_diff():
    a = {"c": {"x": torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "y": torch.zeros(3)}}
    same = {"c": {k: v.clone() for k, v in a["c"].items()}}
    cmp = ke.compare(a, same)
    assert ke.all_equal(cmp) and cmp["c"]["x"]["max_abs_diff"] == 0.0
    off = {"c": {"x": torch.tensor([1.0, 2.015625], dtype=torch.bfloat16), "y": torch.zeros(3)}}
    cmp = ke.compare(a, off)
    assert not ke.all_equal(cmp) and not cmp["c"]["x"]["bitwise_equal"] and cmp["c"]["y"]["bitwise_equal"]
    assert cmp["c"]["x"]["max_abs_diff"] == pytest.approx(0.015625)
    nan = {"c": {"x": torch.tensor([1.0, float("nan")], dtype=torch.bfloat16), "y": torch.zeros(3)}}
    assert not ke.all_equal(ke.compare(nan, nan))  # NaN is never equal
    assert not ke.all_equal(ke.compare(a, {"c": {"x": a["c"]["x"].float(), "y": a["c"]["y"]}}))  # dtype differs
    md = ke.markdown({"shape": "tiny", "shape_dims": {}, "device": "cpu", "reference_tree": "r", "current_tree": "c",
                      "command": "x", "reference_vs_current": cmp, "control": ke.compare(a, same), "equal": False,
                      "control_equal": True})
    assert "| c | x | (2,) | NO |" in md and "Reference and current bitwise equal: False" in md


def test_inputs_have_a_document_shorter_than_the_conv_width():
    _, _, seq = kew._inputs(kew.SHAPES["tiny"], 0, "cpu")
    for row in seq:
        lengths = torch.unique_consecutive(row, return_counts=True)[1]
        assert lengths.min() == 2 and len(lengths) == 5 and bool((row[1:] >= row[:-1]).all())
    assert not torch.equal(seq[0], seq[1])


def test_bad_reference_tree_is_exit_2(tmp_path, capsys):
    assert ke.main(["--reference-tree", str(tmp_path)]) == 2
    assert "has no kernels/ package" in capsys.readouterr().err
    assert ke.main([]) == 2


@pytest.mark.slow  # three interpret-mode worker processes: minutes on a 2-core box
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpret-mode run")
def test_end_to_end_current_tree_against_itself_on_cpu(tmp_path):
    """The whole tool at the tiny shape (three worker processes in interpret mode): the tree against itself is
    bitwise equal in all three cases, every output and gradient is compared, and the report is written."""
    (tmp_path / "shim").mkdir()
    (tmp_path / "shim" / "sitecustomize.py").write_text(_SHIM)
    env = {k: v for k, v in os.environ.items() if k != "HELION_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "shim"), str(REPO)])  # the shim, and this checkout's packages
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "kernel_equivalence.py"), "--reference-tree", str(REPO),
                        "--shape", "tiny", "--device", "cpu", "--out", str(tmp_path / "out")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "kernel_equivalence.json").read_text())
    assert res["equal"] and res["control_equal"]
    names = {"mixer_out", "norm_out", "grad_zxbcdt", "grad_conv1d_weight", "grad_conv1d_bias", "grad_dt_bias", "grad_A",
             "grad_D", "grad_norm_weight"}
    for part in ("reference_vs_current", "control"):
        assert set(res[part]) == {"no_seq_idx", "seq_idx", "megatron_layout"}
        for rows in res[part].values():
            assert set(rows) == names and all(v["max_abs_diff"] == 0.0 for v in rows.values())
    assert (tmp_path / "out" / "kernel_equivalence.md").read_text().count(" | yes | 0 | yes | 0 |") == 3 * len(names)
