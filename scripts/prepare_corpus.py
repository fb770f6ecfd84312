"""Build a deduplicated corpus from directory trees, whole packages held out for validation (nano_hybrid/data/corpus.py).

The command line of ``nano_hybrid.tools.prepare_corpus`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.tools.prepare_corpus import main

if __name__ == "__main__":
    sys.exit(main())
