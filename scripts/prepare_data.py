"""Tokenize JSONL or text files into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx + PREFIX.json).

The command line of ``nano_hybrid.tools.prepare_data`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.tools.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())
