"""The corpus builder (nano_hybrid/data/corpus.py, scripts/prepare_corpus.py) on a small synthetic tree: selection,
deduplication, whole held-out packages, a manifest hash that does not depend on the worker count, --check, and
one-line errors for bad input."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402

from nano_hybrid.data.corpus import (  # noqa: E402
    CorpusError,
    CorpusSettings,
    build_corpus,
    check_corpus,
    read_table,
    scan,
)
from nano_hybrid.tools import prepare_corpus  # noqa: E402
from nano_hybrid.data.tokenizer import TokenizerSpec  # noqa: E402

BYTE = TokenizerSpec("byte")


def _tree(root: Path) -> Path:
    files = {
        "pkga/__init__.py": "def alpha():\n    return 'ALPHA-MARK'\n" * 3,
        "pkga/copy.py": "shared = 'SHARED-CONTENT-0123456789'\n",
        "pkga/spaced.py": "x  =  1\nif x:\n    y = 'WS-MARK'\n",
        "pkga/__pycache__/cached.py": "cached = 'compiled'  # excluded by default\n",
        "pkgb/copy_again.py": "shared = 'SHARED-CONTENT-0123456789'\n",  # exact duplicate of pkga/copy.py
        "pkgb/spaced_too.py": "x = 1\nif x:\n  y = 'WS-MARK'\n",  # pkga/spaced.py up to whitespace
        "pkgb/big.txt": "B" * 5000,  # above max_bytes
        "pkgb/tiny.py": "x=1\n",  # below min_bytes
        "pkgv/held.py": "def held_out():\n    return 'VALID-MARK-XYZ'\n",
        "pkgv/docs.md": "# Held-out package\n\nIts documentation, VALID-MARK-DOC.\n",
        "top_module.py": "def top():\n    return 'TOP-LEVEL-MODULE'\n",
        "notes.bin": "not matched by the include patterns at all\n",
    }
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (root / "pkgb" / "blob.py").write_bytes(b"binary\0data" * 10)
    (root / "pkgb" / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 20)
    return root


def _settings(root, **kw) -> CorpusSettings:
    base = dict(roots=(str(root),), min_bytes=16, max_bytes=4096, valid_packages=("pkgv",))
    base.update(kw)
    return CorpusSettings(**base)


def _text(prefix) -> str:
    ds = IndexedDataset(str(prefix))
    return "".join(bytes(int(t) for t in ds[i] if t < 256).decode() for i in range(len(ds)))


def test_selection_dedup_and_skip_counts(tmp_path):
    root = _tree(tmp_path / "src")
    found = scan(_settings(root))
    paths = [r.path for r in found.rows]
    assert "pkga/copy.py" in paths and "pkgb/copy_again.py" not in paths  # first in walk order wins
    assert "pkga/__pycache__/cached.py" not in paths and "notes.bin" not in paths
    assert {"pkga/spaced.py", "pkgb/spaced_too.py"} <= set(paths)  # exact dedup keeps both
    s = found.skipped
    assert (s["duplicate"], s["too_large"], s["too_small"], s["binary"], s["not_utf8"], s["excluded"]) == (1, 1, 1, 1, 1, 1)
    assert {r.package for r in found.rows} == {"pkga", "pkgb", "pkgv", "top_module"}
    ws = scan(_settings(root, dedup="whitespace"))
    assert "pkgb/spaced_too.py" not in [r.path for r in ws.rows] and ws.skipped["duplicate"] == 2


def test_held_out_packages_never_reach_train(tmp_path):
    root = _tree(tmp_path / "src")
    m = build_corpus(_settings(root), tmp_path / "c", BYTE)
    assert m["valid_packages"] == ["pkgv"]
    rows = read_table(tmp_path / "c")
    assert {r.package for r in rows if r.split == "valid"} == {"pkgv"}
    assert "pkgv" not in {r.package for r in rows if r.split == "train"}
    train, valid = _text(tmp_path / "c" / "train"), _text(tmp_path / "c" / "valid")
    assert "VALID-MARK" not in train and "VALID-MARK-XYZ" in valid and "VALID-MARK-DOC" in valid
    assert "ALPHA-MARK" in train and "TOP-LEVEL-MODULE" in train and "ALPHA-MARK" not in valid
    assert train.count("SHARED-CONTENT") == 1
    # tokens per split: every kept file is one document of its bytes plus eod
    for split in ("train", "valid"):
        size = sum(r.size + 1 for r in rows if r.split == split)
        assert m["splits"][split]["tokens"] == size == sum(r.tokens for r in rows if r.split == split)
        assert json.loads((tmp_path / "c" / f"{split}.json").read_text())["tokenizer_type"] == "byte"


def test_valid_fraction_holds_out_whole_packages_within_the_byte_budget(tmp_path):
    root = _tree(tmp_path / "src")
    for i in range(20):
        (root / f"extra{i:02d}").mkdir()
        (root / f"extra{i:02d}" / "m.py").write_text(f"value_{i} = {i}  # padding to be a real file\n" * (i + 1))
    settings = _settings(root, valid_packages=(), valid_fraction=0.2)
    m = build_corpus(settings, tmp_path / "c", BYTE)
    rows = read_table(tmp_path / "c")
    total = sum(r.size for r in rows)
    held = sum(r.size for r in rows if r.split == "valid")
    assert m["valid_packages"] and 0 < held <= 0.2 * total
    assert m["valid_packages"] == build_corpus(settings, tmp_path / "c2", BYTE)["valid_packages"]


def test_manifest_hash_is_stable_across_runs_and_worker_counts(tmp_path):
    root = _tree(tmp_path / "src")
    a = build_corpus(_settings(root), tmp_path / "a", BYTE, workers=1)
    b = build_corpus(_settings(root), tmp_path / "b", BYTE, workers=2)
    assert a["content_sha256"] == b["content_sha256"]
    assert a["outputs_sha256"] == b["outputs_sha256"]
    assert (tmp_path / "a" / "files.tsv").read_text() == (tmp_path / "b" / "files.tsv").read_text()
    c = build_corpus(_settings(root, dedup="whitespace"), tmp_path / "c", BYTE, workers=2)
    assert c["content_sha256"] != a["content_sha256"]


def test_check_passes_then_names_a_changed_file(tmp_path, capsys):
    root = _tree(tmp_path / "src")
    build_corpus(_settings(root), tmp_path / "c", BYTE)
    assert check_corpus(tmp_path / "c")["ok"]
    assert prepare_corpus.main(["--check", str(tmp_path / "c")]) == 0
    (root / "pkga" / "__init__.py").write_text("def alpha():\n    return 'EDITED'\n")
    capsys.readouterr()
    assert prepare_corpus.main(["--check", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "changed (pkga/__init__.py)" in err[0]


def test_check_detects_a_changed_output(tmp_path):
    root = _tree(tmp_path / "src")
    build_corpus(_settings(root), tmp_path / "c", BYTE)
    with open(tmp_path / "c" / "train.bin", "r+b") as f:
        f.write(b"Z")
    with pytest.raises(Exception, match="train.bin"):
        check_corpus(tmp_path / "c")


@pytest.mark.parametrize("case", ["missing_root", "no_match", "unknown_package", "exists", "both_splits_by_name"])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, capsys, case):
    root = _tree(tmp_path / "src")
    out = tmp_path / "c"
    args = ["--root", str(root), "--output", str(out), "--tokenizer", "byte", "--workers", "1",
            "--valid-packages", "pkgv"]
    if case == "missing_root":
        args[1] = str(tmp_path / "nope")
    elif case == "no_match":
        args += ["--include", "*.nothing"]
    elif case == "unknown_package":
        args[-1] = "pkg_missing"
    elif case == "exists":
        out.mkdir()
    else:
        args += ["--valid-fraction", "0.5"]
    assert prepare_corpus.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert not (out / "manifest.json").exists()
    with pytest.raises(CorpusError):
        _settings(tmp_path / "nope").validate()


@pytest.mark.parametrize("case", ["not_a_corpus", "a_file", "holds_the_root"])
def test_force_replaces_only_a_corpus_folder_and_never_its_sources(tmp_path, capsys, case):
    root = _tree(tmp_path / "src")
    out = {"not_a_corpus": tmp_path / "notes", "a_file": tmp_path / "notes.txt", "holds_the_root": tmp_path}[case]
    if case == "not_a_corpus":
        out.mkdir()
        (out / "NOTES.txt").write_text("keep me\n")
    elif case == "a_file":
        out.write_text("keep me\n")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    args = ["--root", str(root), "--output", str(out), "--tokenizer", "byte", "--valid-packages", "pkgv", "--force"]
    assert prepare_corpus.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing removed, nothing written


def test_force_rebuilds_a_corpus_folder(tmp_path):
    root = _tree(tmp_path / "src")
    first = build_corpus(_settings(root), tmp_path / "c", BYTE)
    again = build_corpus(_settings(root), tmp_path / "c", BYTE, force=True)
    assert again["content_sha256"] == first["content_sha256"]
