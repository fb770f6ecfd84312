#!/usr/bin/env python3
"""Step-time A/B of kernel backends in ONE process, ONE model, the same batches.

The command line of ``nano_hybrid.bench.ab_step_time`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.ab_step_time import main

if __name__ == "__main__":
    sys.exit(main())
