#!/usr/bin/env python3
"""Trained model -> Hugging Face export -> transformers: the same next-token losses on a held-out batch.

The command line of ``nano_hybrid.bench.hf_check`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.hf_check import main

if __name__ == "__main__":
    sys.exit(main())
