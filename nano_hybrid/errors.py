"""One-line errors of a training run, also under torchrun, and the start-up warnings that are filtered.

A :class:`RunError` stops the run with one ``error: ...`` line on stderr and its ``exit_code`` (2: bad input
or state found before any training step, 1: a failure during training). A ``collective`` error is decided on
rank 0 and shared with every rank, so only rank 0 prints it: one line per job. Under torchrun the line is
also written to the worker's error file (``TORCHELASTIC_ERROR_FILE``), so torchrun's failure summary names
it as the root cause instead of pointing at its traceback documentation.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import warnings


class ConfigError(ValueError):
    """A bad configuration, reported before any work starts (``nano_hybrid.config`` raises it; one line)."""


EXIT_BAD_INPUT = 2
EXIT_FAILED = 1

# Known, harmless start-up warnings of a run without Transformer Engine/Apex (megatron-core falls back to
# torch modules, as intended here) and of megatron-core's config defaults. Filtered here and only here.
HARMLESS_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed. Falling back to Torch Norm",
    "full scope is deprecated. Use empty cuda_graph_scope",
    # megatron-core's dist_checkpointing load calls torch's deprecated alias (same function)
    "`load_state_dict` is deprecated and will be removed in future versions",
    # megatron-core's DDP/distributed optimizer call torch's deprecated collective names (same functions)
    "`torch.distributed.reduce_scatter_tensor` is deprecated",
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    # Helion's autotuner search space for symmetric-memory kernels, which this project does not use
    "max_num_sm_multipler is reduced",
)
# The kernels' own notices (which config each kernel runs, which fallback): shown as their one line, without the
# file:line and source line that Python's warning display adds.
KERNEL_NOTICE_PREFIX = "nano_hybrid kernels:"
# Log records of the same kind: (logger, text the message starts with).
HARMLESS_LOG_RECORDS = (
    # local layer specs pass megatron's MLP/MoE spec, for which it uses its default kwargs (what is wanted)
    ("megatron.core.transformer.transformer_layer", "Unknown MLP type"),
    # data=mock: megatron's MockGPTDataset has no index cache directory
    ("megatron.core.datasets.gpt_dataset", "Unable to save MockGPTDataset indexes"),
)


# Warnings of one megatron-core module only: (message start, module). The distributed optimizer's zero_grad reads
# ``.grad`` of its fp32 shard views (non-leaf views of the main-parameter buffer, never given an autograd gradient):
# the read is what megatron intends, torch warns on every rank.
HARMLESS_MODULE_WARNINGS = (
    ("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed", "megatron.core.optimizer.optimizer"),
)


class _DropRecords(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _format_warning(message, category, filename, lineno, line=None):
    if str(message).startswith(KERNEL_NOTICE_PREFIX):
        return f"{message}\n"
    return _format_warning.previous(message, category, filename, lineno, line)


def filter_startup_warnings() -> None:
    """Silence the known harmless start-up warnings and log records, and show the kernels' notices as one line
    each (idempotent; recorded warnings, as in tests, are unchanged)."""
    if warnings.formatwarning is not _format_warning:
        _format_warning.previous = warnings.formatwarning
        warnings.formatwarning = _format_warning
    for text in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{text}")
    for text, module in HARMLESS_MODULE_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(text), module=re.escape(module))
    for name, prefix in HARMLESS_LOG_RECORDS:
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropRecords) and f.prefix == prefix for f in log.filters):
            log.addFilter(_DropRecords(prefix))


class RunError(RuntimeError):
    """A run-stopping condition with a one-line message."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, *, collective: bool = False):
        super().__init__(message)
        self.collective = collective


def _write_line(line: str) -> None:
    """Write one stderr line in a single write, so lines from ranks sharing a pipe never interleave."""
    data = (line + "\n").encode()
    try:
        fd = sys.stderr.fileno()
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (captured output)
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        return
    os.write(fd, data)


def report_error(message: str, *, rank: int, collective: bool = False) -> bool:
    """Print ``error: message`` (once per job for a collective error: rank 0 prints it) and leave it for torchrun's
    summary; returns whether this rank printed it."""
    line = f"error: {message}"
    printed = not collective or rank == 0
    if printed:
        _write_line(line)
    err_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if err_file:
        try:
            with open(err_file, "w") as f:
                # torch.distributed.elastic's error-file layout; the summary's "traceback" field shows py_callstack
                # ("printed": this rank wrote the line; nano_hybrid.launch prints it when no failed rank did)
                json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line, "printed": printed,
                                                                      "timestamp": str(int(time.time()))}}}, f)
        except OSError:
            pass  # the printed line is the report; the summary then shows torchrun's generic text
    return printed


def decided_on_rank0(fn, *args, **kwargs):
    """Run ``fn`` on rank 0 only and share its outcome: its return value on every rank, or its RunError
    raised on every rank as a collective error (printed once). Other ranks wait for rank 0."""
    import torch.distributed as dist

    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if multi else 0
    box: list = [None, None, None]  # result, message, exit code
    if rank == 0:
        try:
            box[0] = fn(*args, **kwargs)
        except RunError as e:
            box[1], box[2] = str(e), e.exit_code
    if multi:
        dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        err = RunError(box[1], collective=True)
        err.exit_code = box[2]
        raise err
    return box[0]
