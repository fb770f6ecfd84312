#!/usr/bin/env python3
"""The mixer op's speed with the kernels of two ``kernels`` trees (a kernel edit against the kernels before it).

The command line of ``nano_hybrid.bench.ab_kernel_trees`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.ab_kernel_trees import main

if __name__ == "__main__":
    sys.exit(main())
