#!/usr/bin/env python3
"""Forward+backward time per layer kind (M, E, *) of our megatron-core layers at Nano dims, the
52-layer estimate, and the Mamba-2 layer (with its projections) per kernel backend side by side.

The command line of ``nano_hybrid.bench.bench_layers`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.bench_layers import main

if __name__ == "__main__":
    sys.exit(main())
