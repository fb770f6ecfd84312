#!/usr/bin/env python3
"""Benchmark: the fused split-conv1d-scan op + gated RMSNorm, forward+backward, helion vs mamba_ssm.

The command line of ``nano_hybrid.bench.bench_ssd_bwd`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.bench_ssd_bwd import main

if __name__ == "__main__":
    sys.exit(main())
