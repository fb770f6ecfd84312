"""``tune_kernels.py --merge DIR``: tuned config files from another search (or a user cache) into the committed ones;
no GPU. New shapes are added, shapes already there are kept unless --replace, files stay sorted and readable, and
a bad file stops the merge before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernels import tuning
from nano_hybrid.bench import tune_kernels


def _entry(bs: int, t: float) -> dict:
    return {"dims": {"b": 1, "l": 64}, "config": {"block_sizes": [bs], "num_warps": 4}, "time_ms": t,
            "date": "2026-12-05T00:00:00+00:00", "gpu": "GPU", "meta": {}}


def _write(root: Path, arch: str, kernel: str, entries: dict) -> Path:
    p = root / arch / f"{kernel}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"kernel": kernel, "arch": arch, "entries": entries}, indent=1) + "\n")
    return p


def _files(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_merge_adds_new_shapes_keeps_or_replaces_the_others(tmp_path, capsys):
    src, dst = tmp_path / "tuned", tmp_path / "configs"
    _write(dst, "sm90", "k1", {"s2": _entry(32, 2.0), "s9": _entry(16, 9.0)})
    _write(src, "sm90", "k1", {"s1": _entry(64, 1.0), "s2": _entry(128, 1.5), "s9": _entry(16, 9.0)})
    _write(src, "sm100", "k2", {"s1": _entry(64, 0.5)})
    (src / "sm90" / "k1.failed.json").write_text("{}")  # first-use failure records are not configs
    assert tune_kernels.main(["--merge", str(src), "--out-root", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "merged" in out and "2 added, 0 replaced, 1 the same (1 kept" in out and "--replace replaces them" in out
    k1 = tuning.read_config_file(dst / "sm90" / "k1.json")
    assert list(k1["entries"]) == ["s1", "s2", "s9"]  # sorted
    assert k1["entries"]["s2"]["config"]["block_sizes"] == [32]  # kept
    assert k1["entries"]["s1"] == _entry(64, 1.0)
    k2 = tuning.read_config_file(dst / "sm100" / "k2.json")  # a new arch and kernel: a new file
    assert k2["kernel"] == "k2" and k2["arch"] == "sm100" and list(k2["entries"]) == ["s1"]
    # again: nothing changes; with --replace the differing entry is replaced
    before = _files(dst)
    assert tune_kernels.main(["--merge", str(src), "--out-root", str(dst)]) == 0
    assert _files(dst) == before
    capsys.readouterr()
    assert tune_kernels.main(["--merge", str(src), "--out-root", str(dst), "--replace"]) == 0
    assert "0 added, 1 replaced, 3 the same" in capsys.readouterr().out
    assert tuning.read_config_file(dst / "sm90" / "k1.json")["entries"]["s2"]["config"]["block_sizes"] == [128]
    assert not list(dst.rglob("*.tmp"))


@pytest.mark.parametrize("bad", ["src_not_json", "dst_not_json", "path_mismatch", "empty"])
def test_a_bad_file_stops_the_merge_before_any_write(tmp_path, capsys, bad):
    src, dst = tmp_path / "tuned", tmp_path / "configs"
    _write(dst, "sm90", "k0", {"s1": _entry(32, 2.0)})
    _write(src, "sm90", "k0", {"s2": _entry(64, 1.0)})  # read first (sorted): would be merged if nothing checked
    if bad == "src_not_json":
        (src / "sm90" / "k1.json").write_text("{not json")
    elif bad == "dst_not_json":
        _write(src, "sm90", "k1", {"s1": _entry(64, 1.0)})
        (dst / "sm90" / "k1.json").write_text("[]")
    elif bad == "path_mismatch":
        _write(src, "sm90", "k1", {"s1": _entry(64, 1.0)})
        (src / "sm90" / "k1.json").write_text(json.dumps({"kernel": "other", "entries": {}}))
    else:
        src = tmp_path / "nothing_here"
        src.mkdir()
    before = _files(dst)
    assert tune_kernels.main(["--merge", str(src), "--out-root", str(dst)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert _files(dst) == before


def test_replace_without_merge_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        tune_kernels.main(["--replace"])
    assert e.value.code == 2 and "--replace goes with --merge DIR" in capsys.readouterr().err
