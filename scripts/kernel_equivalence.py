#!/usr/bin/env python3
"""Bitwise equivalence of the default helion mixer op between two ``kernels`` trees.

The command line of ``nano_hybrid.bench.kernel_equivalence`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.kernel_equivalence import main

if __name__ == "__main__":
    sys.exit(main())
