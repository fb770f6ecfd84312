import pytest
import torch

from kernels.registry import BackendUnavailableError, UnknownBackendError, available_backends, get_backend


def test_torch_backend_is_the_reference():
    be = get_backend("torch")
    assert be.name == "torch"
    from kernels.mamba_split import mamba_split_conv1d_scan_combined_ref
    assert be.mamba_split_conv1d_scan_combined is mamba_split_conv1d_scan_combined_ref
    norm = be.RMSNormGated(8, eps=1e-5, group_size=4, norm_before_gate=False)
    assert norm(torch.randn(2, 8)).shape == (2, 8)


def test_unknown_backend_names_the_choices():
    with pytest.raises(UnknownBackendError, match="unknown kernel backend 'trition'.*torch, mamba_ssm, helion"):
        get_backend("trition")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_gpu_backends_unavailable_on_cpu_with_one_line(monkeypatch):
    monkeypatch.delenv("HELION_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU") as ei:
        get_backend("mamba_ssm")
    assert "\n" not in str(ei.value)
    status = available_backends()
    assert status["torch"] is None and status["mamba_ssm"]


def test_kernel_switches_are_validated_not_ignored():
    from kernels.registry import KernelSwitchError, configure_backend

    with pytest.raises(KernelSwitchError, match="kernels.autotune=true applies to kernels.backend=helion only"):
        configure_backend("torch", autotune=True)
    with pytest.raises(UnknownBackendError):
        configure_backend("nope")
    assert configure_backend("torch", deterministic=True).name == "torch"


def test_helion_switches_reach_the_kernels():
    from kernels import ssd_helion_bwd, tuning
    from kernels.registry import configure_backend

    try:
        configure_backend("helion", autotune=True, deterministic=True)
        assert tuning.autotune_enabled() and ssd_helion_bwd.is_deterministic()
        configure_backend("helion")
        assert not tuning.autotune_enabled() and not ssd_helion_bwd.is_deterministic()
    finally:
        tuning.set_autotune(False)
        ssd_helion_bwd.set_deterministic(False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpret-mode test")
@pytest.mark.parametrize("var,what", [("NANO_HELION_SSD_BWD_VARIANT", "backward"), ("NANO_HELION_SSD_FWD_VARIANT", "forward")])
def test_bad_helion_variant_setting_is_one_backend_error(var, what):
    """An unknown kernel variant in the environment fails the helion backend with one BackendUnavailableError
    that names the setting and the known variants (train.py prints it as one line), not an import traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = (
        "import torch\n"
        "lib = torch.library.Library('aten', 'IMPL')\n"  # the test-only hl.dot shim of tests/conftest.py
        "lib.impl('mm.dtype', lambda a, b, out_dtype: torch.mm(a.float(), b.float()).to(out_dtype), 'CPU')\n"
        "from kernels import registry\n"
        "try:\n"
        "    registry.get_backend('helion')\n"
        "except registry.BackendUnavailableError as e:\n"
        "    print('ERR', e)\n"
    )
    env = {**os.environ, var: "bogus", "HELION_INTERPRET": "1", "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ERR kernel backend 'helion': ") and f"{var}='bogus'" in r.stdout
    assert f"unknown SSD {what} variant" in r.stdout and "'v1'" in r.stdout
