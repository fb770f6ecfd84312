"""Side-by-side on one GPU: mamba-ssm gated RMSNorm vs Helion, causal-conv1d CUDA vs Helion (fwd and bwd).

The command line of ``nano_hybrid.bench.bench_norm_conv`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.bench_norm_conv import main

if __name__ == "__main__":
    sys.exit(main())
