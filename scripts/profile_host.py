#!/usr/bin/env python3
"""Host (CPU) cost of one Mamba-2 mixer op forward+backward per kernel backend, on a GPU.

The command line of ``nano_hybrid.bench.profile_host`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.profile_host import main

if __name__ == "__main__":
    sys.exit(main())
