#!/usr/bin/env python3
"""Training-loss match of kernel backends: the same model, seed, initial weights and batches, one process.

The command line of ``nano_hybrid.bench.backend_loss_match`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.backend_loss_match import main

if __name__ == "__main__":
    sys.exit(main())
