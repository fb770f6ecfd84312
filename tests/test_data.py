"""Data: prepare_data round trip, megatron dataset sampling, DP sharding and the resume position."""

import json
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from nano_hybrid.data import (
    ByteTokenizer,
    DataConfigError,
    DataPreparationError,
    DataSpec,
    PretrainingSampler,
    build_data_iterator,
    build_train_dataset,
    ensure_corpus,
    stdlib_sources,
    write_indexed_dataset,
)

REPO = Path(__file__).resolve().parent.parent
TEXTS = ["def f(x):\n    return x + 1\n", "héllo wörld\n" * 40, "import os\nprint(os.sep)\n" * 25]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    files = []
    for i, t in enumerate(TEXTS):
        (d / f"doc{i}.txt").write_text(t, encoding="utf-8")
        files.append(d / f"doc{i}.txt")
    prefix = d / "out" / "small"
    summary = write_indexed_dataset(files, prefix)
    return prefix, summary


def indexed_spec(prefix, **kw):
    cfg = {"kind": "indexed", "paths": [str(prefix)], "weights": None, "split": "100,0,0", "cache_dir": None, "num_workers": 0}
    return DataSpec.from_cfg(OmegaConf.create({**cfg, **kw}))


def test_prepare_round_trip(corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix, summary = corpus
    tok = ByteTokenizer()
    ds = IndexedDataset(str(prefix))
    assert len(ds) == len(TEXTS) == summary["documents"]
    for i, text in enumerate(TEXTS):
        ids = ds[i]
        assert ids[-1] == tok.eod
        assert tok.detokenize(ids[:-1]) == text
    assert summary["tokens"] == sum(len(t.encode()) + 1 for t in TEXTS)
    assert json.loads(Path(f"{prefix}.json").read_text())["documents"] == len(TEXTS)
    assert not list(prefix.parent.glob(".*tmp*")), "temporary files must be renamed or removed"


def test_prepare_data_script(tmp_path):
    from nano_hybrid.tools import prepare_data as mod

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.md").write_text("# title\n")
    (tmp_path / "in" / "skip.bin").write_bytes(b"\0\1")
    assert mod.main(["--input", str(tmp_path / "in"), "--output", str(tmp_path / "o" / "x")]) == 0
    assert (tmp_path / "o" / "x.bin").stat().st_size == 2 * (len("# title\n") + 1)  # uint16 tokens
    assert mod.main(["--input", str(tmp_path / "nope"), "--output", str(tmp_path / "o" / "y")]) == 2
    # an existing dataset is replaced only with --force
    (tmp_path / "in" / "b.md").write_text("# more\n")
    before = (tmp_path / "o" / "x.bin").read_bytes()
    assert mod.main(["--input", str(tmp_path / "in"), "--output", str(tmp_path / "o" / "x")]) == 2
    assert (tmp_path / "o" / "x.bin").read_bytes() == before
    assert mod.main(["--input", str(tmp_path / "in"), "--output", str(tmp_path / "o" / "x"), "--force"]) == 0
    assert (tmp_path / "o" / "x.bin").stat().st_size == 2 * (len("# title\n") + 1 + len("# more\n") + 1)


def test_stdlib_sources_are_sorted_and_nonempty():
    files = stdlib_sources()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert stdlib_sources() == files


def test_missing_corpus_fails_loudly(tmp_path):
    with pytest.raises(DataPreparationError, match="not found"):
        ensure_corpus(tmp_path / "absent", None)
    with pytest.raises(DataPreparationError, match="unknown"):
        ensure_corpus(tmp_path / "absent", "wikipedia")
    with pytest.raises(DataConfigError, match="not found"):
        build_train_dataset(indexed_spec(tmp_path / "absent"), ByteTokenizer(), 16, 4, 0)


def test_gpt_dataset_samples(corpus):
    prefix, _ = corpus
    ds = build_train_dataset(indexed_spec(prefix), ByteTokenizer(), 32, 20, seed=7)
    assert len(ds) >= 20
    s = ds[3]
    assert s["tokens"].shape == s["labels"].shape == s["loss_mask"].shape == (32,)
    assert int(s["tokens"].max()) <= ByteTokenizer.eod
    # labels are the next tokens of the same stream
    assert (s["tokens"][1:] == s["labels"][:-1]).all()
    again = build_train_dataset(indexed_spec(prefix), ByteTokenizer(), 32, 20, seed=7)
    assert (again[3]["tokens"] == s["tokens"]).all()  # same seed, same order (cached index)


def test_mock_dataset():
    spec = DataSpec.from_cfg(OmegaConf.load(REPO / "configs" / "data" / "mock.yaml"))
    ds = build_train_dataset(spec, ByteTokenizer(), 64, 10, seed=0)
    assert ds[0]["tokens"].shape == (64,)


def test_sampler_shards_global_batches_over_dp():
    mbs, dp = 2, 3
    per_rank = [list(PretrainingSampler(24, 0, mbs, r, dp)) for r in range(dp)]
    assert all(len(b) == 4 for b in per_rank)
    for k in range(4):  # global micro-batch k = contiguous indices, rank r takes the r-th slice
        merged = sum((per_rank[r][k] for r in range(dp)), [])
        assert merged == list(range(k * mbs * dp, (k + 1) * mbs * dp))


def test_sampler_resumes_at_consumed_samples():
    full = list(PretrainingSampler(40, 0, 4, 1, 2))
    resumed = list(PretrainingSampler(40, 16, 4, 1, 2))
    assert resumed == full[2:]
    with pytest.raises(ValueError, match="multiple"):
        PretrainingSampler(40, 6, 4, 0, 2)


def test_data_iterator_resume_matches_uninterrupted(corpus):
    prefix, _ = corpus
    ds = build_train_dataset(indexed_spec(prefix), ByteTokenizer(), 16, 24, seed=1)
    it = build_data_iterator(ds, 0, 2, 0, 1)
    batches = [next(it)["tokens"] for _ in range(4)]
    it2 = build_data_iterator(ds, 4, 2, 0, 1)
    assert all((next(it2)["tokens"] == b).all() for b in batches[2:])


def test_bad_data_spec():
    with pytest.raises(DataConfigError, match="data.kind"):
        DataSpec.from_cfg(OmegaConf.create({"kind": "parquet"}))
    with pytest.raises(DataConfigError, match="empty"):
        DataSpec.from_cfg(OmegaConf.create({"kind": "indexed", "paths": []}))
    with pytest.raises(DataConfigError, match="weights"):
        DataSpec.from_cfg(OmegaConf.create({"kind": "indexed", "paths": ["a", "b"], "weights": [1.0]}))


def test_tokenizer_vocab_padding():
    tok = ByteTokenizer()
    assert tok.vocab_size == 258 and tok.padded_vocab_size(128) == 384
    assert np.array_equal(tok.tokenize("é"), [0xC3, 0xA9])


def test_a_corpus_written_again_at_its_prefix_gets_new_sample_indices(tmp_path):
    # megatron names its index cache after the dataset settings only; the cache folder is keyed by the files
    files = []
    for i in range(40):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"document {i} " * (5 + i % 7), encoding="utf-8")
        files.append(tmp_path / f"doc{i:02d}.txt")
    prefix = tmp_path / "out" / "c"
    write_indexed_dataset(files, prefix)
    big = build_train_dataset(indexed_spec(prefix), ByteTokenizer(), 32, 20, seed=7)
    write_indexed_dataset(files[:3], prefix)  # the same prefix, far fewer documents
    small = build_train_dataset(indexed_spec(prefix), ByteTokenizer(), 32, 20, seed=7)
    fresh = build_train_dataset(indexed_spec(prefix, cache_dir=str(tmp_path / "fresh_cache")), ByteTokenizer(), 32, 20,
                                seed=7)
    assert len(small) == len(fresh) < len(big)
    for i in range(len(small)):  # the same samples as a build that never saw the first corpus
        assert np.array_equal(small[i]["tokens"].numpy(), fresh[i]["tokens"].numpy())
    caches = sorted(p.name for p in (prefix.parent / "cache").iterdir())
    assert len(caches) == 2 and all(c.startswith("data-") for c in caches)


def test_a_validation_longer_than_its_split_is_said(tmp_path):
    from nano_hybrid.data import build_valid_dataset, train_split_tokens
    from nano_hybrid.trainer import report_validation_size

    files = []
    for i in range(20):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"document {i} " * 8, encoding="utf-8")
        files.append(tmp_path / f"doc{i:02d}.txt")
    prefix = tmp_path / "out" / "v"
    write_indexed_dataset(files, prefix)
    valid = build_valid_dataset(indexed_spec(prefix, split="50,50,0"), ByteTokenizer(), 32, 4, seed=1)
    tokens = train_split_tokens(valid)
    fits = tokens // (4 * 32)
    assert fits >= 1
    said = []
    assert not report_validation_size(valid, fits, 4, 32, said.append) and said == []
    assert report_validation_size(valid, fits + 1, 4, 32, said.append)
    assert len(said) == 1 and said[0].startswith("warning:") and f"set train.eval_iters <= {fits}" in said[0], said
