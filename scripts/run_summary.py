#!/usr/bin/env python3
"""Summarize a training run's metrics.jsonl, and optionally check its losses against a reference run.

The command line of ``nano_hybrid.bench.run_summary`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.run_summary import main

if __name__ == "__main__":
    sys.exit(main())
