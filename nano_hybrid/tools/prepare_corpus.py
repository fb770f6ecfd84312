"""Build a deduplicated corpus from directory trees, whole packages held out for validation (nano_hybrid/data/corpus.py).

    python scripts/prepare_corpus.py --root /usr/local/lib/python3.12/dist-packages --root /usr/lib/python3.12 \\
        --output data/corpus/site --tokenizer tekken131k --valid-fraction 0.01 --workers 16
    python scripts/prepare_corpus.py --check data/corpus/site        # rescan the roots, rehash the outputs
    python -m nano_hybrid.train model=nano_proxy data=corpus data.corpus_dir=data/corpus/site

Writes OUTPUT/{train,valid}.{bin,idx,json} (Megatron indexed datasets: data.paths=[OUTPUT/train],
data.valid_paths=[OUTPUT/valid]), OUTPUT/files.tsv (root, path, package, bytes, sha256, split, tokens per kept
file) and OUTPUT/manifest.json (settings, counts, tokens per split, held-out packages, content_sha256).
--include/--exclude are fnmatch patterns on the path under its root (`*` also matches `/`); a file's package is
its first path component. Bad input (missing root, nothing matched, an unknown --valid-packages name, an existing
OUTPUT without --force) stops with one `error: ...` line and exit code 2; a --check that finds a difference
prints one `error: ...` line naming it and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings


# megatron-core warns on import that TE/Apex are absent; the tokenizers and the dataset builder do not use them.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from nano_hybrid.data.corpus import (  # noqa: E402
    DEDUP_MODES,
    DEFAULT_EXCLUDE,
    DEFAULT_INCLUDE,
    CorpusCheckError,
    CorpusError,
    CorpusSettings,
    build_corpus,
    check_corpus,
)
from nano_hybrid.data.tokenizer import TokenizerError, spec_from_arg  # noqa: E402
from nano_hybrid.errors import EXIT_BAD_INPUT


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", action="append", default=[], help="a source folder (repeat for several)")
    ap.add_argument("--output", help="the corpus folder to write")
    ap.add_argument("--check", metavar="CORPUS", help="check CORPUS against its manifest instead of building")
    ap.add_argument("--include", nargs="+", default=list(DEFAULT_INCLUDE), help="fnmatch patterns of files to take")
    ap.add_argument("--exclude", nargs="*", default=list(DEFAULT_EXCLUDE), help="fnmatch patterns of files to leave out")
    ap.add_argument("--min-bytes", type=int, default=32, help="smallest file taken (bytes)")
    ap.add_argument("--max-bytes", type=int, default=1_000_000, help="largest file taken (bytes)")
    ap.add_argument("--dedup", choices=DEDUP_MODES, default="exact",
                    help="exact: same bytes; whitespace: same text once whitespace runs are collapsed")
    ap.add_argument("--valid-packages", default=None, help="comma-separated packages held out for validation")
    ap.add_argument("--valid-fraction", type=float, default=None,
                    help="hold out packages (in sha256-of-name order) up to this fraction of the bytes (default 0.01)")
    ap.add_argument("--tokenizer", default="tekken131k", help="byte | tekken131k | tiktoken:PATH.json | hf:PATH")
    ap.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                    help="end each document with the tokenizer's eod id (default on)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes (default: all cores)")
    ap.add_argument("--force", action="store_true", help="replace an existing OUTPUT")
    args = ap.parse_args(argv)
    try:
        if args.check:
            if args.output:
                raise CorpusError("--check and --output exclude each other")
            print(json.dumps(check_corpus(args.check, args.root or None)))
            return 0
        if not args.output:
            raise CorpusError("give --output (the corpus folder) or --check CORPUS")
        if not args.root:
            raise CorpusError("give at least one --root folder")
        names = tuple(p for p in (args.valid_packages or "").split(",") if p)
        fraction = args.valid_fraction if (names or args.valid_fraction is not None) else 0.01
        settings = CorpusSettings(
            roots=tuple(args.root), include=tuple(args.include), exclude=tuple(args.exclude),
            min_bytes=args.min_bytes, max_bytes=args.max_bytes, dedup=args.dedup, valid_packages=names,
            valid_fraction=None if names and args.valid_fraction is None else fraction, append_eod=args.append_eod,
        )
        settings.validate()
        spec = spec_from_arg(args.tokenizer)
        manifest = build_corpus(settings, args.output, spec, workers=args.workers, force=args.force,
                                log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except (CorpusError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except CorpusCheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    summary = {k: manifest[k] for k in ("content_sha256", "files_kept", "valid_packages")}
    summary["tokens"] = {s: v["tokens"] for s, v in manifest["splits"].items()}
    summary["seconds"] = manifest["build"]["seconds"]
    print(json.dumps({"corpus": args.output, **summary}))
    return 0
