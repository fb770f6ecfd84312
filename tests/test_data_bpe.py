"""The 131k BPE path on CPU: the Tekken file, Megatron-LM-identical preprocessing (JSONL -> .bin/.idx), the
input errors, the vocab-size check, the validation split, and a few training steps of a tiny model with
evaluation (val_loss / val_ppl) that leaves training unchanged."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nano_hybrid.data import DataPreparationError, DataSpec, TokenizerSpec, build_datasets, build_tokenizer
from nano_hybrid.data.prepare import write_indexed_dataset
from nano_hybrid.data.tokenizer import TokenizerError, extract_tekken

REPO = Path(__file__).resolve().parent.parent
DOCS = ["Hello world, this is a test.", "", "def f(x):\n    return x ** 2  # </s> stays a special token\n",
        "héllo wörld — ünïcode ✓ 数字 123456"] * 6


@pytest.fixture(scope="module")
def tekken(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tekken_131k.json"
    summary = extract_tekken(path)
    assert summary["bpe_ranks"] == 130072 and path.stat().st_size == summary["bytes"]
    spec = TokenizerSpec.from_cfg({"type": "tiktoken", "path": str(path), "vocab_size": 131072,
                                   "num_special_tokens": 1000, "pattern": "v2"})
    return spec, build_tokenizer(spec)


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    d = tmp_path_factory.mktemp("jsonl")
    f = d / "docs.jsonl"
    f.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS)), encoding="utf-8")
    return f


def test_tekken_tokenizer(tekken):
    _, tok = tekken
    assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (131072, 2, 1, 4)
    ids = tok.tokenize("Hello world")
    assert ids == [22177, 4304] and all(1000 <= i < 131072 for i in ids)
    text = "def f(x):\n    return 'héllo ✓'\n"
    assert tok.detokenize(tok.tokenize(text)) == text
    src = (REPO / "nano_hybrid" / "train.py").read_text()
    assert 3.0 < len(src.encode()) / len(tok.tokenize(src)) < 6.0  # a real BPE: several bytes per token


def megatron_lm_preprocess(jsonl_path, prefix, tokenizer_path):
    """What Megatron-LM's tools/preprocess_data.py does for --tokenizer-type TikTokenizer --tiktoken-pattern v2
    --vocab-size 131072 --tiktoken-num-special-tokens 1000 --json-keys text --append-eod: megatron-core's
    tokenizer, Encoder.encode per line, IndexedDatasetBuilder(optimal_dtype(vocab_size)), add_document, finalize."""
    from megatron.core.datasets import indexed_dataset
    from megatron.core.tokenizers import MegatronTokenizer

    tok = MegatronTokenizer.from_pretrained(tokenizer_path=tokenizer_path, metadata_path={"library": "tiktoken"},
                                            pattern="v2", vocab_size=131072, num_special_tokens=1000)
    builder = indexed_dataset.IndexedDatasetBuilder(f"{prefix}.bin", dtype=indexed_dataset.DType.optimal_dtype(tok.vocab_size))
    for line in open(jsonl_path, encoding="utf-8"):
        text = json.loads(line)["text"]
        doc_ids, sentence_lens = [], []
        for sentence in [text]:
            sentence_ids = tok.tokenize(sentence)
            if len(sentence_ids) > 0:
                doc_ids.extend(sentence_ids)
                sentence_lens.append(len(sentence_ids))
        if len(doc_ids) > 0:
            doc_ids.append(tok.eod)
            sentence_lens[-1] += 1
        builder.add_document(doc_ids, sentence_lens)
    builder.finalize(f"{prefix}.idx")


def read_idx(path):
    """The documented MMIDIDX layout: magic, version, dtype code, #sequences, #documents, lengths, pointers, doc index."""
    raw = Path(path).read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, = struct.unpack("<Q", raw[9:17])
    code, = struct.unpack("<B", raw[17:18])
    n_seq, n_doc = struct.unpack("<QQ", raw[18:34])
    off = 34
    lengths = np.frombuffer(raw, np.int32, n_seq, off); off += 4 * n_seq
    pointers = np.frombuffer(raw, np.int64, n_seq, off); off += 8 * n_seq
    doc_idx = np.frombuffer(raw, np.int64, n_doc, off); off += 8 * n_doc
    assert off == len(raw)
    return version, code, lengths, pointers, doc_idx


def test_jsonl_output_is_megatron_lm_bytes(tekken, jsonl, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    spec, tok = tekken
    ours = tmp_path / "ours"
    summary = write_indexed_dataset([jsonl], ours, spec, json_key="text", append_eod=True, workers=2)
    ref = tmp_path / "ref"
    megatron_lm_preprocess(jsonl, ref, spec.path)
    assert Path(f"{ours}.bin").read_bytes() == Path(f"{ref}.bin").read_bytes()
    assert Path(f"{ours}.idx").read_bytes() == Path(f"{ref}.idx").read_bytes()
    version, code, lengths, pointers, doc_idx = read_idx(f"{ours}.idx")
    expect = [tok.tokenize(t) + [tok.eod] if t else [] for t in DOCS]
    assert version == 1 and code == 4  # int32 tokens for a 131,072-id vocabulary
    assert lengths.tolist() == [len(e) for e in expect if e]
    assert pointers.tolist() == (np.cumsum([0] + lengths.tolist()[:-1]) * 4).tolist()
    assert doc_idx.tolist() == [0] + np.cumsum([1 if e else 0 for e in expect]).tolist()
    ds = IndexedDataset(str(ours))
    assert [ds[i].tolist() for i in range(len(ds))] == [e for e in expect if e]
    assert summary["documents"] == len(DOCS) and summary["tokens"] == sum(map(len, expect))
    assert tok.detokenize(ds[1][:-1]) == DOCS[2]  # sequence 1: the empty document has none


def test_prepare_errors(tekken, tmp_path):
    spec, _ = tekken
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": "b"}\n{"body": "c"}\n', encoding="utf-8")
    with pytest.raises(DataPreparationError, match=r"bad.jsonl:3: no 'text' key"):
        write_indexed_dataset([bad], tmp_path / "o1", spec, workers=2)
    assert not list(tmp_path.glob(".o1*")) and not (tmp_path / "o1.bin").exists()
    first = tmp_path / "first.jsonl"
    first.write_text('{"body": "c"}\n', encoding="utf-8")
    with pytest.raises(DataPreparationError, match=r"first.jsonl:1: no 'text' key"):
        write_indexed_dataset([first], tmp_path / "o2", spec)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataPreparationError, match="empty"):
        write_indexed_dataset([empty], tmp_path / "o3", spec)
    missing = TokenizerSpec.from_cfg({"type": "tiktoken", "path": str(tmp_path / "nope.json"), "vocab_size": 131072})
    with pytest.raises(DataPreparationError, match="tokenizer file not found"):
        write_indexed_dataset([bad], tmp_path / "o4", missing)
    with pytest.raises(TokenizerError, match="data.tokenizer.type"):
        TokenizerSpec.from_cfg({"type": "gpt2"})


def test_prepare_data_script_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n' * 5 + '{"txt": "b"}\n', encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_data.py"), "--input", str(bad), "--output",
                        str(tmp_path / "o"), "--tokenizer", "byte"], capture_output=True, text=True, env=env, cwd=REPO)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [f"error: {bad}:6: no 'text' key in this JSON line (--json-key names it)"]


def test_vocab_check_and_split(tekken, jsonl, tmp_path):
    from omegaconf import OmegaConf

    from nano_hybrid.config import ConfigError, compose
    from nano_hybrid.runconfig import validate

    spec, tok = tekken
    tok_over = [f"data.tokenizer.path={spec.path}", "data.paths=[/nonexistent/x]", "data.prepare_if_missing=null"]
    with pytest.raises(ConfigError, match=r"131,072 ids but the model's embedding has 512"):
        validate(compose(["model=tiny", "data=stdlib_bpe131k", *tok_over]))
    with pytest.raises(ConfigError, match="tokenizer file not found"):
        validate(compose(["model=tiny", "data=stdlib_bpe131k", "data.tokenizer.path=/nonexistent/t.json"]))
    # train/valid split of the same prefix: both non-empty, the same samples on every build (resume-safe)
    prefix = tmp_path / "c"
    write_indexed_dataset([jsonl], prefix, spec)
    dspec = DataSpec.from_cfg(OmegaConf.create({"kind": "indexed", "paths": [str(prefix)], "split": "50,50,0"}))
    train, valid = build_datasets(dspec, tok, 16, 8, seed=3, valid_samples=4)
    _, again = build_datasets(dspec, tok, 16, 8, seed=3, valid_samples=4)
    assert len(valid) >= 4 and all((valid[i]["tokens"] == again[i]["tokens"]).all() for i in range(4))
    no_valid = DataSpec.from_cfg(OmegaConf.create({"kind": "indexed", "paths": [str(prefix)], "split": "100,0,0"}))
    with pytest.raises(Exception, match="validation"):
        build_datasets(no_valid, tok, 16, 8, seed=3, valid_samples=4)


def run_train(args):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "nano_hybrid.train", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_tiny_trains_and_evaluates_on_bpe(tekken, tmp_path):
    """Tokenize, write, read back, train 4 steps of model=tiny with the 131k BPE, evaluate every 2 steps;
    the same run without evaluation has the same training losses (evaluation consumes no RNG, no data)."""
    from nano_hybrid.data import stdlib_sources

    spec, _ = tekken
    prefix = tmp_path / "stdlib_bpe" / "stdlib"
    write_indexed_dataset(stdlib_sources()[:60], prefix, spec, workers=2)
    common = ["model=tiny", "kernels=torch", "train.device=cpu", "data=stdlib_bpe131k", f"data.tokenizer.path={spec.path}",
              f"data.paths=[{prefix}]", "data.prepare_if_missing=null", "model.vocab_size=131072", "model.hidden_size=64", "train.seq_length=64",
              "train.micro_batch_size=2", "train.global_batch_size=2", "train.train_iters=4", "optim.warmup_iters=1",
              "checkpoint.load=none", "checkpoint.interval=0", "checkpoint.save_on_exit=false", "train.log_interval=1"]
    runs = {}
    for name, extra in (("eval", ["train.eval_interval=2", "train.eval_iters=2"]), ("plain", ["train.eval_interval=0"])):
        p = run_train([*common, *extra, f"run_dir={tmp_path / name}"])
        assert p.returncode == 0, p.stderr[-3000:]
        runs[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        if name == "eval":
            assert "val_loss" in p.stdout and "val_ppl" in p.stdout
    ev = runs["eval"]
    assert [r["step"] for r in ev] == [1, 2, 3, 4]
    assert [("val_loss" in r) for r in ev] == [False, True, False, True]
    for r in (ev[1], ev[3]):
        assert 0 < r["val_loss"] < 13 and abs(r["val_ppl"] - np.exp(r["val_loss"])) < 1e-6 * r["val_ppl"]
        assert r["val_tokens"] == 2 * 2 * 64
    assert 11.0 < ev[0]["loss"] < 12.5  # ~ln(131072) = 11.8 at init
    assert ev[3]["val_loss"] < ev[1]["val_loss"]
    assert [r["loss"] for r in ev] == [r["loss"] for r in runs["plain"]]


def test_hf_tokenizer_folder(tmp_path):
    """data.tokenizer.type=hf: a local tokenizer.json (+ tokenizer_config.json) through transformers' AutoTokenizer;
    eod is its EOS token; a tokenizer without one is refused."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, def f(x): return x"] * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "pad_token": "<pad>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    hf = build_tokenizer({"type": "hf", "path": str(tmp_path / "tokenizer.json")})
    assert (hf.eod, hf.pad) == (0, 1) and hf.vocab_size == tok.get_vocab_size()
    ids = hf.tokenize("hello world")
    assert ids == tok.encode("hello world").ids and hf.detokenize(ids) == "hello world"
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerError, match="no EOS token"):
        build_tokenizer({"type": "hf", "path": str(tmp_path)})


def test_validation_loss_same_under_dp2(tmp_path):
    """Validation through megatron's forward-only schedule gives the same val_loss with one process and with
    two data-parallel gloo ranks (each evaluates its slice of the same global batches)."""
    common = ["model=tiny", "train.device=cpu", "train.seq_length=64", "train.micro_batch_size=2",
              "train.global_batch_size=4", "train.train_iters=2", "optim.warmup_iters=1", "train.eval_interval=2",
              "train.eval_iters=2", "checkpoint.load=none", "checkpoint.interval=0", "checkpoint.save_on_exit=false"]
    single = run_train([*common, f"run_dir={tmp_path / 'single'}"])
    assert single.returncode == 0, single.stderr[-3000:]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    dp2 = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "nano_hybrid.train", "parallel=dp2", *common, f"run_dir={tmp_path / 'dp2'}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert dp2.returncode == 0, dp2.stderr[-3000:]
    a, b = ([json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in ("single", "dp2"))
    assert "val_loss" in a[-1] and abs(a[-1]["val_loss"] - b[-1]["val_loss"]) < 1e-4 * a[-1]["val_loss"]
