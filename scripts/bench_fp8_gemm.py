"""FP8 GEMM microbenchmark: bf16 vs torchao float8 tensorwise vs rowwise at the Nano linear shapes (fwd+bwd).

The command line of ``nano_hybrid.bench.fp8_gemm`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.fp8_gemm import main

if __name__ == "__main__":
    sys.exit(main())
