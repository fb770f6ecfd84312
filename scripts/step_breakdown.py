#!/usr/bin/env python3
"""Where the training step goes: device time per category of a profiled ``train_step``, for one or more arms.

The command line of ``nano_hybrid.bench.step_breakdown`` (its docstring: method, options, output).
"""

import sys

from nano_hybrid.bench.step_breakdown import main

if __name__ == "__main__":
    sys.exit(main())
