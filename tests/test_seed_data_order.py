"""The run's ``seed`` shuffles the training data (a different seed, a different order; the same seed, the same
order), and ``data.valid_seed`` makes every seed evaluate on the same validation samples."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

from nano_hybrid.config import compose  # noqa: E402
from nano_hybrid.data import ByteTokenizer, DataConfigError, DataSpec, build_datasets  # noqa: E402
from nano_hybrid.data.corpus import CorpusSettings, build_corpus  # noqa: E402
from nano_hybrid.data.tokenizer import TokenizerSpec  # noqa: E402

SEQ = 16


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    for p in range(6):
        for i in range(10):
            f = root / f"pkg{p}" / f"m{i}.py"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(f"# package {p} module {i}\n" + f"value_{p}_{i} = {p * 100 + i}\n" * (3 + i))
    out = tmp_path_factory.mktemp("corpus") / "c"
    build_corpus(CorpusSettings(roots=(str(root),), min_bytes=8, valid_packages=("pkg5",)), out, TokenizerSpec("byte"))
    return out


def _spec(corpus_dir, tmp_path, valid_seed=None) -> DataSpec:
    return DataSpec.from_cfg(OmegaConf.create({
        "kind": "indexed", "paths": [str(corpus_dir / "train")], "valid_paths": [str(corpus_dir / "valid")],
        "weights": None, "split": "100,0,0", "cache_dir": str(tmp_path / "cache"), "num_workers": 0,
        "valid_seed": valid_seed}))


def _samples(ds, n=12):
    return [tuple(int(t) for t in ds[i]["tokens"]) for i in range(n)]


def test_seed_changes_training_order_and_same_seed_repeats(corpus_dir, tmp_path):
    spec = _spec(corpus_dir, tmp_path)
    a = _samples(build_datasets(spec, ByteTokenizer(), SEQ, 40, seed=1)[0])
    a_again = _samples(build_datasets(spec, ByteTokenizer(), SEQ, 40, seed=1)[0])
    b = _samples(build_datasets(spec, ByteTokenizer(), SEQ, 40, seed=2)[0])
    assert a == a_again
    assert a != b


def test_valid_seed_fixes_the_validation_samples_across_seeds(corpus_dir, tmp_path):
    free = _spec(corpus_dir, tmp_path)
    fixed = _spec(corpus_dir, tmp_path, valid_seed=5)
    v1 = _samples(build_datasets(fixed, ByteTokenizer(), SEQ, 40, seed=1, valid_samples=12)[1])
    v2 = _samples(build_datasets(fixed, ByteTokenizer(), SEQ, 40, seed=2, valid_samples=12)[1])
    assert v1 == v2
    f1 = _samples(build_datasets(free, ByteTokenizer(), SEQ, 40, seed=1, valid_samples=12)[1])
    f2 = _samples(build_datasets(free, ByteTokenizer(), SEQ, 40, seed=2, valid_samples=12)[1])
    assert f1 != f2
    # the training order still follows the run's seed when valid_seed is set
    t1 = _samples(build_datasets(fixed, ByteTokenizer(), SEQ, 40, seed=1, valid_samples=12)[0])
    assert t1 == _samples(build_datasets(free, ByteTokenizer(), SEQ, 40, seed=1)[0])
    with pytest.raises(DataConfigError, match="valid_seed"):
        _spec(corpus_dir, tmp_path, valid_seed=-1)


def test_trainer_passes_the_run_seed_to_the_data(corpus_dir, tmp_path):
    from nano_hybrid.trainer import build_dataset

    def first(seed):
        cfg = compose(["model=tiny", "data=corpus", f"data.corpus_dir={corpus_dir}", "data.tokenizer.type=byte",
                       "data.tokenizer.path=null", f"data.cache_dir={tmp_path / 'c'}", f"seed={seed}",
                       "train.global_batch_size=4", "train.micro_batch_size=4", "train.train_iters=5"])
        plan = SimpleNamespace(data=DataSpec.from_cfg(cfg.data), tokenizer=ByteTokenizer(), seq_length=SEQ,
                               eval_iters=2, rank=0)
        train, valid = build_dataset(plan, cfg)
        return _samples(train, 8), _samples(valid, 8)

    (t1, v1), (t2, v2) = first(11), first(12)
    assert t1 != t2 and v1 == v2  # data=corpus: valid_seed fixed, training order from seed
