"""GPU check + timing of the production-speed attention and MoE layers (one GPU, bf16).

The command line of ``nano_hybrid.bench.check_fast_modules_gpu`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.check_fast_modules_gpu import main

if __name__ == "__main__":
    sys.exit(main())
