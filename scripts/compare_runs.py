#!/usr/bin/env python3
"""Compare the step time and loss curves of two or more nano-hybrid runs (A/B of kernel backends).

The command line of ``nano_hybrid.bench.compare_runs`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.compare_runs import main

if __name__ == "__main__":
    sys.exit(main())
