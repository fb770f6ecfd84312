"""Search Helion configs for tunable kernels on this GPU and write winners to kernels/configs/<arch>/.

The command line of ``nano_hybrid.bench.tune_kernels`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.tune_kernels import main

if __name__ == "__main__":
    sys.exit(main())
