"""The SSD op fwd+bwd: mamba-ssm, helion and the Helion project's own Mamba-2 SSD example.

The command line of ``nano_hybrid.bench.bench_ssd_helion_example`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.bench_ssd_helion_example import main

if __name__ == "__main__":
    sys.exit(main())
