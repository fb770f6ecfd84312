"""The seed study on one GPU: corpus (built if missing), >= 2 seeds per arm and one long helion run side by side,
stopped before --minutes, resumed by the same command, then the grouped comparison (nano_hybrid/convergence_study.py).

The command line of ``nano_hybrid.tools.convergence_study`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.tools.convergence_study import main

if __name__ == "__main__":
    sys.exit(main())
