"""Compare groups of runs per arm (seeds): seed bands and the final validation-loss difference with a 95% interval.

The command line of ``nano_hybrid.tools.compare_seeds`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.tools.compare_seeds import main

if __name__ == "__main__":
    sys.exit(main())
