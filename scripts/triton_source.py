#!/usr/bin/env python3
"""The Triton source of every tunable Helion kernel at model shapes, on the CPU; ``--compare`` with an earlier dump.

The command line of ``nano_hybrid.bench.triton_source`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.triton_source import main

if __name__ == "__main__":
    sys.exit(main())
