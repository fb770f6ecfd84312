#!/usr/bin/env python3
"""Gradient match of kernel backends at a trained state: the same weights and batches, one process.

The command line of ``nano_hybrid.bench.grad_match`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.grad_match import main

if __name__ == "__main__":
    sys.exit(main())
