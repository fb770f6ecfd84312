"""Tokenize JSONL or text files into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx + PREFIX.json).

    python scripts/prepare_data.py                                      # stdlib sources, byte tokens -> data/stdlib/stdlib
    python scripts/prepare_data.py --tokenizer tekken131k --output data/stdlib_bpe131k/stdlib   # same text, 131k BPE
    python scripts/prepare_data.py --input corpus.jsonl --json-key text --tokenizer tekken131k \\
        --output data/mine/mine --workers 8
    python -m nano_hybrid.train data=stdlib_bpe131k data.paths=[data/mine/mine] data.prepare_if_missing=null

JSONL lines ({"text": ...}) are documents, tokenized exactly as Megatron-LM's tools/preprocess_data.py does
(same .bin/.idx bytes for the same tokenizer); any other file is one document. Directories are searched
recursively for --suffix files. --tokenizer takes byte, tekken131k (the 131,072-entry Tekken BPE at
data/tokenizers/tekken_131k.json, see scripts/prepare_tokenizer.py), tiktoken:PATH.json or hf:PATH (a
tokenizer folder or tokenizer.json). Bad input (missing, unreadable or empty file, a JSONL line without the
key, a missing tokenizer file, an --output that is a folder or cannot be written, an existing dataset at --output
without --force) stops with one `error: ...` line (file and line named) and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path


# megatron-core warns on import that TE/Apex are absent; the tokenizers and the dataset builder do not use them.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from nano_hybrid.data.prepare import DataPreparationError, stdlib_sources, text_sources, write_indexed_dataset
from nano_hybrid.data.tokenizer import TokenizerError, TokenizerSpec, spec_from_arg
from nano_hybrid.errors import EXIT_BAD_INPUT
from nano_hybrid.schema import DataSchema, defaults


def check_output(output: str) -> None:
    """Refuse an output prefix that ends with a path separator or names a folder, or whose folder cannot be
    created or written (a file on the way, a read-only or virtual file system), before any tokenizing."""
    seps = tuple(filter(None, (os.sep, os.altsep)))
    prefix = Path(output)
    if output.endswith(seps) or prefix.name in ("", ".", "..") or prefix.is_dir():
        raise DataPreparationError(f"--output {output}: give a file prefix (folder/name), not a folder")
    above = next(p for p in prefix.absolute().parents if p.exists())
    if not above.is_dir():
        raise DataPreparationError(f"--output {output}: {above} is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".prepare_data_probe", dir=above))
    except OSError as e:
        raise DataPreparationError(f"--output {output}: cannot write in {above} ({e.strerror})") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="*", default=None, help="JSONL/text files or directories (default: the Python stdlib sources)")
    ap.add_argument("--output", default=defaults(DataSchema)["paths"][0],
                    help="output prefix (writes PREFIX.bin, PREFIX.idx, PREFIX.json)")
    ap.add_argument("--suffix", nargs="*", default=[".txt", ".md", ".py", ".rst", ".jsonl", ".json"],
                    help="file suffixes taken from directories (.jsonl/.json are read as JSONL)")
    ap.add_argument("--json-key", default="text", help="JSONL key holding each document's text")
    ap.add_argument("--tokenizer", default="byte", help="byte | tekken131k | tiktoken:PATH.json | hf:PATH")
    ap.add_argument("--vocab-size", type=int, default=131072, help="tiktoken: ids in all (Megatron --vocab-size)")
    ap.add_argument("--num-special-tokens", type=int, default=TokenizerSpec.num_special_tokens,
                    help="tiktoken: Megatron --tiktoken-num-special-tokens")
    ap.add_argument("--pattern", default=TokenizerSpec.pattern, help="tiktoken: split regex v1|v2 (Megatron --tiktoken-pattern)")
    ap.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                    help="end each document with the tokenizer's eod id (default on)")
    ap.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--force", action="store_true", help="replace an existing dataset at --output")
    args = ap.parse_args(argv)
    try:
        check_output(args.output)
        if not args.force and any(os.path.exists(f"{args.output}{ext}") for ext in (".bin", ".idx")):
            raise DataPreparationError(f"--output {args.output}: a dataset exists there ({args.output}.bin/.idx); "
                                       "pass --force to replace it, or choose another prefix")
        spec = spec_from_arg(args.tokenizer, args.vocab_size, args.num_special_tokens, args.pattern)
        spec.check_files()
        files = stdlib_sources() if args.input is None else text_sources(args.input, tuple(args.suffix))
        summary = write_indexed_dataset(
            files, args.output, spec, json_key=args.json_key, append_eod=args.append_eod, workers=args.workers,
            progress=not args.no_progress and sys.stderr.isatty(),
        )
    except (DataPreparationError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(summary))
    return 0
