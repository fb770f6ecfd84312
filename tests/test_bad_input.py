"""The usual mistakes of a new user: each is one ``error:`` line with exit code 2 naming the key or file, before any
work, and a refused start leaves the run directory exactly as it was."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from nano_hybrid.data.check import CorpusCheckError, check_corpus
from nano_hybrid.data.prepare import DataPreparationError, text_sources, write_indexed_dataset
from nano_hybrid.errors import EXIT_BAD_INPUT
from nano_hybrid.train import main

REPO = Path(__file__).resolve().parent.parent
TINY = ["model=tiny", "kernels.backend=torch", "train.seq_length=64", "train.micro_batch_size=2",
        "train.global_batch_size=2", "optim.warmup_iters=1", "train.torch_threads=1", "logger.wandb.mode=disabled"]


def _tree(d: Path) -> dict[str, bytes | None]:
    """Every path under ``d`` with the bytes of each file (None for a directory)."""
    if not d.exists():
        return {}
    return {p.relative_to(d).as_posix(): (p.read_bytes() if p.is_file() else None) for p in sorted(d.rglob("*"))}


def _one_error(capsys, rc: int, *needles: str) -> str:
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == EXIT_BAD_INPUT and len(err) == 1 and err[0].startswith("error: "), (rc, err)
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small byte-token corpus of 40 documents written by the preparation step."""
    d = tmp_path_factory.mktemp("corpus")
    docs = d / "docs"
    docs.mkdir()
    for i in range(40):
        (docs / f"doc{i:02d}.txt").write_text(f"document {i}: " + "some words of text to train on. " * (20 + i))
    write_indexed_dataset(text_sources([docs]), d / "c", "byte")
    return d / "c"


def _copy_corpus(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    for ext in (".bin", ".idx", ".json"):
        Path(f"{dst}{ext}").write_bytes(Path(f"{src}{ext}").read_bytes())
    return dst


def _data(prefix: Path) -> list[str]:
    return [f"data.paths=[{prefix}]", "data.prepare_if_missing=null", f"data.cache_dir={prefix.parent / 'cache'}"]


def test_truncated_bin_is_one_line_naming_the_file(corpus, tmp_path, capsys):
    c = _copy_corpus(corpus, tmp_path / "t" / "c")
    check_corpus(c)  # intact
    data = Path(f"{c}.bin").read_bytes()
    Path(f"{c}.bin").write_bytes(data[: len(data) // 2])
    run = tmp_path / "run"
    rc = main([*TINY, *_data(c), f"run_dir={run}"])
    _one_error(capsys, rc, f"{c}.bin", "truncated")
    assert not run.exists()


def test_bin_rewritten_in_place_fails_its_recorded_fingerprint(corpus, tmp_path, capsys):
    c = _copy_corpus(corpus, tmp_path / "t" / "c")
    data = bytearray(Path(f"{c}.bin").read_bytes())
    data[0] ^= 0xFF  # same size, other tokens: the .idx agrees, the fingerprint does not
    Path(f"{c}.bin").write_bytes(bytes(data))
    with pytest.raises(CorpusCheckError, match="bin sample crc32"):
        check_corpus(c)
    rc = main([*TINY, *_data(c), f"run_dir={tmp_path / 'run'}"])
    _one_error(capsys, rc, f"{c}.bin", "changed since")


def test_truncated_idx_is_one_line(corpus, tmp_path):
    c = _copy_corpus(corpus, tmp_path / "t" / "c")
    data = Path(f"{c}.idx").read_bytes()
    Path(f"{c}.idx").write_bytes(data[:-8])
    with pytest.raises(CorpusCheckError, match=r"c\.idx: 834 bytes, .* needs 842 \(truncated"):
        check_corpus(c)


@pytest.mark.parametrize("override,needle", [
    ("optim.lr=abc", "optim.lr='abc' must be a number"),
    ("optim.warmup_iters=2.5", "optim.warmup_iters=2.5 must be a whole number"),
    ("checkpoint.interval=often", "checkpoint.interval='often' must be a whole number or null"),
    ("seed=x", "seed='x' must be a whole number"),
])
def test_value_that_is_not_a_number_names_the_key(override, needle, tmp_path, capsys):
    rc = main(["data=mock", *TINY, override, f"run_dir={tmp_path / 'run'}"])
    _one_error(capsys, rc, needle)
    assert not (tmp_path / "run").exists()


def test_corrupt_helion_config_file_is_one_line_before_work(tmp_path, capsys):
    """A config file in the helion backend's user cache that is not JSON (a disk full at a hand copy, say) stops the
    run before any work with one line naming the file and saying to delete it; the file is left as it was."""
    bad = tmp_path / "cache" / "sm90" / "conv1d_fwd.json"
    bad.parent.mkdir(parents=True)
    bad.write_text('{"kernel": "conv1d_fwd", "entries": {"b1_l')
    overrides = [o for o in TINY if not o.startswith("kernels.backend=")]
    rc = main(["data=mock", *overrides, "kernels.backend=helion", f"kernels.helion.cache_dir={tmp_path / 'cache'}",
               f"run_dir={tmp_path / 'run'}"])
    _one_error(capsys, rc, str(bad), "JSONDecodeError", "delete it")
    assert not (tmp_path / "run").exists() and bad.read_text().endswith('"b1_l')


def test_autotune_with_a_cache_dir_that_cannot_be_written_is_one_line_before_work(tmp_path, capsys):
    """``kernels.helion.autotune=true`` stores what it tunes in the cache folder: a path that cannot be a writable
    folder (here under a regular file) stops the run before any work with one line naming the key and the path; with
    autotune off the cache is only read and the same path is no error."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    overrides = [o for o in TINY if not o.startswith("kernels.backend=")]
    rc = main(["data=mock", *overrides, "kernels.backend=helion", "kernels.helion.autotune=true",
               f"kernels.helion.cache_dir={blocker / 'cache'}", f"run_dir={tmp_path / 'run'}"])
    _one_error(capsys, rc, "kernels.helion.cache_dir", str(blocker / "cache"), "not a writable folder")
    assert not (tmp_path / "run").exists() and blocker.read_text() == "x"
    from nano_hybrid.config import compose
    from nano_hybrid.runconfig import validate

    validate(compose(["data=mock", *overrides, "kernels.backend=helion", f"kernels.helion.cache_dir={blocker / 'c'}",
                      f"run_dir={tmp_path / 'run2'}"]))


def test_too_few_documents_for_the_validation_split(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"d{i}.txt").write_text(f"document number {i} " * 40)
    c = tmp_path / "small" / "c"
    write_indexed_dataset(text_sources([docs]), c, "byte")
    run = tmp_path / "runs" / "r"
    rc = main([*TINY, *_data(c), "train.eval_interval=2", "train.train_iters=4", f"run_dir={run}"])
    _one_error(capsys, rc, "validation split", str(c))
    assert not (tmp_path / "runs").exists()  # the claim's run_dir and checkpoints/ are gone again


def test_non_utf8_jsonl_line_names_file_and_line(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataPreparationError, match=r"in\.jsonl:2: not UTF-8 text \(byte 0xe9 at column 14\)"):
        write_indexed_dataset([f], tmp_path / "out", "byte")
    p = subprocess.run([sys.executable, "scripts/prepare_data.py", "--input", str(f), "--output", str(tmp_path / "o"),
                        "--no-progress"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"error: {f}:2: not UTF-8 text (byte 0xe9 at column 14); JSONL input must be UTF-8"], p.stderr


def test_invalid_json_message_is_whole(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text('{"text": "ok"}\n{"text": "a\x01b"}\n')
    with pytest.raises(DataPreparationError) as e:
        write_indexed_dataset([f], tmp_path / "out", "byte")
    assert str(e.value) == f"{f}:2: not valid JSON: Invalid control character at column 12"


def test_refused_resume_leaves_the_run_directory_unchanged(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["data=mock", *TINY, "train.train_iters=2", f"run_dir={run}"]) == 0
    before = _tree(run)
    assert "config.yaml" in before and any(k.startswith("checkpoints/iter_") for k in before)
    capsys.readouterr()
    rc = main(["data=mock", *TINY, "train.train_iters=4", "optim.lr_decay_iters=2", "model.vocab_size=640",
               f"run_dir={run}"])
    _one_error(capsys, rc, "vocab size differs")
    assert _tree(run) == before  # config.yaml, metrics.jsonl and the checkpoints as they were


def test_epochs_are_said_before_the_start_and_repeats_warned(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"d{i}.txt").write_text(f"short document {i}. " * 25)
    c = tmp_path / "small" / "c"
    tokens = write_indexed_dataset(text_sources([docs]), c, "byte")["tokens"]
    rc = main([*TINY, *_data(c), 'data.split="100,0,0"', "train.train_iters=20", "checkpoint.interval=0",
               "checkpoint.save_on_exit=false", f"run_dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    assert rc == 0
    line = next(x for x in out.splitlines() if x.startswith("data: "))
    epochs = 20 * 2 * 64 / tokens
    assert f"holds {tokens:,} tokens" in line and f"= {epochs:.3g} epochs" in line, line
    assert epochs > 1 and f"warning: the run repeats its training data ({epochs:.1f} epochs)" in out
    assert out.index("data: ") < out.index("nano-hybrid: model=") < out.index("| loss ")


def test_export_of_a_missing_checkpoint_speaks_of_export(tmp_path, capsys):
    from nano_hybrid.export_hf import main as export_main

    rc = export_main([str(tmp_path / "nope"), str(tmp_path / "out")])
    err = _one_error(capsys, rc, "no such checkpoint, checkpoints folder or run folder")
    assert "scratch" not in err and not (tmp_path / "out").exists()


def test_inspect_prints_no_megatron_spec_log_lines():
    p = subprocess.run([sys.executable, "-m", "nano_hybrid.inspect", "model=nano30b"], cwd=REPO, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0 and "Unknown MLP type" not in p.stdout + p.stderr, p.stderr[-2000:]
    assert json.loads(p.stdout)["model"] == "nano30b"


def test_exported_config_loads_its_tokenizer_without_the_mistral_regex_warning(tmp_path, caplog):
    """transformers >= 5 skips its Mistral split-regex rewrite (and the warning that one is needed) for a folder
    whose config.json names a transformers 5 release; the tokenizer then encodes as written."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from nano_hybrid.data.tokenizer import TokenizerSpec, build_tokenizer, extract_tekken
    from nano_hybrid.hf.config import TRANSFORMERS_VERSION
    from nano_hybrid.hf.tokenizer import write_tokenizer_files

    path = tmp_path / "tekken_131k.json"
    extract_tekken(path)
    spec = TokenizerSpec.from_cfg({"type": "tiktoken", "path": str(path), "vocab_size": 131072,
                                   "num_special_tokens": 1000, "pattern": "v2"})
    text = "def f(x):\n    return x  # 3 numbers: 1234567\n"
    want = build_tokenizer(spec).tokenize(text)
    for version, warned in ((None, True), (TRANSFORMERS_VERSION, False)):
        folder = tmp_path / f"hf_{version}"
        folder.mkdir()
        write_tokenizer_files(spec, build_tokenizer(spec), folder)
        config = {"model_type": "nemotron_h", **({"transformers_version": version} if version else {})}
        (folder / "config.json").write_text(json.dumps(config))
        caplog.clear()
        hf_logging.enable_propagation()  # transformers' loggers do not propagate to the root logger by default
        try:
            with caplog.at_level(logging.WARNING):
                tok = AutoTokenizer.from_pretrained(str(folder))
        finally:
            hf_logging.disable_propagation()
        assert any("fix_mistral_regex" in r.getMessage() for r in caplog.records) == warned, version
        assert tok(text, add_special_tokens=False).input_ids == list(want)  # the ids the run trained on


@pytest.mark.parametrize("extra,needle", [
    (["model.mamba_head_dim=12", "model.mamba_num_heads=8"], "headdim=12"),
    (["model.mamba_chunk_size=512"], "chunk_size=512"),
    # fp32 (CPU training): a 256 x 256 state is a 256 KiB tile, past the kernels' 128 KiB
    (["model.mamba_head_dim=256", "model.mamba_state_dim=256", "model.mamba_num_heads=2", "model.mamba_num_groups=1"],
     "headdim x dstate = 256 x 256 in float32"),
])
def test_helion_mixer_shape_outside_the_shape_space_is_one_line_before_work(extra, needle, tmp_path, capsys):
    """With kernels.backend=helion, Mamba dims the kernels do not support stop the run at validation with one line
    naming the dim and the model keys, before any model is built; the torch backend takes the same dims."""
    overrides = [o for o in TINY if not o.startswith("kernels.backend=")]
    rc = main(["data=mock", *overrides, *extra, "kernels.backend=helion", f"run_dir={tmp_path / 'run'}"])
    _one_error(capsys, rc, needle, "model.mamba_*")
    assert not (tmp_path / "run").exists()
    from nano_hybrid.config import compose
    from nano_hybrid.runconfig import validate

    validate(compose(["data=mock", *overrides, *extra, "kernels.backend=torch", f"run_dir={tmp_path / 'run2'}"]))


def test_a_backend_with_32_bit_offsets_is_refused_where_zxbcdt_passes_them(tmp_path):
    """A backend that indexes with 32-bit offsets (mamba_ssm) refuses mixer dims whose zxbcdt has more than 2^31 - 1
    elements, with one ConfigError at validation naming the backend and the way out; the same dims pass at a shorter
    sequence, on a backend without the limit, and in a model without Mamba layers."""
    import dataclasses

    from kernels.registry import INT32_OFFSET_LIMIT, get_backend, mixer_elements, zxbcdt_elements
    from nano_hybrid.config import compose
    from nano_hybrid.errors import ConfigError
    from nano_hybrid.model.config import mixer_dims
    from nano_hybrid.runconfig import _check_backend_limit, _mixer_dims_of_run

    nano = dict(h=64, p=64, g=8, n=128, c=128)
    assert INT32_OFFSET_LIMIT == 2**31 - 1
    assert zxbcdt_elements(b=1, l=262144, h=64, p=64, g=8, n=128) == 262144 * 10304 > INT32_OFFSET_LIMIT
    # the chunk states outgrow zxbcdt with a large state and a small chunk: (1, 8192 / 16, 64, 64, 256) > 1 x 8192 x
    # (2*64*64 + 2*8*256 + 64)
    assert mixer_elements(b=1, l=262144, **nano) == (262144 * 10304, "zxbcdt")
    assert mixer_elements(b=1, l=8192, h=64, p=64, g=8, n=256, c=16) == (512 * 64 * 64 * 256, "the chunk states")
    torch_backend = get_backend("torch")
    limited = dataclasses.replace(torch_backend, name="mamba_ssm", max_mixer_elements=INT32_OFFSET_LIMIT)
    assert "the chunk states at 1 x 65536" in limited.shape_refusal(b=1, l=65536, h=64, p=64, g=8, n=256, c=16)
    assert limited.shape_refusal(b=1, l=208_000, **nano) is None  # 2.14e9 elements
    assert "zxbcdt at 1 x 262144" in limited.shape_refusal(b=1, l=262144, **nano)
    assert "2.7e+09 elements" in limited.shape_refusal(b=1, l=262144, **nano)
    assert limited.shape_refusal(b=2, l=131072, **nano) and torch_backend.shape_refusal(b=1, l=262144, **nano) is None

    def cfg(seq, *extra):
        return compose(["data=mock", *TINY, "model=nano30b_slice", f"train.seq_length={seq}",
                        "train.micro_batch_size=1", *extra, f"run_dir={tmp_path / 'run'}"])

    long = cfg(262144)
    assert mixer_dims(long)["l"] == 262144
    with pytest.raises(ConfigError, match="'mamba_ssm' indexes with 32-bit offsets.*kernels.backend=helion"):
        _check_backend_limit(mixer_dims(long), limited)
    _check_backend_limit(mixer_dims(cfg(8192)), limited)
    _check_backend_limit(mixer_dims(long), torch_backend)
    assert _mixer_dims_of_run(compose(["data=mock", *TINY, "model.hybrid_override_pattern=*E"])) is None
    # context parallelism: each rank's mixer sees the whole sequence with its share of the heads (megatron's
    # MambaContextParallel), 262144 x (2*32*64 + 2*4*128 + 32) = 1.35e9 elements at CP 2
    cp2 = cfg(262144, "parallel.context_parallel_size=2")
    assert {k: mixer_dims(cp2)[k] for k in "blhg"} == dict(b=1, l=262144, h=32, g=4)
    _check_backend_limit(mixer_dims(cp2), limited)
    # groups per TP rank fewer than CP: one group per rank, replicated (TP 8 leaves 1 group; CP 2 halves the heads)
    tp8cp2 = cfg(8192, "parallel.tensor_model_parallel_size=8", "parallel.context_parallel_size=2")
    assert {k: mixer_dims(tp8cp2)[k] for k in "lhg"} == dict(l=8192, h=4, g=1)
    with pytest.raises(ConfigError, match="mamba_num_heads per tensor-parallel rank \\(8\\) is not divisible"):
        mixer_dims(cfg(8192, "parallel.tensor_model_parallel_size=8", "parallel.context_parallel_size=16"))
