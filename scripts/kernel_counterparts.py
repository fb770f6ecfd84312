#!/usr/bin/env python3
"""Per-kernel counterparts from a ``bench_kernels.py --backend mamba_ssm --compare helion`` result.

The command line of ``nano_hybrid.bench.kernel_counterparts`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.kernel_counterparts import main

if __name__ == "__main__":
    sys.exit(main())
