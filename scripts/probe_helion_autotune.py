"""Probe: does Helion 1.5.0's own autotuner work on this GPU host, and under which settings?

The command line of ``nano_hybrid.bench.probe_helion_autotune`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.probe_helion_autotune import main

if __name__ == "__main__":
    sys.exit(main())
