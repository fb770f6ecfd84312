#!/usr/bin/env python3
"""The Mamba-2 split-conv1d-scan op (forward + backward) on a grid of model shapes, helion against mamba_ssm.

The command line of ``nano_hybrid.bench.bench_shape_grid`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.bench_shape_grid import main

if __name__ == "__main__":
    sys.exit(main())
