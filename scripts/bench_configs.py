#!/usr/bin/env python3
"""Configs of one tunable Helion kernel timed side by side at a model shape, with an A-vs-A control.

The command line of ``nano_hybrid.bench.bench_configs`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.bench_configs import main

if __name__ == "__main__":
    sys.exit(main())
