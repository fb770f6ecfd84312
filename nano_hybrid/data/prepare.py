"""Write a Megatron indexed dataset (``<prefix>.bin`` + ``<prefix>.idx``) from JSONL or plain-text files.

Inputs:
- JSONL (``.jsonl``/``.json``): one document per line, its text under ``json_key`` (default ``text``);
  tokenized and written exactly as Megatron-LM's ``tools/preprocess_data.py`` does with the same tokenizer
  (one sequence per document, ``eod`` appended with ``append_eod``, an empty text is an empty document,
  token dtype ``DType.optimal_dtype(vocab_size)``), so the two tools write the same bytes.
- any other file: one document per file (UTF-8 text; the byte tokenizer takes the raw bytes, the BPE
  tokenizers see the text decoded with U+FFFD for invalid bytes); empty files are skipped.

Tokenization runs in ``workers`` processes (``multiprocessing.Pool``, each builds its own tokenizer) in
input order. The files are written under temporary names and published by rename (``.bin`` first, ``.idx``
last), so a prefix for which ``IndexedDataset.exists`` is true is always complete.

The default corpus is every ``.py`` file of this Python's standard library (no network needed), in
sorted path order, so the same interpreter and tokenizer always yield the same token stream.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from nano_hybrid.data.check import fingerprint
from nano_hybrid.data.tokenizer import TokenizerError, TokenizerSpec, build_tokenizer

JSONL_SUFFIXES = (".jsonl", ".json")


class DataPreparationError(RuntimeError):
    """The corpus could not be written (bad input, tokenizer, or output)."""


def stdlib_sources() -> list[Path]:
    """All ``.py`` files of the standard library (site-packages excluded), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts and p.is_file()),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not files:
        raise DataPreparationError(f"no .py files found under the standard library at {root}")
    return files


def text_sources(
    paths: list[str | Path], suffixes: tuple[str, ...] = (".txt", ".md", ".py", ".rst", ".jsonl", ".json")
) -> list[Path]:
    """Expand files and directories (recursively, by suffix) into a sorted file list."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(q for q in p.rglob("*") if q.is_file() and q.suffix in suffixes))
        elif p.is_file():
            out.append(p)
        else:
            raise DataPreparationError(f"input {p} does not exist")
    if not out:
        raise DataPreparationError(f"no input files with suffix {suffixes} in {[str(p) for p in paths]}")
    return out


def is_jsonl(path: Path) -> bool:
    return path.suffix in JSONL_SUFFIXES


def check_inputs(files: list[Path], json_key: str) -> int:
    """Fail before any work on a missing, unreadable or empty input, or a JSONL whose first record lacks
    ``json_key``; returns the total input size in bytes."""
    total = 0
    for f in files:
        try:
            with open(f, "rb") as fh:
                head = fh.readline()
            size = f.stat().st_size
        except OSError as e:
            raise DataPreparationError(f"cannot read input {f}: {e.strerror or e}") from None
        if is_jsonl(f):
            if size == 0 or not head.strip():
                raise DataPreparationError(f"input {f} is empty (or its first line is blank)")
            _json_text(head, json_key, f, 1)
        total += size
    if total == 0:
        raise DataPreparationError(f"all {len(files)} input files are empty")
    return total


def _json_text(line: bytes | str, key: str, path, lineno: int) -> str:
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataPreparationError(
                f"{path}:{lineno}: not UTF-8 text (byte 0x{line[e.start]:02x} at column {e.start + 1}); JSONL input "
                "must be UTF-8") from None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataPreparationError(f"{path}:{lineno}: not valid JSON: {e.msg.removesuffix(' at')} at column {e.colno}") from None
    if not isinstance(record, dict) or key not in record:
        raise DataPreparationError(f"{path}:{lineno}: no {key!r} key in this JSON line (--json-key names it)")
    text = record[key]
    if not isinstance(text, str):
        raise DataPreparationError(f"{path}:{lineno}: {key!r} is a {type(text).__name__}, not a string")
    return text


# ------------------------------------------------------------------------------ worker side
_WORKER_TOKENIZER = None


def _init_worker(spec: TokenizerSpec) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = build_tokenizer(spec)


def _encode(task: tuple) -> tuple:
    """(kind, path, lineno, payload) -> (ids or None, input bytes, error or None); ``ids`` None = skip."""
    kind, path, lineno, payload = task
    tok = _WORKER_TOKENIZER
    try:
        if kind == "jsonl":
            text = _json_text(payload, _encode.json_key, path, lineno)
            return np.asarray(tok.tokenize(text), dtype=np.int64), len(payload), None
        raw = Path(path).read_bytes()
        if not raw:
            return None, 0, None
        data = raw if type(tok).__name__ == "ByteTokenizer" else raw.decode("utf-8", errors="replace")
        return np.asarray(tok.tokenize(data), dtype=np.int64), len(raw), None
    except DataPreparationError as e:
        return None, 0, str(e)
    except OSError as e:
        return None, 0, f"cannot read input {path}: {e.strerror or e}"


_encode.json_key = "text"


def _set_json_key(spec: TokenizerSpec, key: str) -> None:
    _init_worker(spec)
    _encode.json_key = key


def _tasks(files: list[Path]) -> Iterator[tuple]:
    for f in files:
        if is_jsonl(f):
            with open(f, "rb") as fh:
                for lineno, line in enumerate(fh, start=1):
                    if line.strip():
                        yield ("jsonl", str(f), lineno, line)
        else:
            yield ("file", str(f), 0, None)


# ------------------------------------------------------------------------------ writer
@dataclass
class _Progress:
    """A rich progress bar over input bytes with documents/s and tokens/s (or nothing when disabled)."""

    total_bytes: int
    enabled: bool

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.bar = None
        if self.enabled:
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(), transient=False,
            )
            self.bar.__enter__()
            self.task = self.bar.add_task("tok", total=self.total_bytes, stats="")
        return self

    def update(self, nbytes: int, docs: int, tokens: int) -> None:
        if self.bar is None:
            return
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.bar.update(self.task, advance=nbytes, stats=f"{docs:,} docs | {docs / dt:,.0f} docs/s | {tokens / dt:,.0f} tok/s")

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)


@contextlib.contextmanager
def _as_preparation_error():
    """A TokenizerError inside becomes the one-line DataPreparationError."""
    try:
        yield
    except TokenizerError as e:
        raise DataPreparationError(str(e)) from None


def write_indexed_dataset(
    files: list[Path],
    prefix: str | Path,
    tokenizer=None,
    *,
    json_key: str = "text",
    append_eod: bool = True,
    workers: int = 1,
    progress: bool = False,
) -> dict:
    """Tokenize ``files`` into ``prefix.bin/.idx``; returns a summary dict (also written to ``prefix.json``).

    ``tokenizer``: a TokenizerSpec, a ``data.tokenizer`` mapping or type name (default ``byte``); workers
    build their own copy from it. Raises DataPreparationError (naming the file and line) on bad input.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    spec = tokenizer if isinstance(tokenizer, TokenizerSpec) else TokenizerSpec.from_cfg(tokenizer)
    if workers < 1:
        raise DataPreparationError(f"workers must be >= 1, got {workers}")
    with _as_preparation_error():
        spec.check_files()
    files = [Path(f) for f in files]
    total_bytes = check_inputs(files, json_key)
    with _as_preparation_error():
        main_tok = build_tokenizer(spec)
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = prefix.with_name(f".{prefix.name}.tmp{os.getpid()}")
    dtype = DType.optimal_dtype(main_tok.vocab_size)
    t0 = time.perf_counter()
    n_docs = n_tokens = n_bytes = 0
    pool = None
    try:
        builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=dtype)
        results, pool = _encoded(files, spec, json_key, workers)
        with _Progress(total_bytes, progress) as bar:
            for ids, nbytes, err in results:
                if err is not None:
                    raise DataPreparationError(err)
                n_bytes += nbytes
                if ids is None:
                    bar.update(nbytes, n_docs, n_tokens)
                    continue
                if ids.size and append_eod:
                    ids = np.append(ids, main_tok.eod)
                builder.add_document(ids, [ids.size] if ids.size else [])
                n_docs += 1
                n_tokens += int(ids.size)
                bar.update(nbytes, n_docs, n_tokens)
        builder.finalize(f"{tmp}.idx")
        if n_tokens == 0:
            raise DataPreparationError(f"the {len(files)} input file(s) hold no text to tokenize")
        os.replace(f"{tmp}.bin", f"{prefix}.bin")
        os.replace(f"{tmp}.idx", f"{prefix}.idx")
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        for ext in (".bin", ".idx"):
            Path(f"{tmp}{ext}").unlink(missing_ok=True)
    seconds = time.perf_counter() - t0
    summary = {
        "prefix": str(prefix),
        "documents": n_docs,
        "tokens": n_tokens,
        "input_bytes": n_bytes,
        "tokenizer": main_tok.describe(),
        "tokenizer_type": spec.type,
        "dtype": np.dtype(dtype).name,
        "append_eod": append_eod,
        "workers": workers,
        "python": sys.version.split()[0],
        **_rates(seconds, n_docs, n_tokens),
        "fingerprint": fingerprint(prefix),  # checked by nano_hybrid.data.check before a run reads the corpus
    }
    Path(f"{prefix}.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _rates(seconds: float, n_docs: int, n_tokens: int) -> dict:
    return {"seconds": round(seconds, 2), "docs_per_s": round(n_docs / max(seconds, 1e-9), 1),
            "tokens_per_s": round(n_tokens / max(seconds, 1e-9), 1)}


def _encoded(files: list[Path], spec, json_key: str, workers: int):
    """(results, pool): the files' encoded documents, in order, from this process (workers=1, pool None) or a
    pool of ``workers`` processes (the caller terminates it)."""
    if workers == 1:
        _set_json_key(spec, json_key)
        return map(_encode, _tasks(files)), None
    # fork is cheapest; a process that already holds a CUDA context (the trainer) spawns its workers
    torch = sys.modules.get("torch")
    cuda_up = torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" and not cuda_up else "spawn")
    pool = ctx.Pool(workers, initializer=_set_json_key, initargs=(spec, json_key))
    return pool.imap(_encode, _tasks(files), chunksize=32), pool


def corpus_tokenizer_type(prefix: str | Path) -> str | None:
    """The tokenizer type recorded in ``prefix.json`` by write_indexed_dataset (None if not recorded)."""
    try:
        return json.loads(Path(f"{prefix}.json").read_text()).get("tokenizer_type")
    except (OSError, ValueError, AttributeError):
        return None


def dataset_exists(prefix: str | Path) -> bool:
    return Path(f"{prefix}.idx").is_file() and Path(f"{prefix}.bin").is_file()


def ensure_corpus(prefix: str | Path, source: str | None, log=print, tokenizer=None, workers: int = 1) -> None:
    """Make sure ``prefix`` exists; build it from ``source`` (only ``stdlib``) with ``tokenizer`` if absent.

    Raises DataPreparationError (never substitutes other data) when the prefix is missing and cannot be built.
    """
    if dataset_exists(prefix):
        return
    if source is None:
        raise DataPreparationError(
            f"data path {prefix}.bin/.idx not found (set data.prepare_if_missing=stdlib or run scripts/prepare_data.py)"
        )
    if source != "stdlib":
        raise DataPreparationError(f"unknown data.prepare_if_missing={source!r}; supported: stdlib or null")
    spec = tokenizer if isinstance(tokenizer, TokenizerSpec) else TokenizerSpec.from_cfg(tokenizer)
    log(f"preparing the default corpus (Python stdlib sources, {spec.type} tokens) at {prefix} ...")
    try:
        summary = write_indexed_dataset(stdlib_sources(), prefix, spec, workers=workers)
    except OSError as e:
        raise DataPreparationError(f"could not write the default corpus at {prefix}: {e}") from e
    log(f"wrote {summary['documents']} documents, {summary['tokens']:,} tokens in {summary['seconds']} s")
