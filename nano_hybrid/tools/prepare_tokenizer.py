"""Write the 131,072-entry Tekken byte-level BPE as data/tokenizers/tekken_131k.json (no network).

    pip install mistral-common==1.12.0        # Apache-2.0; ships the Tekken files (the test extra has it)
    python scripts/prepare_tokenizer.py       # -> data/tokenizers/tekken_131k.json (8.8 MB)

The file is Megatron-LM's TikTokenizer format (a JSON list of {rank, token_bytes, token_str}): 130,072 BPE
ranks after 1,000 special ids (<unk> 0, <s> 1, </s> 2 = end of document, <pad> 4), split regex v2. It is
Mistral's Tekken tokenizer (tekken_240718.json), not NVIDIA's Nemotron tokenizer. Copy the written file to
machines without mistral-common (GPU hosts); `data.tokenizer.path` points at it.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings


# megatron-core warns on import that TE/Apex are absent; the tokenizers and the dataset builder do not use them.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from nano_hybrid.data.tokenizer import TEKKEN_131K_PATH, TokenizerError, extract_tekken
from nano_hybrid.errors import EXIT_BAD_INPUT


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", default=TEKKEN_131K_PATH, help="where to write the tokenizer file")
    ap.add_argument("--source", default=None, help="a Tekken JSON file (default: the installed mistral-common's)")
    args = ap.parse_args(argv)
    try:
        summary = extract_tekken(args.output, args.source)
    except TokenizerError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(summary))
    return 0
