import json
import subprocess
import sys
from pathlib import Path

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


def test_torch_backend_imports_no_helion():
    """The torch backend (the default, and the CPU runs') loads the reference modules only: neither Helion nor the
    Helion kernel modules are imported by building it and running its ops (a fresh process)."""
    code = ("import json, sys, torch\n"
            "from kernels.registry import get_backend\n"
            "be = get_backend('torch')\n"
            "norm = be.RMSNormGated(8, eps=1e-5, group_size=4, norm_before_gate=False)\n"
            "assert norm(torch.randn(2, 8), z=torch.randn(2, 8)).shape == (2, 8)\n"
            "h, p, g, n = 2, 4, 1, 4\n"  # the fused op at a tiny shape: zxbcdt (1, 8, 2*h*p + 2*g*n + h)
            "zx = torch.randn(1, 8, 2 * h * p + 2 * g * n + h)\n"
            "y = be.mamba_split_conv1d_scan_combined(zx, torch.randn(h * p + 2 * g * n, 4), None, torch.zeros(h),\n"
            "    -torch.ones(h), torch.ones(h), 4, headdim=p, ngroups=g)\n"
            "assert y.shape == (1, 8, h * p)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('helion', 'kernels'))))\n")
    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip(), r.stdout[-2000:] + r.stderr[-2000:]
    loaded = json.loads(r.stdout.strip().splitlines()[-1])
    assert "kernels.mamba_split" in loaded and "kernels.rmsnorm_gated" in loaded, loaded
    assert not [m for m in loaded if m.split(".")[0] == "helion" or m.endswith("_helion")], loaded


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
    from kernels.registry import configure_backend

    with pytest.raises(UnknownBackendError):
        configure_backend("nope")
    assert configure_backend("torch", deterministic=True).name == "torch"


def test_helion_switches_belong_to_the_backend():
    """Two helion backends with different settings in one process: each op runs under its own runtime (switches and
    compile caches), nothing process-wide is flipped; deterministic is recorded on the backend."""
    import torch

    from kernels import tuning
    from kernels.registry import configure_backend
    from kernels.settings import HelionSettings

    a = configure_backend("helion", helion={"autotune": True, "fast_launch": False}, deterministic=True)
    b = configure_backend("helion")
    assert a.deterministic and not b.deterministic and a.settings.autotune and not b.settings.autotune
    assert tuning.runtime().settings == HelionSettings()  # building a backend changes no process state
    from kernels import rmsnorm_gated_helion as R

    seen = []

    def fwd(x3, w2, z3, eps, nbg, p):  # records the runtime the kernels would run under
        seen.append(("rmsnorm_fwd", tuning.runtime().settings))
        return x3.clone(), torch.ones(x3.shape[:-1])

    def bwd(dy, x3, w2, z3, rstd, nbg, plan):
        seen.append(("rmsnorm_bwd", tuning.runtime().settings))
        return torch.zeros_like(x3), None, torch.zeros(w2.numel())

    x = torch.randn(2, 8, 16)
    mp = pytest.MonkeyPatch()
    mp.setattr(R, "_fwd", fwd)
    mp.setattr(R, "_bwd", bwd)
    try:
        for be in (a, b):
            norm = be.RMSNormGated(16, eps=1e-5, group_size=8, norm_before_gate=False)
            norm(x.clone().requires_grad_(True)).sum().backward()
    finally:
        mp.undo()
    assert {s for n, s in seen if n == "rmsnorm_fwd"} == {a.settings, b.settings}
    assert {s for n, s in seen if n == "rmsnorm_bwd"} == {a.settings, b.settings}  # backward on autograd's thread
    assert tuning.runtime_for(a.settings) is not tuning.runtime_for(b.settings)


def test_helion_settings_travel_with_the_backend():
    """HelionSettings are typed and validated, bound into the helion backend's fused op, recorded by settings_dict();
    the fast-launch setting reaches the tuning module; bad keys / values and settings for another backend are one
    KernelSwitchError each."""
    import functools

    from kernels import tuning
    from kernels.registry import KernelSwitchError, configure_backend, get_backend
    from kernels.settings import HelionSettings, HelionSettingsError

    assert HelionSettings().as_dict() == dict(bwd_states_dtype="input", bwd_dstates_dtype="input", save_cumsum=True,
                                              save_conv_states=True, save_cb=False, state_passing="auto", zxbcdt_in_place=True,
                                              fast_launch=True, autotune=False, autotune_budget_s=120.0,
                                              autotune_jobs=8, compile_cache=True, cache_dir="")
    with pytest.raises(HelionSettingsError, match="kernels.helion.bwd_states_dtype='bf16'; choose one of input, fp32"):
        HelionSettings(bwd_states_dtype="bf16")
    with pytest.raises(HelionSettingsError, match="save_cumsum=1 must be true or false"):
        HelionSettings(save_cumsum=1)
    s = HelionSettings(bwd_dstates_dtype="fp32", zxbcdt_in_place=False, fast_launch=False)
    be = configure_backend("helion", helion=s.as_dict())
    assert be.settings == s and be.strided_zxbcdt is False and not tuning.runtime_for(be.settings).settings.fast_launch
    op = be.mamba_split_conv1d_scan_combined
    assert isinstance(op, functools.partial) and op.keywords == {"settings": s}
    assert be.mamba_chunk_scan_combined.settings == s and be.RMSNormGated.settings == s
    assert be.settings_dict() == {"backend": "helion", **s.as_dict()}
    assert get_backend("helion") is not be and get_backend("helion").settings == HelionSettings()
    assert configure_backend("helion").strided_zxbcdt is True
    assert get_backend("torch").settings_dict() == {"backend": "torch"}
    with pytest.raises(KernelSwitchError, match="unknown kernels.helion key.*bwd_states"):
        configure_backend("helion", helion={"bwd_states": "fp32"})
    with pytest.raises(KernelSwitchError, match="apply to kernels.backend=helion only"):
        configure_backend("torch", helion={"save_cumsum": False})
