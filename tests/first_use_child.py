"""``python tests/first_use_child.py <payload>``: the first-use search's child process
(``kernels.first_use.child_main``) with a test-only search in place of ``kernels.tuner.tune_call`` (no GPU here).

The search is a monkeypatch chosen by ``NANO_HYBRID_TEST_FIRST_USE_SEARCH`` (the product code has no test hooks):

- ``ok``: returns the bound kernel's spec default with ``num_warps=1`` (full, as ``tune_call`` returns it), 0.01 ms;
- ``hang``: starts a ``sleep`` process (what a compiler process of the child is to the parent), writes the child's and
  that process's pids to ``$NANO_HYBRID_TEST_FIRST_USE_PIDS``, then sleeps: a search that overruns any budget.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def install_search() -> None:
    from kernels import tuner, tuning

    mode = os.environ["NANO_HYBRID_TEST_FIRST_USE_SEARCH"]

    def ok(name, kernel, args, **kw):
        cfg = dict(kernel.bind(tuple(args)).config_spec.default_config().config, num_warps=1)
        return tuning.full_config(kernel, args, cfg), 0.01, {"how": "test search", "budget_s": kw["budget_s"]}

    def hang(name, kernel, args, **kw):
        sleeper = subprocess.Popen(["sleep", "600"])
        with open(os.environ["NANO_HYBRID_TEST_FIRST_USE_PIDS"], "w") as f:
            f.write(f"{os.getpid()} {sleeper.pid}\n")
        time.sleep(600)
        raise AssertionError("the parent did not kill this search")

    tuner.tune_call = {"ok": ok, "hang": hang}[mode]


if __name__ == "__main__":
    install_search()
    from kernels.first_use import child_main

    sys.exit(child_main(sys.argv[1]))
