"""Shared pytest setup (test-only shims live here, never in kernels/)."""

import os

import torch

# Without CUDA, Helion kernels can only run in interpret mode, and Helion fixes a kernel's mode when
# the kernel is *defined* (module import, i.e. test collection): set it before any kernels import.
if not torch.cuda.is_available():
    os.environ.setdefault("HELION_INTERPRET", "1")

# Helion's interpret mode (HELION_INTERPRET=1) lowers hl.dot / addmm to aten::mm.dtype, which this
# CPU torch build lacks; register a CPU implementation for the test process only.
if not torch.cuda.is_available():
    try:
        _MM_DTYPE_LIB = torch.library.Library("aten", "IMPL")
        _MM_DTYPE_LIB.impl(
            "mm.dtype", lambda a, b, out_dtype: torch.mm(a.float(), b.float()).to(out_dtype), "CPU"
        )
    except RuntimeError:  # already registered by another conftest/plugin in this process
        pass
