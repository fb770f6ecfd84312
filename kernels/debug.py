"""Debugging and measurement knobs of the kernels, read from the environment here and nowhere else.

None of them changes what a kernel computes or which kernel runs; the settings that do are
``kernels.settings.HelionSettings`` (config keys ``kernels.helion.*``).

``NANO_HELION_DUMP_DIR=<dir>``
    Each compilation of a Helion kernel (``kernels.tuning.compiled``) also writes its normalized config and
    the generated Triton source to ``<dir>/<kernel>_<sha>.py``: for comparing what two processes run for the
    same kernel, config and argument signature.
``NANO_TUNE_TIMER=events|cudagraph``
    The timer of the config search (``scripts/tune_kernels.py --timer`` sets it): "events" (default;
    ``triton.testing.do_bench``: CUDA events around each call, L2 flushed between calls, so a kernel shorter
    than its host launch is timed at the launch's pace) or "cudagraph" (``do_bench_cudagraph``: replays of a
    CUDA graph, i.e. device time, for few-microsecond kernels such as the chunk cumsum).
"""

from __future__ import annotations

import os
from pathlib import Path

TIMERS = ("events", "cudagraph")


def dump_dir() -> Path | None:
    """``NANO_HELION_DUMP_DIR`` as a path, or None when unset."""
    d = os.environ.get("NANO_HELION_DUMP_DIR")
    return Path(d) if d else None


def tune_timer() -> str:
    """``NANO_TUNE_TIMER`` ("events" when unset); a ValueError naming the variable for any other value."""
    value = os.environ.get("NANO_TUNE_TIMER", "events")
    if value not in TIMERS:
        raise ValueError(f"NANO_TUNE_TIMER={value!r}: unknown timer (known: {', '.join(TIMERS)})")
    return value
