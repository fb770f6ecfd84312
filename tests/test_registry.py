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


def test_helion_settings_travel_with_the_backend():
    """HelionSettings are typed and validated, bound into the helion backend's fused op, recorded by settings_dict();
    the fast-launch setting reaches the tuning module; bad keys / values and settings for another backend are one
    KernelSwitchError each."""
    import functools

    from kernels import tuning
    from kernels.registry import KernelSwitchError, configure_backend, get_backend
    from kernels.settings import HelionSettings, HelionSettingsError

    assert HelionSettings().as_dict() == dict(bwd_states_dtype="input", bwd_dstates_dtype="input", save_cumsum=True,
                                              zxbcdt_in_place=True, fast_launch=True, ssd_fwd="chunked")
    with pytest.raises(HelionSettingsError, match="kernels.helion.bwd_states_dtype='bf16'; choose one of input, fp32"):
        HelionSettings(bwd_states_dtype="bf16")
    with pytest.raises(HelionSettingsError, match="save_cumsum=1 must be true or false"):
        HelionSettings(save_cumsum=1)
    with pytest.raises(HelionSettingsError, match="kernels.helion.ssd_fwd='one'; choose one of chunked, fused"):
        HelionSettings(ssd_fwd="one")
    assert HelionSettings.from_mapping({"ssd_fwd": "fused"}).ssd_fwd == "fused"
    s = HelionSettings(bwd_dstates_dtype="fp32", zxbcdt_in_place=False, fast_launch=False)
    try:
        be = configure_backend("helion", helion=s.as_dict())
        assert be.settings == s and be.strided_zxbcdt is False and not tuning.fast_launch_enabled()
        op = be.mamba_split_conv1d_scan_combined
        assert isinstance(op, functools.partial) and op.keywords == {"settings": s}
        assert be.settings_dict() == {"backend": "helion", **s.as_dict()}
        assert get_backend("helion") is not be and get_backend("helion").settings == HelionSettings()
        assert configure_backend("helion").strided_zxbcdt is True and tuning.fast_launch_enabled()
    finally:
        tuning.set_fast_launch(True)
    assert get_backend("torch").settings_dict() == {"backend": "torch"}
    with pytest.raises(KernelSwitchError, match="unknown kernels.helion key.*bwd_states"):
        configure_backend("helion", helion={"bwd_states": "fp32"})
    with pytest.raises(KernelSwitchError, match="apply to kernels.backend=helion only"):
        configure_backend("torch", helion={"save_cumsum": False})
