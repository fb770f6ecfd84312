"""Memory planner vs measured peak memory on one GPU, and the recompute table (memory saved, time paid).

The command line of ``nano_hybrid.bench.plan_vs_measured`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.plan_vs_measured import main

if __name__ == "__main__":
    sys.exit(main())
