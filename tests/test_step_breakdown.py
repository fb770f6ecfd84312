"""scripts/step_breakdown.py: attribution of profiled work to categories (synthetic events and a CPU run)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nano_hybrid.bench import arms
from nano_hybrid.bench import step_breakdown as sb

REPO = Path(__file__).resolve().parent.parent
MAIN, BWD = 1, 2  # thread ids


def _ev(name, start, end, thread=MAIN, **kw):
    return sb.Ev(name=name, start=start, end=end, thread=thread, **kw)


def _kernel(name, start, end, linked, stream=7, kind="kernel"):
    return sb.Ev(name=name, start=start, end=end, thread=0, linked=linked, device=True, stream=stream, kind=kind)


def synthetic_events():
    """One 1000 ns step: forward ops in module ranges, a backward node mapped through its sequence number,
    AccumulateGrad, the optimizer, an NCCL kernel, two streams overlapping, and a device-side range copy."""
    ev = [
        _ev("nhb::step", 0, 1000),
        _ev("nhb::mamba_mixer", 10, 200),
        _ev("aten::conv1d", 20, 60, corr=11, seq=5),  # records the node with seq 5
        _ev("nhb::mamba_proj", 100, 150),
        _ev("aten::mm", 110, 140, corr=12, seq=6),
        _ev("nano_hybrid::lm_head_loss", 210, 300),
        _ev("ChunkedLinearCrossEntropy", 215, 295, corr=13, seq=7),
        _ev("aten::mm", 220, 240, corr=14),
        _ev("aten::logsumexp", 250, 260, corr=15),
        # backward on its own thread: nodes carry (seq, forward thread)
        _ev("autograd::engine::evaluate_function: ConvolutionBackward0", 400, 500, thread=BWD, seq=5, fwd_thread=MAIN),
        _ev("ConvolutionBackward0", 401, 499, thread=BWD, seq=5, fwd_thread=MAIN),
        _ev("aten::convolution_backward", 405, 495, thread=BWD, corr=21),
        _ev("autograd::engine::evaluate_function: ChunkedLinearCrossEntropyBackward", 505, 560, thread=BWD, seq=7,
            fwd_thread=MAIN),
        _ev("aten::mm", 510, 530, thread=BWD, corr=22),
        _ev("aten::mul", 535, 545, thread=BWD, corr=23),
        _ev("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 565, 580, thread=BWD),
        _ev("aten::add_", 566, 579, thread=BWD, corr=24),
        _ev("nhb::grad_accum", 600, 640),  # finalize_model_grads
        _ev("c10d::allreduce_", 605, 630, corr=25),
        _ev("aten::linalg_vector_norm", 650, 660, corr=26),  # clipping between the optimizer's methods
        _ev("nhb::optimizer", 700, 900),
        _ev("Optimizer.step#AdamW.step", 710, 890),
        _ev("aten::_fused_adamw_", 720, 880, corr=27),
        _ev("aten::add", 950, 960, corr=28),  # after the finalize, no range: optimizer by position
    ]
    ev += [
        _kernel("conv_fwd", 100, 200, 11),  # 100
        _kernel("gemm_proj", 150, 250, 12, stream=8),  # overlaps conv_fwd 150..200 on another stream
        _kernel("nvjet_gemm_head", 250, 290, 14),  # 40 -> lm_head
        _kernel("reduce_lse", 290, 300, 15),  # 10 -> cross_entropy
        _kernel("nhb::mamba_mixer", 100, 300, 0, kind="gpu_user_annotation"),  # not work
        _kernel("conv_bwd", 400, 480, 21),  # 80, backward -> mamba_mixer via seq 5
        _kernel("gemm_bwd_head", 510, 540, 22),  # 30 -> lm_head (backward of the chunked head)
        _kernel("elementwise_mul", 540, 550, 23),  # 10 -> cross_entropy
        _kernel("add_main_grad", 570, 590, 24),  # 20 -> grad_accum
        _kernel("ncclDevKernel_AllReduce", 610, 640, 25, stream=20),  # 30 -> communication
        _kernel("norm_kernel", 650, 660, 26),  # 10 -> optimizer (after finalize)
        _kernel("fused_adamw", 720, 900, 27),  # 180 -> optimizer
        _kernel("add_kernel", 950, 960, 28),  # 10 -> optimizer
        _kernel("late_kernel", 1200, 1300, 28),  # outside the step: ignored
    ]
    return ev


def test_synthetic_attribution_sums_to_the_step():
    r = sb.attribute(synthetic_events(), device=True)
    ms = r["by_category_ns"]
    assert r["steps"] == 1 and r["step_ns"] == 1000
    assert ms["mamba_mixer"] == pytest.approx(75 + 80)  # 50 alone + half of the 50 overlap; backward 80
    assert ms["mamba_proj"] == pytest.approx(75)  # half of the overlap + 50 alone
    assert ms["lm_head"] == pytest.approx(40 + 30) and ms["cross_entropy"] == pytest.approx(10 + 10)
    assert ms["grad_accum"] == pytest.approx(20) and ms["communication"] == pytest.approx(30)
    assert ms["optimizer"] == pytest.approx(10 + 180 + 10)
    assert ms["other"] == 0
    busy = 200 + 80 + 30 + 10 + 20 + 30 + 10 + 180 + 10  # union of the device intervals in the step
    assert r["busy_ns"] == busy and ms["idle"] == pytest.approx(1000 - busy)
    assert sum(ms.values()) == pytest.approx(r["step_ns"])
    assert r["backward_ns"]["mamba_mixer"] == pytest.approx(80) and r["backward_ns"]["lm_head"] == pytest.approx(30)
    # each category's work items by name: they sum to the category (here every category has at most 5 items)
    top = r["top_by_category_ns"]
    assert set(top) == {c for c, v in ms.items() if v and c != "idle"}
    for cat, items in top.items():
        assert sum(items.values()) == pytest.approx(ms[cat]), cat
        assert list(items.values()) == sorted(items.values(), reverse=True)


class _KinetoEvent:
    """A kineto event as torch < 2.12 gives it: no ``activity_type()``."""

    def __init__(self, e):
        self.e = e

    def name(self):
        return self.e.name

    def device_type(self):
        return "DeviceType.CUDA" if self.e.device else "DeviceType.CPU"

    def start_ns(self):
        return self.e.start

    def duration_ns(self):
        return self.e.end - self.e.start

    def start_thread_id(self):
        return self.e.thread

    def correlation_id(self):
        return self.e.corr

    def linked_correlation_id(self):
        return self.e.linked

    def sequence_nr(self):
        return self.e.seq

    def fwd_thread_id(self):
        return self.e.fwd_thread

    def device_resource_id(self):
        return self.e.stream


class _KinetoEventWithType(_KinetoEvent):
    def activity_type(self):
        return self.e.kind


def test_kineto_events_without_activity_type_keep_range_copies_out_of_the_work():
    """Without activity_type() (torch 2.11), the device-side copy of a range is recognised by its name; the
    attribution then equals the one from typed events, and a copy taken for a kernel would change it."""
    ev = synthetic_events()
    untyped = sb.events_from_kineto([_KinetoEvent(e) for e in ev])
    kinds = {e.name: e.kind for e in untyped if e.device}
    assert kinds["nhb::mamba_mixer"] == "gpu_user_annotation" and kinds["conv_fwd"] == "kernel"
    typed = sb.events_from_kineto([_KinetoEventWithType(e) for e in ev])
    assert [e.kind for e in typed] == [e.kind for e in ev]
    want = sb.attribute(synthetic_events(), device=True)
    assert sb.attribute(untyped, device=True) == want
    for e in untyped:
        if e.name == "nhb::mamba_mixer" and e.device:
            e.kind = "kernel"
    assert sb.attribute(untyped, device=True)["by_category_ns"]["other"] > 0


def test_attribution_needs_step_ranges():
    with pytest.raises(ValueError, match="nhb::step"):
        sb.attribute([_ev("aten::mm", 0, 10)], device=False)


def test_module_categories_of_the_tiny_model(mp):
    import torch

    from nano_hybrid.config import compose
    from nano_hybrid.model import build_model

    torch.manual_seed(0)
    model = build_model(compose(["model=tiny", "kernels.backend=torch"]), device="cpu")
    cats = {n: sb.module_category(n, m) for n, m in model.named_modules()}
    assert cats[""] == "cross_entropy" and cats["output_layer"] == "lm_head" and cats["embedding"] == "embedding"
    assert cats["decoder.layers.0.mixer"] == "mamba_mixer" and cats["decoder.layers.0.mixer.in_proj"] == "mamba_proj"
    assert cats["decoder.layers.0.mixer.norm"] is None  # the gated norm is part of the mixer
    assert cats["decoder.layers.0.norm"] == "norms" and cats["decoder.final_norm"] == "norms"
    assert cats["decoder.layers.1.mlp"] == "moe_dispatch" and cats["decoder.layers.1.mlp.router"] == "moe_router"
    assert cats["decoder.layers.1.mlp.experts"] == "expert_gemm"
    assert cats["decoder.layers.1.mlp.shared_experts"] == "shared_expert"
    assert cats["decoder.layers.3.self_attention.core_attention"] == "attn_core"
    assert cats["decoder.layers.3.self_attention.linear_qkv"] == "attn_proj"
    assert cats["decoder.layers.1.self_attention"] is None  # IdentityOp in MoE layers
    assert set(cats.values()) - {None} == set(sb.CATEGORIES) - {"grad_accum", "optimizer", "communication", "other",
                                                                 "idle"}


def test_arm_specs():
    arm = arms.parse_arm("helion:model.lm_head_loss=chunked:optim.fused=true")
    assert arm.backend == "helion" and dict(arm.overrides) == {"model.lm_head_loss": "chunked", "optim.fused": True}
    assert arm.label == "helion+lm_head_loss-chunked+fused-true" and arms.parse_arm("torch").label == "torch"
    for bad in ("helion:model.hidden_size=8", "helion:optim.fused", ":optim.fused=true"):
        with pytest.raises(ValueError):
            arms.parse_arm(bad)
    with pytest.raises(SystemExit):
        sb.parse_args(["--backends", "torch:train.seq_length=8"])


def test_cpu_breakdown_two_arms(tmp_path):
    """model=tiny on CPU, plain and chunked+fused arms: CPU op self time per category sums to the step; the host
    profile (cProfile) of each arm ranks the step's own functions."""
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "step_breakdown.py"),
         "--backends", "torch,torch:model.lm_head_loss=chunked:optim.fused=true", "--warmup", "0", "--steps", "1",
         "--profile-steps", "1", "--host-steps", "2", "--host-top", "5", "--out", str(tmp_path), "model=tiny",
         "train.seq_length=64",
         "train.micro_batch_size=2", "train.global_batch_size=2"],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    stem = "step_breakdown_tiny_torch_vs_torch+lm_head_loss-chunked+fused-true"
    d = json.loads((tmp_path / f"{stem}.json").read_text())
    assert (tmp_path / f"{stem}.png").stat().st_size > 10_000 and (tmp_path / f"{stem}.md").exists()
    assert d["arms"] == ["torch", "torch+lm_head_loss-chunked+fused-true"]
    for lab in d["arms"]:
        a = d["per_arm"][lab]
        cats = a["by_category_ms"]
        assert set(cats) == set(d["categories"])
        assert sum(cats.values()) == pytest.approx(a["profiled_step_ms"], rel=1e-6)
        for c in ("mamba_mixer", "mamba_proj", "attn_core", "attn_proj", "moe_router", "moe_dispatch", "expert_gemm",
                  "shared_expert", "norms", "lm_head", "cross_entropy", "grad_accum", "optimizer"):
            assert cats[c] > 0, (lab, c)
        for c in ("mamba_mixer", "expert_gemm", "lm_head", "attn_proj"):  # backward reached through sequence numbers
            assert a["backward_ms"].get(c, 0) > 0, (lab, c)
        assert cats["other"] < 0.05 * a["profiled_step_ms"], a["other_top_ms"]
        assert len(a["losses"]) == 1 and a["losses"][0] > 0
        h = a["host_profile"]
        assert h["steps"] == 2 and len(h["top_own"]) == len(h["top_cumulative"]) == 5
        cum = [x["cumulative_ms"] for x in h["top_cumulative"]]
        assert cum == sorted(cum, reverse=True) and cum[0] <= h["wall_ms_per_step"] * 1.01
        # the training step itself is among the largest cumulative entries, called once per step, under its own path
        step, = [x for x in h["top_cumulative"] if x["function"].startswith("nano_hybrid/trainer.py:")
                 and x["function"].endswith("(train_step)")]
        assert step["calls_per_step"] == 1
        assert step["cumulative_ms"] > 0.5 * h["wall_ms_per_step"]
    assert "Host (Python) time of `torch`, 2 steps under cProfile" in (tmp_path / f"{stem}.md").read_text()
    assert d["per_arm"]["torch+lm_head_loss-chunked+fused-true"]["arm"] == {
        "backend": "torch", "model.lm_head_loss": "chunked", "optim.fused": True}


def test_a_shared_correlation_id_goes_to_the_launch_that_precedes_the_kernel():
    """One correlation id can name several CPU events (kineto links a kernel to its launch call or to its CPU op, and
    counts the two ids apart). Each launch call gives one kernel, an op any number; a runtime call that launches
    nothing (an occupancy query) is never the launcher."""
    ev = [
        _ev("nhb::step", 0, 1000),
        _ev("nhb::moe_router", 100, 200),
        _ev("aten::ones_like", 110, 130),
        _ev("cudaLaunchKernel", 115, 120, corr=50),  # launches the fill kernel
        _ev("aten::topk", 150, 190),
        _ev("cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags", 155, 156, corr=60),
        _ev("aten::sigmoid", 160, 180, corr=70),  # an op whose id equals the launch call of the projection below
        _ev("nhb::mamba_proj", 90, 99),
        _ev("cudaLaunchKernel", 92, 94, corr=70),  # launches the projection's kernel, which runs late
        _ev("nhb::shared_expert", 290, 330),
        _ev("aten::mm", 300, 320, corr=60),
        _ev("nhb::optimizer", 700, 900),
        _ev("aten::_fused_adamw_", 710, 880, corr=50),  # linked by its op's id, equal to the fill's launch call
        _kernel("fill", 130, 140, 50),  # 10 -> moe_router (the launch call before it)
        _kernel("late_proj", 185, 195, 70),  # 10 -> mamba_proj (its launch call, not the op started after it)
        _kernel("gemm", 400, 450, 60),  # 50 -> shared_expert (never the occupancy query)
        _kernel("fused_adam", 730, 850, 50),  # 120 -> optimizer (the launch call of id 50 gave the fill)
    ]
    ms = sb.attribute(ev, device=True)["by_category_ns"]
    assert ms["moe_router"] == pytest.approx(10)
    assert ms["mamba_proj"] == pytest.approx(10)
    assert ms["shared_expert"] == pytest.approx(50)
    assert ms["optimizer"] == pytest.approx(120)
    assert ms["other"] == 0
