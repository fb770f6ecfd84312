"""Write the 131,072-entry Tekken byte-level BPE as data/tokenizers/tekken_131k.json (no network).

The command line of ``nano_hybrid.tools.prepare_tokenizer`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.tools.prepare_tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
