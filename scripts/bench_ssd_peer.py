"""The whole SSD forward against the strongest open peer: mamba-ssm, helion and the fused "fused5" kernel.

The command line of ``nano_hybrid.bench.bench_ssd_peer`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.bench_ssd_peer import main

if __name__ == "__main__":
    sys.exit(main())
