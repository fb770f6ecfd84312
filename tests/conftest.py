"""Shared pytest setup (test-only shims live here, never in kernels/)."""

import gc
import os
import sys

import pytest
import torch
from early_tracebacks import pytest_addoption, pytest_configure, pytest_runtest_logreport  # noqa: F401 (hooks)

# Without CUDA, Helion kernels can only run in interpret mode, and Helion fixes a kernel's mode when
# the kernel is *defined* (module import, i.e. test collection): set it before any kernels import.
if not torch.cuda.is_available():
    os.environ.setdefault("HELION_INTERPRET", "1")
    # every kernel module now, so that a test run without them among its collected modules (a subset) gets the same
    # interpret-mode kernels as the whole suite, whichever test imports them first (some unset HELION_INTERPRET)
    from kernels.tuner import discover_tunable_kernels

    discover_tunable_kernels()

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


@pytest.fixture(scope="module")
def mp():
    """Megatron's single-rank parallel state (model=tiny, parallel=single) for tests that build megatron modules;
    torn down after the module unless another test had already initialized it."""
    from megatron.core import parallel_state as ps

    from nano_hybrid.config import compose
    from nano_hybrid.parallel import destroy_parallel, initialize_parallel

    created = not ps.model_parallel_is_initialized()
    initialize_parallel(compose(["model=tiny", "parallel=single", "kernels.backend=torch"]))
    yield
    if created:
        destroy_parallel()


@pytest.fixture(autouse=True, scope="module")
def _fresh_moe_aux_loss_scale():
    """megatron keeps the MoE aux-loss backward scale in a class attribute: a bare forward/backward creates it with
    shape [], and a later training step in the same process copies a [1]-shaped scale into it and fails. Each test
    module starts without it, as a fresh training process does."""
    try:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    except ImportError:
        yield
        return
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    yield


_LEASES = None


@pytest.fixture(autouse=True)
def _gpu_memory_lease(request):
    """Under pytest-xdist on a GPU, a GPU test runs while it holds a lease of its estimated peak memory
    (``@pytest.mark.gpu_mem(GiB)``; tests/gpu_memory.py), so the workers' tests that run at once fit the GPU; after
    the test its worker returns its cached blocks to the GPU."""
    global _LEASES
    if request.node.get_closest_marker("gpu") is None or not torch.cuda.is_available():
        yield
        return
    from gpu_memory import DEFAULT_GIB, run_leases

    if _LEASES is None:
        _LEASES = run_leases() or False
    mark = request.node.get_closest_marker("gpu_mem")
    if _LEASES:
        _LEASES.acquire(float(mark.args[0]) if mark else DEFAULT_GIB)
    try:
        yield
    finally:
        try:
            # a failed test's traceback (kept in sys.last_* until the next test) holds its frames and their tensors
            for name in ("last_value", "last_exc", "last_traceback", "last_type"):
                if hasattr(sys, name):
                    setattr(sys, name, None)
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        finally:
            if _LEASES:
                _LEASES.release()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped on a machine without CUDA (pytest -m gpu runs them on a GPU host)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
