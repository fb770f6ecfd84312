"""Write a Megatron indexed dataset (``<prefix>.bin`` + ``<prefix>.idx``) from text files.

One document per file, byte-level tokens, an end-of-document token after each document. The files are
written under temporary names and published by rename (``.bin`` first, ``.idx`` last), so a prefix for
which ``IndexedDataset.exists`` is true is always complete.

The default corpus is every ``.py`` file of this Python's standard library (no network needed), in
sorted path order, so the same interpreter always yields the same token stream.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from nano_hybrid.data.tokenizer import ByteTokenizer


class DataPreparationError(RuntimeError):
    """The corpus could not be written."""


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


def text_sources(paths: list[str | Path], suffixes: tuple[str, ...] = (".txt", ".md", ".py", ".rst")) -> list[Path]:
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


def write_indexed_dataset(files: list[Path], prefix: str | Path, tokenizer: ByteTokenizer | None = None) -> dict:
    """Tokenize ``files`` (one document each) into ``prefix.bin/.idx``; returns a summary dict."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tokenizer = tokenizer or ByteTokenizer()
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = prefix.with_name(f".{prefix.name}.tmp{os.getpid()}")
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    t0 = time.perf_counter()
    n_docs = n_tokens = 0
    try:
        builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=dtype)
        eod = np.array([tokenizer.eod], dtype=dtype)
        for f in files:
            ids = tokenizer.tokenize(f.read_bytes())
            if ids.size == 0:
                continue
            doc = np.concatenate([ids.astype(dtype), eod])
            builder.add_document(doc, [doc.size])
            n_docs += 1
            n_tokens += int(doc.size)
        builder.finalize(f"{tmp}.idx")
        if n_docs == 0:
            raise DataPreparationError(f"all {len(files)} input files are empty")
        os.replace(f"{tmp}.bin", f"{prefix}.bin")
        os.replace(f"{tmp}.idx", f"{prefix}.idx")
    finally:
        for ext in (".bin", ".idx"):
            Path(f"{tmp}{ext}").unlink(missing_ok=True)
    summary = {
        "prefix": str(prefix),
        "documents": n_docs,
        "tokens": n_tokens,
        "tokenizer": type(tokenizer).__name__,
        "python": sys.version.split()[0],
        "seconds": round(time.perf_counter() - t0, 2),
    }
    Path(f"{prefix}.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def dataset_exists(prefix: str | Path) -> bool:
    return Path(f"{prefix}.idx").is_file() and Path(f"{prefix}.bin").is_file()


def ensure_corpus(prefix: str | Path, source: str | None, log=print) -> None:
    """Make sure ``prefix`` exists; build it from ``source`` (only ``stdlib``) if absent.

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
    log(f"preparing the default corpus (Python stdlib sources) at {prefix} ...")
    try:
        summary = write_indexed_dataset(stdlib_sources(), prefix)
    except OSError as e:
        raise DataPreparationError(f"could not write the default corpus at {prefix}: {e}") from e
    log(f"wrote {summary['documents']} documents, {summary['tokens']:,} tokens in {summary['seconds']} s")
