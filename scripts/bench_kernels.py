#!/usr/bin/env python3
"""Per-kernel device-time breakdown of one Mamba-2 mixer op forward+backward, per kernel backend.

The command line of ``nano_hybrid.bench.bench_kernels`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.bench_kernels import main

if __name__ == "__main__":
    sys.exit(main())
