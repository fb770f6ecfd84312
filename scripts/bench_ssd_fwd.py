"""Helion SSD forward vs mamba-ssm, side by side in one process.

The command line of ``nano_hybrid.bench.bench_ssd_fwd`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.bench_ssd_fwd import main

if __name__ == "__main__":
    sys.exit(main())
