"""``tune_kernels.py --merge DIR``: tuned config files from another search (or a user cache) into the committed ones;
no GPU. New shapes are added, shapes already there are kept unless --replace, files stay sorted and readable, and
a bad file stops the merge before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernels import tuning
from nano_hybrid.bench import tune_kernels


S1, S2, S9 = "b1_l64", "b1_l128", "b1_l512"  # shape keys of _entry's dims


def _entry(bs: int, t: float, key: str) -> dict:
    return {"dims": {"b": 1, "l": int(key.split("_l")[1])}, "config": {"block_sizes": [bs], "num_warps": 4},
            "time_ms": t, "date": "2026-12-05T00:00:00+00:00", "gpu": "GPU", "meta": {}}


def _write(root: Path, arch: str, kernel: str, entries: dict) -> Path:
    p = root / arch / f"{kernel}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"kernel": kernel, "arch": arch, "entries": entries}, indent=1) + "\n")
    return p


def _files(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_merge_adds_new_shapes_keeps_or_replaces_the_others(tmp_path, capsys):
    src, dst = tmp_path / "tuned", tmp_path / "configs"
    _write(dst, "sm90", "rmsnorm_fwd", {S2: _entry(32, 2.0, S2), S9: _entry(16, 9.0, S9)})
    _write(src, "sm90", "rmsnorm_fwd", {S1: _entry(64, 1.0, S1), S2: _entry(128, 1.5, S2), S9: _entry(16, 9.0, S9)})
    _write(src, "sm100", "ssd_bwd_dt", {S1: _entry(64, 0.5, S1)})
    (src / "sm90" / "rmsnorm_fwd.failed.json").write_text("{}")  # first-use failure records are not configs
    assert tune_kernels.main(["--merge", str(src), "--out-root", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "merged" in out and "2 added, 0 replaced, 1 the same (1 kept" in out and "--replace replaces them" in out
    k1 = tuning.read_config_file(dst / "sm90" / "rmsnorm_fwd.json")
    assert list(k1["entries"]) == sorted([S1, S2, S9])  # sorted
    assert k1["entries"][S2]["config"]["block_sizes"] == [32]  # kept
    assert k1["entries"][S1] == _entry(64, 1.0, S1)
    k2 = tuning.read_config_file(dst / "sm100" / "ssd_bwd_dt.json")  # a new arch and kernel: a new file
    assert k2["kernel"] == "ssd_bwd_dt" and k2["arch"] == "sm100" and list(k2["entries"]) == [S1]
    # again: nothing changes; with --replace the differing entry is replaced
    before = _files(dst)
    assert tune_kernels.main(["--merge", str(src), "--out-root", str(dst)]) == 0
    assert _files(dst) == before
    capsys.readouterr()
    assert tune_kernels.main(["--merge", str(src), "--out-root", str(dst), "--replace"]) == 0
    assert "0 added, 1 replaced, 3 the same" in capsys.readouterr().out
    assert tuning.read_config_file(dst / "sm90" / "rmsnorm_fwd.json")["entries"][S2]["config"]["block_sizes"] == [128]
    assert not list(dst.rglob("*.tmp"))


@pytest.mark.parametrize("bad", ["src_not_json", "dst_not_json", "path_mismatch", "key_not_dims", "unknown_kernel",
                                 "empty"])
def test_a_bad_file_stops_the_merge_before_any_write(tmp_path, capsys, bad):
    src, dst = tmp_path / "tuned", tmp_path / "configs"
    _write(dst, "sm90", "conv1d_bwd", {S1: _entry(32, 2.0, S1)})
    _write(src, "sm90", "conv1d_bwd", {S2: _entry(64, 1.0, S2)})  # read first (sorted): would be merged if nothing checked
    if bad == "src_not_json":
        (src / "sm90" / "rmsnorm_fwd.json").write_text("{not json")
    elif bad == "dst_not_json":
        _write(src, "sm90", "rmsnorm_fwd", {S1: _entry(64, 1.0, S1)})
        (dst / "sm90" / "rmsnorm_fwd.json").write_text("[]")
    elif bad == "path_mismatch":
        _write(src, "sm90", "rmsnorm_fwd", {S1: _entry(64, 1.0, S1)})
        (src / "sm90" / "rmsnorm_fwd.json").write_text(json.dumps({"kernel": "other", "entries": {}}))
    elif bad == "key_not_dims":
        _write(src, "sm90", "rmsnorm_fwd", {S2: _entry(64, 1.0, S1)})
    elif bad == "unknown_kernel":
        _write(src, "sm90", "not_a_kernel", {S1: _entry(64, 1.0, S1)})
    else:
        src = tmp_path / "nothing_here"
        src.mkdir()
    before = _files(dst)
    assert tune_kernels.main(["--merge", str(src), "--out-root", str(dst)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert _files(dst) == before


def test_replace_without_merge_is_refused(capsys):
    assert tune_kernels.main(["--replace"]) == 2
    assert capsys.readouterr().err == "error: --replace goes with --merge DIR\n"
