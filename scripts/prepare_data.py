"""Write a Megatron indexed dataset (.bin/.idx) with the byte-level tokenizer.

    python scripts/prepare_data.py                              # default corpus: stdlib sources -> data/stdlib/stdlib
    python scripts/prepare_data.py --input docs/ notes.txt --output data/mine/mine
    python -m nano_hybrid.train data.paths=[data/mine/mine] data.prepare_if_missing=null

Each input file is one document; directories are searched recursively for --suffix files.
"""

from __future__ import annotations

import argparse
import json
import sys

from nano_hybrid.data.prepare import DataPreparationError, stdlib_sources, text_sources, write_indexed_dataset


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="*", default=None, help="files or directories (default: the Python stdlib sources)")
    ap.add_argument("--output", default="data/stdlib/stdlib", help="output prefix (writes PREFIX.bin, PREFIX.idx, PREFIX.json)")
    ap.add_argument("--suffix", nargs="*", default=[".txt", ".md", ".py", ".rst"], help="file suffixes taken from directories")
    args = ap.parse_args(argv)
    try:
        files = stdlib_sources() if args.input is None else text_sources(args.input, tuple(args.suffix))
        summary = write_indexed_dataset(files, args.output)
    except DataPreparationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
