#!/usr/bin/env python3
"""Host seconds of each Helion kernel's first-call work before its launch, without and with the compile cache.

The command line of ``nano_hybrid.bench.bench_compile_cache`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.bench_compile_cache import main

if __name__ == "__main__":
    sys.exit(main())
