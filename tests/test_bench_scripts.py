"""CPU tests of the benchmark / A-B scripts: statistics, argument parsing, kernel tables, JSON schema,
and tiny CPU runs (torch backend, A-vs-A)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from nano_hybrid.bench import ab_step_time as ab
from nano_hybrid.bench import arms, environment, profiling, reporting, stats, training
from nano_hybrid.bench import bench_kernels as bk
from nano_hybrid.bench import bench_layers as blay
from nano_hybrid.bench import mixer as mx
from nano_hybrid.bench import run_summary as rs
from side_by_side import side_by_side

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"



# ---------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------
def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    for n in (1, 2, 5, 10, 101):
        xs = [rng.gauss(10, 3) for _ in range(n)]
        for q in (0, 10, 50, 90, 100):
            assert stats.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def test_median_p90_on_known_data():
    xs = list(range(1, 11))  # 1..10
    assert stats.median(xs) == 5.5
    assert stats.percentile(xs, 90) == pytest.approx(9.1)
    s = stats.summarize(xs)
    assert s["n"] == 10 and s["min"] == 1 and s["max"] == 10 and s["mean"] == 5.5


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")]])
def test_stats_reject_bad_samples(bad):
    with pytest.raises(ValueError):
        stats.median(bad)


def test_percentile_rejects_bad_q():
    with pytest.raises(ValueError, match="percentile"):
        stats.percentile([1.0], 101)


def test_bootstrap_ci_covers_true_ratio_and_excludes_one():
    rng = random.Random(0)
    a = [10.0 + rng.gauss(0, 0.2) for _ in range(60)]  # baseline
    b = [8.0 + rng.gauss(0, 0.2) for _ in range(60)]  # 1.25x faster
    point, lo, hi = stats.bootstrap_ratio_ci(a, b, n_boot=1000, seed=1)
    assert lo < point < hi
    assert lo < 1.25 < hi
    assert lo > 1.15  # clearly excludes 1.0
    assert hi - lo < 0.1


def test_bootstrap_ci_a_vs_a_contains_one():
    rng = random.Random(5)
    a = [5.0 + rng.gauss(0, 0.3) for _ in range(50)]
    b = [5.0 + rng.gauss(0, 0.3) for _ in range(50)]
    point, lo, hi = stats.bootstrap_ratio_ci(a, b, n_boot=1000, seed=2)
    assert lo < 1.0 < hi
    assert abs(point - 1.0) < 0.05


def test_bootstrap_is_seeded_and_validates():
    a, b = [1.0, 2.0, 3.0], [1.5, 2.5, 3.5]
    assert stats.bootstrap_ratio_ci(a, b, n_boot=200, seed=7) == stats.bootstrap_ratio_ci(a, b, n_boot=200, seed=7)
    with pytest.raises(ValueError, match="n_boot"):
        stats.bootstrap_ratio_ci(a, b, n_boot=10)
    with pytest.raises(ValueError, match="positive"):
        stats.bootstrap_ratio_ci(a, [0.0, 0.0], n_boot=200)
    r = stats.ratio_summary(a, b, n_boot=200)
    assert set(r) == {"speedup", "ci_lo", "ci_hi", "ci_level"} and r["ci_level"] == 0.95


def test_ratio_of_means_steady_where_the_medians_of_two_modes_jump():
    """Two arms of the same two-mode step (1.00 and 1.03) that drew the modes 5:6 and 6:5: the medians sit in
    different modes (ratio 1.03), the means differ by the one step that changed mode (ratio 11.18 / 11.15)."""
    a = [1.0] * 5 + [1.03] * 6
    b = [1.0] * 6 + [1.03] * 5
    assert stats.ratio_summary(a, b, n_boot=200)["speedup"] == pytest.approx(1.03)
    r = stats.ratio_summary(a, b, n_boot=200, stat=stats.mean)
    assert r["speedup"] == pytest.approx(sum(a) / sum(b)) and r["speedup"] < 1.003
    assert r["ci_lo"] <= r["speedup"] <= r["ci_hi"]
    with pytest.raises(ValueError, match="samples"):
        stats.mean([])


def test_arm_labels_and_alternation():
    assert stats.arm_labels(["mamba_ssm", "helion", "mamba_ssm"]) == ["mamba_ssm", "helion", "mamba_ssm#2"]
    assert stats.alternating_order(2, 4) == [[0, 1], [1, 0], [0, 1], [1, 0]]
    # every arm runs first equally often over an even number of rounds
    firsts = [o[0] for o in stats.alternating_order(3, 6)]
    assert firsts.count(0) == 3 and firsts.count(2) == 3
    with pytest.raises(ValueError):
        stats.alternating_order(0, 2)


def test_helion_arms_run_the_composed_settings_plus_their_own():
    """An A/B arm's backend is resolved as a training run resolves it: a helion arm runs the composed config's
    kernels.helion settings (here bwd_states_dtype=fp32 and save_conv_states=false given as run overrides) plus its
    own kernels.helion keys; the JSON record names every resolved setting; bad keys and values fail before any work,
    naming the arm."""
    from nano_hybrid.config import ConfigError, compose

    cfg = compose(["model=tiny", "kernels.backend=torch", "kernels.helion.bwd_states_dtype=fp32",
                   "kernels.helion.save_conv_states=false"])
    plain, own, ref = (arms.parse_arm(x) for x in ("helion", "helion:kernels.helion.save_cumsum=false", "torch"))
    assert own.label == "helion+save_cumsum-false" and own.overrides == (("kernels.helion.save_cumsum", False),)
    be = arms.arm_backends(cfg, [plain, own, ref, plain])
    assert list(be) == [plain, own, ref]
    assert be[plain].settings.bwd_states_dtype == "fp32" and be[plain].settings.save_cumsum is True
    assert be[own].settings.bwd_states_dtype == "fp32" and be[own].settings.save_cumsum is False
    assert be[ref].name == "torch" and be[ref].settings is None
    rec = arms.arm_record(cfg, own)
    assert rec["backend"] == "helion" and rec["kernels.helion.save_cumsum"] is False
    assert rec["kernels.helion"]["bwd_states_dtype"] == "fp32" and rec["kernels.helion"]["save_cumsum"] is False
    assert "kernels.helion" not in arms.arm_record(cfg, ref)
    with pytest.raises(ValueError, match="applies to helion arms only"):
        arms.parse_arm("torch:kernels.helion.fast_launch=false")
    with pytest.raises(ValueError, match="kernels.helion.<bwd_states_dtype|"):
        arms.parse_arm("helion:kernels.helion.no_such_key=1")
    with pytest.raises(ConfigError, match="arm helion\\+bwd_states_dtype-fp8: .*bwd_states_dtype"):
        arms.arm_backends(cfg, [arms.parse_arm("helion:kernels.helion.bwd_states_dtype=fp8")])
    # model.mamba_fused_norm switches in place on any backend; a non-boolean fails at parsing, before any work
    fn = arms.parse_arm("mamba_ssm:model.mamba_fused_norm=true")
    assert fn.label == "mamba_ssm+mamba_fused_norm-true" and fn.overrides == (("model.mamba_fused_norm", True),)
    with pytest.raises(ValueError, match="model.mamba_fused_norm=2 must be true or false"):
        arms.parse_arm("helion:model.mamba_fused_norm=2")


def test_tune_kernels_run_fused_norm_picks_the_training_kernels():
    """tune_kernels with a run's overrides tunes what that run calls: with model.mamba_fused_norm=true the gated
    norm's z kernels and ssd_bwd_dstates instead of the norm module's kernels and ssd_bwd_dz_dstates."""
    from nano_hybrid.bench import tune_kernels as tk

    assert tk.run_fused_norm([]) is False and tk.run_fused_norm(["model=tiny"]) is False
    assert tk.run_fused_norm(["model=tiny", "model.mamba_fused_norm=true"]) is True
    on = set(tk.helion_training_kernels(None, True))
    off = set(tk.helion_training_kernels(None, False))
    assert on - off == {"rmsnorm_fwd_z", "rmsnorm_bwd_z", "ssd_bwd_dstates"}
    assert off - on == {"rmsnorm_fwd", "rmsnorm_bwd", "ssd_bwd_dz_dstates"}


def test_gpu_slug():
    assert environment.gpu_slug("NVIDIA H200") == "h200"
    assert environment.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert environment.gpu_slug("NVIDIA B200") == "b200"
    assert environment.gpu_slug(None) == "cpu"


# ---------------------------------------------------------------------------------------------
# kernel tables from a (synthetic) chrome trace
# ---------------------------------------------------------------------------------------------
def _synthetic_trace(tmp_path: Path, iters: int, drop: str | None = None) -> Path:
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "dur": 999.0}]  # host events are ignored
    for _ in range(iters):
        for k, calls in profiling.MAMBA_SSM_EXPECTED_KERNELS.items():
            if k == drop:
                continue
            name = f"void {k}<Ktraits<128, 4>>(ConvParamsBwd)" if k.startswith("causal") else k
            for _ in range(calls):
                events.append({"ph": "X", "cat": "kernel", "name": name, "dur": 10.0})
        events.append({"ph": "X", "cat": "kernel", "name": "void at::native::vectorized_elementwise_kernel<4>(...)",
                       "dur": 5.0})
    p = tmp_path / "trace.json"
    p.write_text(json.dumps({"traceEvents": events}))
    return p


def test_kernel_table_and_baseline_check(tmp_path):
    iters = 3
    table = profiling.kernel_table(profiling.load_trace_events(_synthetic_trace(tmp_path, iters)), iters)
    n_calls = sum(profiling.MAMBA_SSM_EXPECTED_KERNELS.values())
    assert table["total_us_per_iter"] == pytest.approx(10.0 * n_calls + 5.0)
    assert sum(r["share"] for r in table["rows"]) == pytest.approx(1.0)
    rows = {r["kernel"]: r for r in table["rows"]}
    assert rows["causal_conv1d_channellast_fwd_kernel"]["calls_per_iter"] == 2
    assert rows["causal_conv1d_channellast_fwd_kernel"]["category"] == "ssd"
    assert rows["_layer_norm_bwd_kernel"]["category"] == "norm"
    assert rows["at::native::vectorized_elementwise_kernel"]["category"] == "other"
    assert table["by_category"]["norm"] == pytest.approx(20.0)
    chk = profiling.check_expected_kernels(table)
    assert chk["matches"] and chk["extra_kernels"] == ["at::native::vectorized_elementwise_kernel"]


def test_baseline_check_reports_missing_kernel(tmp_path):
    table = profiling.kernel_table(profiling.load_trace_events(_synthetic_trace(tmp_path, 2, drop="_chunk_scan_bwd_dcb_kernel")), 2)
    chk = profiling.check_expected_kernels(table)
    assert not chk["matches"] and chk["missing"] == ["_chunk_scan_bwd_dcb_kernel"]


def test_short_kernel_name():
    assert profiling.short_kernel_name("void causal_conv1d_channellast_fwd_kernel<Ktraits<128, 4, true>>(ConvParamsBase)") \
        == "causal_conv1d_channellast_fwd_kernel"
    assert profiling.short_kernel_name("_chunk_scan_fwd_kernel") == "_chunk_scan_fwd_kernel"
    # aten kernels in an anonymous namespace keep their own name (not just "at::native::")
    assert profiling.short_kernel_name("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, "
                                "float>(int, float, c10::BFloat16 const*)") == "at::native::vectorized_layer_norm_kernel"


def test_write_results_schema(tmp_path):
    jp, mp = reporting.write_results(tmp_path / "o", "x", {"a": 1, "p": Path("/q")}, "# hi")
    d = json.loads(jp.read_text())
    assert d == {"schema_version": reporting.SCHEMA_VERSION, "a": 1, "p": "/q"}
    assert mp.read_text() == "# hi\n"


# ---------------------------------------------------------------------------------------------
# bench_kernels.py
# ---------------------------------------------------------------------------------------------


def test_bench_kernels_shapes_match_architecture_doc():
    s = mx.SHAPES["nano"]
    assert (s.zxbcdt_dim, s.conv_dim, s.d_inner, s.group_size) == (10304, 6144, 4096, 512)
    t = mx.SHAPES["tp2"]
    assert t.group_size == 512 and t.d_inner == 2048


def test_bench_kernels_args():
    a = bk.parse_args(["--backend", "mamba_ssm", "--compare", "helion"])
    assert (a.backend, a.compare, a.shape, a.dtype) == ("mamba_ssm", "helion", "nano", "bf16")
    assert bk.output_stem(a) == "kernels_mamba_ssm_vs_helion_nano"
    for bad in (["--backend", "torch", "--compare", "torch"], ["--backend", "torch", "--rounds", "0"],
                ["--backend", "torch", "--shape", "huge"], []):
        with pytest.raises(SystemExit):
            bk.parse_args(bad)


def test_bench_kernels_helion_settings_arms(tmp_path):
    """--backend/--compare take kernels.helion.<setting> keys: the arm's label keys its results and names the file;
    the helion op with the states recomputed (save_conv_states=false) gives bitwise the outputs and gradients of the
    default, which keeps them (CPU, interpret)."""
    a = bk.parse_args(["--backend", "helion", "--compare", "helion:kernels.helion.save_conv_states=false"])
    assert (a.backend, a.compare) == ("helion", "helion+save_conv_states-false")
    assert bk.output_stem(a) == "kernels_helion_vs_helion+save_conv_states-false_nano"
    assert arms.op_backend(a.arm_specs[a.compare]).settings.save_conv_states is False
    assert arms.op_backend(a.arm_specs[a.backend]).settings.save_conv_states is True
    with pytest.raises(ValueError, match="only kernels.helion.<setting> and model.mamba_fused_norm keys apply to an op "
                                         "benchmark"):
        arms.parse_op_arm("helion:train.fp8=rowwise")
    with pytest.raises(SystemExit):  # profile_host refuses a bad arm before it needs a GPU
        from nano_hybrid.bench import profile_host

        profile_host.main(["--backends", "mamba_ssm,helion:optim.fused=true"])
    for bad in (["--backend", "helion", "--compare", "helion:optim.fused=true"],
                ["--backend", "torch", "--compare", "torch:kernels.helion.save_cumsum=false"]):
        with pytest.raises(SystemExit):
            bk.parse_args(bad)
    rc = bk.main(["--backend", "helion", "--compare", "helion:kernels.helion.save_conv_states=false", "--shape", "tiny",
                  "--dtype", "fp32", "--rounds", "1", "--iters", "1", "--warmup", "0", "--profile-iters", "0",
                  "--no-control", "--out", str(tmp_path)])
    d = json.loads((tmp_path / "kernels_helion_vs_helion+save_conv_states-false_tiny.json").read_text())
    assert rc == 0 and d["correctness"]["passed"]
    assert max(d["correctness"]["helion+save_conv_states-false_vs_helion"].values()) == 0.0
    assert d["backend_settings"]["helion+save_conv_states-false"]["save_conv_states"] is False
    assert d["backend_settings"]["helion"]["save_conv_states"] is True
    assert d["arm_settings"]["helion+save_conv_states-false"] == {"backend": "helion",
                                                                  "kernels.helion.save_conv_states": False}
    # the chunk-state path each arm took (state_passing=auto: the fused kernel without a GPU)
    assert d["state_passing"] == {"helion": "fused", "helion+save_conv_states-false": "fused"}


def test_bench_kernels_fused_norm_arm(tmp_path):
    """An op-level arm with model.mamba_fused_norm=true runs the mixer rows with the gated norm inside the op (the op
    gets the norm's weight, the norm module is not called): in fp32 the torch reference computes the same expression
    either way, so outputs and gradients agree to fp32 rounding; the JSON names the arm's setting."""
    from types import SimpleNamespace

    import torch

    from kernels.registry import get_backend
    from nano_hybrid.bench import mixer as mx

    torch_be = get_backend("torch")
    seen, normed = [], []

    def op(*args, **kw):
        seen.append(kw.get("rmsnorm_weight") is not None)
        return torch_be.mamba_split_conv1d_scan_combined(*args, **kw)

    class Norm(torch_be.RMSNormGated):
        def forward(self, x, z=None):
            normed.append(1)
            return super().forward(x, z)

    shape = mx.SHAPES["tiny"]
    params = mx.make_params(shape, torch.device("cpu"), torch.float32, seed=0)
    spy = SimpleNamespace(mamba_split_conv1d_scan_combined=op, RMSNormGated=Norm, name="torch", strided_zxbcdt=False)
    for fused in (False, True):
        seen.clear(), normed.clear()
        mx.MixerOp(spy, shape, params, torch.device("cpu"), torch.float32, fused_norm=fused).mixer()
        assert seen == [fused] and len(normed) == (0 if fused else 1)
    rc = bk.main(["--backend", "torch", "--compare", "torch:model.mamba_fused_norm=true", "--shape", "tiny",
                  "--dtype", "fp32", "--rounds", "1", "--iters", "1", "--warmup", "0", "--profile-iters", "0",
                  "--no-control", "--out", str(tmp_path)])
    d = json.loads((tmp_path / "kernels_torch_vs_torch+mamba_fused_norm-true_tiny.json").read_text())
    errs = d["correctness"]["torch+mamba_fused_norm-true_vs_torch"]
    assert rc == 0 and d["correctness"]["passed"] and max(errs.values()) <= 1e-6, errs
    assert d["arm_settings"]["torch+mamba_fused_norm-true"] == {"backend": "torch", "model.mamba_fused_norm": True}


def test_bench_kernels_unknown_backend_fails_clearly(tmp_path):
    from kernels.registry import UnknownBackendError

    with pytest.raises(UnknownBackendError, match="unknown kernel backend"):
        bk.run(bk.parse_args(["--backend", "nope", "--shape", "tiny", "--out", str(tmp_path)]))


def test_bench_kernels_cpu_smoke(tmp_path):
    rc = bk.main(["--backend", "torch", "--shape", "tiny", "--dtype", "fp32", "--rounds", "2", "--iters", "1",
                  "--warmup", "1", "--out", str(tmp_path)])
    assert rc == 0
    d = json.loads((tmp_path / "kernels_torch_tiny.json").read_text())
    assert d["benchmark"] == "bench_kernels" and d["arms"] == ["torch", "torch#2"]
    assert set(d["times_ms"]["torch"]) == set(mx.OPS)
    assert d["times_ms"]["torch"]["mixer_fwdbwd"]["n"] == 2
    assert d["correctness"]["passed"] and max(d["correctness"]["torch_vs_itself"].values()) == 0.0
    ctl = d["ratios"]["control_torch#2_vs_torch"]["mixer_fwdbwd"]
    assert ctl["ci_lo"] <= ctl["speedup"] <= ctl["ci_hi"]
    for k in ("torch", "gpu", "date_utc", "helion", "mamba_ssm", "triton"):
        assert k in d["env"]
    assert d["shape"]["name"] == "tiny"
    assert (tmp_path / "kernels_torch_tiny.md").read_text().startswith("# Mamba-2 mixer op")


# ---------------------------------------------------------------------------------------------
# run_summary.py
# ---------------------------------------------------------------------------------------------


def _write_metrics(d: Path, losses, step_time=0.5):
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "metrics.jsonl", "w") as f:
        for i, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": i, "loss": loss, "step_time_s": step_time + 0.01 * (i % 3),
                                "tokens_per_s_per_gpu": 1000.0, "tflops_per_gpu": 10.0, "mem_gb": 1.0 + i,
                                "backend": "torch", "world_size": 1}) + "\n")


def test_run_summary_and_loss_check(tmp_path):
    ref = [10.0 - 0.1 * i for i in range(50)]
    _write_metrics(tmp_path / "ref", ref)
    _write_metrics(tmp_path / "ok", [x * 1.01 for x in ref])
    _write_metrics(tmp_path / "bad", [x * (1.0 + 0.001 * i) for i, x in enumerate(ref)])  # drifts to ~5%
    s = rs.summarize_run(rs.load_metrics(tmp_path / "ref"), skip=5)
    assert s["steps"] == 50 and s["no_nan"] and s["peak_mem_gb"] == 51.0 and s["timed_from_step"] == 6
    assert rs.main([str(tmp_path / "ok"), "--ref", str(tmp_path / "ref"), "--rtol", "0.02", "--rtol-first", "0.02",
                    "--out", str(tmp_path / "ok.json")]) == 0
    d = json.loads((tmp_path / "ok.json").read_text())
    assert d["passed"] and d["loss_check"]["max_rel_diff"] == pytest.approx(0.01)
    assert rs.main([str(tmp_path / "bad"), "--ref", str(tmp_path / "ref"), "--rtol", "0.02"]) == 1
    # a NaN loss or missing steps fail the check
    _write_metrics(tmp_path / "nan", ref[:10] + [float("nan")] + ref[11:])
    assert rs.main([str(tmp_path / "nan"), "--ref", str(tmp_path / "ref")]) == 1
    _write_metrics(tmp_path / "short", ref[:20])
    c = rs.compare_losses(rs.load_metrics(tmp_path / "short"), rs.load_metrics(tmp_path / "ref"), 50, 0.02, 0.01)
    assert not c["passed"] and len(c["missing_steps"]) == 30


def test_run_summary_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        rs.load_metrics(tmp_path / "nothing")


# ---------------------------------------------------------------------------------------------
# bench_layers.py
# ---------------------------------------------------------------------------------------------

NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"


def test_bench_layers_counts_and_estimate():
    c = blay.pattern_counts(NANO_PATTERN)
    assert c == {"M": 23, "E": 23, "*": 6}
    e = blay.estimate({"M": 10.0, "E": 20.0, "*": 5.0}, c, rest_ms=60.0)
    assert e["total_ms"] == pytest.approx(23 * 10 + 23 * 20 + 6 * 5 + 60)
    assert sum(e["shares"].values()) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no timing"):
        blay.estimate({"M": 1.0}, c, 0.0)
    with pytest.raises(ValueError, match="symbols"):
        blay.pattern_counts("MX")


def test_bench_layers_args():
    a = blay.parse_args(["--backends", "mamba_ssm,helion", "model=nano30b"])
    assert a.backend_list == ["mamba_ssm", "helion"] and a.overrides == ["model=nano30b"]
    assert (a.micro_batch, a.seq) == (2, 8192)
    for bad in (["--backends", "torch,torch"], ["--seq", "0"], ["--bogus"]):
        with pytest.raises(SystemExit):
            blay.parse_args(bad)


def test_bench_layers_cpu_smoke(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPTS / "bench_layers.py"), "--backends", "torch", "--micro-batch", "1",
                        "--seq", "32", "--rounds", "1", "--iters", "1", "--warmup", "0", "--out", str(tmp_path),
                        "model=tiny"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads((tmp_path / "layers_tiny_torch.json").read_text())
    assert d["layer_counts"] == {"M": 2, "E": 2, "*": 1} and d["bench_pattern"] == "M*E"
    assert set(d["times_ms"]) == {"M[torch]", "M[torch#2]", "*", "E", "model"}
    est = d["estimate_full_model"]["torch"]
    assert est["total_ms"] > 0 and set(est["parts_ms"]) == {"mamba", "moe", "attention", "rest"}
    assert "torch#2_vs_torch" in d["ratios"]


# ---------------------------------------------------------------------------------------------
# ab_step_time.py
# ---------------------------------------------------------------------------------------------


def test_ab_args():
    a = ab.parse_args(["--backends", "mamba_ssm,helion,mamba_ssm", "model=tiny", "train.seq_length=64"])
    assert a.arms == ["mamba_ssm", "helion", "mamba_ssm"] and a.overrides == ["model=tiny", "train.seq_length=64"]
    assert ab.total_steps(a) == 3 * (a.warmup + a.blocks * a.block_steps + a.profile_steps)
    for bad in (["--backends", "torch"], ["--block-steps", "2", "--discard", "2"], ["--blocks", "0"], ["--nope"]):
        with pytest.raises(SystemExit):
            ab.parse_args(bad)


def test_replay_iterator_repeats_batches():
    it = training.ReplayIterator([1, 2, 3])
    assert [next(it) for _ in range(5)] == [1, 2, 3, 1, 2]
    it.reset()
    assert next(it) == 1
    with pytest.raises(ValueError):
        training.ReplayIterator([])


def test_set_kernel_backend_swaps_ops_and_keeps_parameters():
    import dataclasses

    import torch

    from kernels.registry import get_backend
    from nano_hybrid.config import compose
    from nano_hybrid.model import build_model
    from nano_hybrid.parallel import destroy_parallel, initialize_parallel

    ref = get_backend("torch")
    calls = {"op": 0, "norm": 0}

    def counting_op(*args, **kw):
        calls["op"] += 1
        return ref.mamba_split_conv1d_scan_combined(*args, **kw)

    class CountingNorm(ref.RMSNormGated):
        def forward(self, x, z=None):
            calls["norm"] += 1
            return super().forward(x, z)

    fake = dataclasses.replace(ref, name="fake", mamba_split_conv1d_scan_combined=counting_op, RMSNormGated=CountingNorm)
    cfg = compose(["model=tiny", "kernels.backend=torch"])
    initialize_parallel(cfg)
    try:
        torch.manual_seed(0)
        model = build_model(cfg, device="cpu")
        b, s = 1, 32
        tokens = torch.randint(0, 256, (b, s))
        pos = torch.arange(s)[None]
        mixers = [m for m in model.modules() if type(m).__name__ == "BackendMambaMixer"]
        weights = [m.norm.weight for m in mixers]
        before = model(tokens, pos, None, labels=tokens).detach()
        assert arms.set_kernel_backend(model, fake) == len(mixers) == 2
        assert all(m.norm.weight is w for m, w in zip(mixers, weights))  # same Parameter objects
        assert all(isinstance(m.norm, CountingNorm) and hasattr(m.norm, "sharded_state_dict") for m in mixers)
        after = model(tokens, pos, None, labels=tokens)
        after.float().mean().backward()
        assert calls == {"op": 2, "norm": 2}
        assert all(w.grad is not None for w in weights)
        torch.testing.assert_close(after.detach(), before)  # same math, same weights
        arms.set_kernel_backend(model, "torch")
        assert all(type(m.norm).__mro__[1] is ref.RMSNormGated for m in mixers)
        model(tokens, pos, None, labels=tokens)
        assert calls == {"op": 2, "norm": 2}  # the fake backend is no longer used
        with pytest.raises(ValueError, match="no Mamba-2 mixers"):
            arms.set_kernel_backend(torch.nn.Linear(2, 2), "torch")
    finally:
        destroy_parallel()


def test_bench_mixer_op_has_the_training_mixer_layouts():
    """bench_kernels' mixer op hands the norm and the fused op tensors in the layouts the model's mixer does:
    zxbcdt is a (b, l, d) view of (l, b, d) memory for a backend that takes strided input and a contiguous copy
    for any other, the norm runs on a contiguous (l, b, d) tensor and gets a contiguous gradient, the op's output
    gradient is a (b, l, d) view of an (l, b, d) tensor (batch 2: with batch 1 both layouts are contiguous)."""
    import dataclasses

    import torch

    from kernels.registry import get_backend
    from nano_hybrid.config import compose
    from nano_hybrid.model import build_model
    from nano_hybrid.parallel import destroy_parallel, initialize_parallel

    ref = get_backend("torch")
    seen = []

    def recording_op(zxbcdt, *args, **kw):
        b, _, d = zxbcdt.shape
        seen.append(("op zxbcdt", zxbcdt.is_contiguous(), zxbcdt.stride() == (d, b * d, 1)))
        y = ref.mamba_split_conv1d_scan_combined(zxbcdt, *args, **kw)
        y.register_hook(lambda g: seen.append(("op dout", g.is_contiguous(), g.transpose(0, 1).is_contiguous())))
        return y

    class RecordingNorm(ref.RMSNormGated):
        def forward(self, x, z=None):
            seen.append(("norm x", x.is_contiguous(), x.shape[1] == 2))
            y = super().forward(x, z)
            y.register_hook(lambda g: seen.append(("norm dy", g.is_contiguous(), g.shape[1] == 2)))
            return y

    fakes = {strided: dataclasses.replace(ref, name="fake", mamba_split_conv1d_scan_combined=recording_op,
                                          RMSNormGated=RecordingNorm, strided_zxbcdt=strided)
             for strided in (False, True)}
    shape = mx.MixerShape(batch=2, seqlen=64, nheads=4, headdim=8, ngroups=2, d_state=16, chunk_size=32)
    bench = {}
    for strided, fake in fakes.items():
        op = mx.MixerOp(fake, shape, mx.make_params(shape, torch.device("cpu"), torch.float32, seed=0),
                        torch.device("cpu"), torch.float32)
        op.mixer_fwdbwd()
        bench[strided] = sorted(seen)
        seen.clear()
    model_seen = {}
    cfg = compose(["model=tiny", "kernels.backend=torch"])
    initialize_parallel(cfg)
    try:
        torch.manual_seed(0)
        model = build_model(cfg, device="cpu")
        mixer = next(m for m in model.modules() if type(m).__name__ == "BackendMambaMixer")
        for strided, fake in fakes.items():
            arms.set_kernel_backend(model, fake)
            y, _ = mixer(torch.randn(64, 2, cfg.model.hidden_size))
            y.sum().backward()
            model_seen[strided] = sorted(seen)
            seen.clear()
    finally:
        destroy_parallel()
    for strided in (False, True):
        assert model_seen[strided] == bench[strided] == [
            ("norm dy", True, True), ("norm x", True, True), ("op dout", False, True),
            ("op zxbcdt", not strided, strided)]


def test_bench_mixer_params_zxbcdt_layouts_hold_the_same_values():
    """make_params' megatron layout (default) stores zxbcdt as an (l, b, d) leaf and hands the op a (b, l, d) view
    of it; the contiguous layout a contiguous (b, l, d) leaf with the same values. The torch backend's outputs and
    gradients (d_zxbcdt in (b, l, d)) agree across the layouts, with the view passed as it is or copied."""
    import dataclasses

    import torch

    from kernels.registry import get_backend

    cpu = torch.device("cpu")
    shape = mx.MixerShape(batch=2, seqlen=64, nheads=4, headdim=8, ngroups=2, d_state=16, chunk_size=32)
    b, l, d = shape.batch, shape.seqlen, shape.zxbcdt_dim
    meg = mx.make_params(shape, cpu, torch.float32, seed=0)
    con = mx.make_params(shape, cpu, torch.float32, seed=0, zxbcdt_layout="contiguous")
    lbd = meg["zxbcdt_lbd"]
    assert lbd.shape == (l, b, d) and lbd.is_contiguous() and lbd.is_leaf and lbd.requires_grad
    assert meg["zxbcdt"].shape == (b, l, d) and meg["zxbcdt"].stride() == (d, b * d, 1)
    assert meg["zxbcdt"].data_ptr() == lbd.data_ptr() and not meg["zxbcdt"].is_leaf
    assert "zxbcdt_lbd" not in con and con["zxbcdt"].is_contiguous() and con["zxbcdt"].is_leaf
    assert con["zxbcdt"].requires_grad and con["zxbcdt"].shape == (b, l, d)
    assert torch.equal(meg["zxbcdt"], con["zxbcdt"]) and bool((con["zxbcdt"] != 0).all())
    with pytest.raises(ValueError, match="zxbcdt_layout"):
        mx.make_params(shape, cpu, torch.float32, seed=0, zxbcdt_layout="lbd")

    ref = get_backend("torch")
    strided = dataclasses.replace(ref, strided_zxbcdt=True)
    outs = {name: mx.MixerOp(be, shape, p, cpu, torch.float32).outputs_and_grads()
            for name, be, p in (("contiguous", ref, con), ("megatron", ref, meg), ("megatron strided", strided, meg))}
    assert lbd.grad is None and con["zxbcdt"].grad is None  # outputs_and_grads leaves no gradients behind
    want = outs["contiguous"]
    assert want["d_zxbcdt"].shape == (b, l, d) and want["d_zxbcdt"].abs().sum() > 0
    for name in ("megatron", "megatron strided"):
        assert outs[name].keys() == want.keys()
        for k, v in outs[name].items():
            assert v.is_contiguous(), (name, k)
            torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6, msg=lambda m, n=name, k=k: f"{n} {k}: {m}")
    # the megatron layout's gradient lands on the (l, b, d) leaf
    op = mx.MixerOp(strided, shape, meg, cpu, torch.float32)
    op.mixer_fwdbwd()
    assert lbd.grad.shape == (l, b, d)
    torch.testing.assert_close(lbd.grad.transpose(0, 1), want["d_zxbcdt"], rtol=1e-5, atol=1e-6)


def test_bench_mixer_op_passes_packed_documents_and_profile_host_takes_grid_shapes():
    """MixerOp's seq_idx reaches the op: with two packed documents the torch backend's output is the op called with
    that seq_idx and differs from one document's. profile_host takes the grid's shapes (a packed one included) and
    refuses an unknown shape before it needs a GPU."""
    import torch

    from kernels.causal_conv1d import docs_seq_idx
    from kernels.registry import get_backend
    from nano_hybrid.bench import profile_host
    from nano_hybrid.errors import EXIT_BAD_INPUT

    cpu, ref = torch.device("cpu"), get_backend("torch")
    shape = mx.MixerShape(batch=2, seqlen=64, nheads=4, headdim=8, ngroups=2, d_state=16, chunk_size=32)
    p = mx.make_params(shape, cpu, torch.float32, seed=0)
    seq = docs_seq_idx(shape.batch, shape.seqlen, shape.seqlen, 2, cpu)
    with torch.no_grad():
        packed = mx.MixerOp(ref, shape, p, cpu, torch.float32, seq_idx=seq).split()
        one = mx.MixerOp(ref, shape, p, cpu, torch.float32).split()
        want = ref.mamba_split_conv1d_scan_combined(
            mx.op_zxbcdt(ref, p), p["conv_w"], p["conv_b"], p["dt_bias"].float(), -torch.exp(p["A_log"].float()),
            D=p["D"], chunk_size=shape.chunk_size, seq_idx=seq, activation="silu", headdim=shape.headdim,
            ngroups=shape.ngroups, norm_before_gate=False)
    assert torch.equal(packed, want)
    half = shape.seqlen // 2  # the first document's outputs are one document's (causal); the second's are not
    torch.testing.assert_close(packed[:, :half], one[:, :half], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(packed[:, half:], one[:, half:], rtol=1e-3, atol=1e-3)
    if not torch.cuda.is_available():
        assert profile_host.main(["--shape", "nano_b2_l8192_docs8"]) == EXIT_BAD_INPUT  # parsed, then no GPU
        assert profile_host.main(["--shape", "nano_b2_l8192_docs8", "--seq-idx", "both"]) == EXIT_BAD_INPUT
    with pytest.raises(SystemExit):
        profile_host.main(["--shape", "nano_b3"])
    with pytest.raises(SystemExit):
        profile_host.main(["--shape", "nano_b2_l8192_docs8", "--seq-idx", "each"])
    per = " [seq_idx per call]"
    assert profile_host.profile_arms("mamba_ssm,helion", "both", 8) == [
        ("mamba_ssm", "mamba_ssm", False), ("mamba_ssm" + per, "mamba_ssm", True),
        ("helion", "helion", False), ("helion" + per, "helion", True)]
    assert profile_host.profile_arms("helion", "per-call", 8) == [("helion" + per, "helion", True)]
    assert profile_host.profile_arms("mamba_ssm,helion", "both", 1) == [  # no packed documents: one way
        ("mamba_ssm", "mamba_ssm", False), ("helion", "helion", False)]


def test_ab_step_time_cpu_a_vs_a_smoke(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPTS / "ab_step_time.py"), "--backends", "torch,torch", "--warmup", "0",
                        "--blocks", "2", "--block-steps", "2", "--profile-steps", "0", "--n-boot", "200",
                        "--out", str(tmp_path), "model=tiny", "train.micro_batch_size=1", "train.global_batch_size=1",
                        "train.seq_length=32", f"run_dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads((tmp_path / "ab_step_time_tiny_torch_vs_torch2.json").read_text())
    assert d["arms"] == ["torch", "torch#2"] and d["world_size"] == 1
    for lab in d["arms"]:
        arm = d["per_arm"][lab]
        assert arm["step_time_s"]["n"] == 2  # 2 blocks x (2 steps - 1 discarded)
        assert arm["tokens_per_s_per_gpu"] > 0 and arm["tflops_per_gpu"] > 0
        assert len(arm["losses"]) == 4 and all(x == x for x in arm["losses"])
    sp = d["speedup_vs_first"]["torch#2_vs_torch"]
    assert sp["ci_lo"] <= sp["speedup"] <= sp["ci_hi"]
    spm = d["speedup_vs_first_mean"]["torch#2_vs_torch"]
    means = [d["per_arm"][lab]["step_time_s"]["mean"] for lab in d["arms"]]
    assert spm["speedup"] == pytest.approx(means[0] / means[1]) and spm["ci_lo"] <= spm["speedup"] <= spm["ci_hi"]
    assert d["config"]["model"] == "tiny" and d["tokens_per_step"] == 32
    assert d["profile"] == {}  # --profile-steps 0
    assert d["process_memory_gb"] is None and all(d["per_arm"][lab]["peak_mem_gb"] is None for lab in d["arms"])
    # one line per arm and round as it finishes, with that round's timed steps (2 steps - 1 discarded)
    rounds = [ln for ln in r.stdout.splitlines() if ln.startswith("round ")]
    assert [ln.split(":")[0] for ln in rounds] == ["round 1/2 torch", "round 1/2 torch#2", "round 2/2 torch#2",
                                                   "round 2/2 torch"]
    assert all(ln.endswith(" ms") and len(ln.split(":")[1].split()) == 2 for ln in rounds)
    # a benchmark saves no checkpoint, so it never needs (or is refused for lack of) free space for one
    ckpt = tmp_path / "run" / "checkpoints"
    assert not (ckpt.exists() and any(ckpt.iterdir()))


def test_ab_step_time_defaults_save_no_checkpoints():
    from nano_hybrid.config import compose

    for defaults in (arms.GPU_DEFAULTS, arms.CPU_DEFAULTS):
        c = compose(defaults)
        assert c.checkpoint.interval == 0 and c.checkpoint.save_on_exit is False


def test_bench_kernels_main_reports_unavailable_backend(tmp_path, capsys):
    assert bk.main(["--backend", "nope", "--shape", "tiny", "--out", str(tmp_path)]) == 2
    assert "unknown kernel backend 'nope'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_cross_stream_overlap_counts_only_other_streams():
    ev = [dict(name="_helion_ssd_bwd_state_passing", ts=0, dur=10, args={"stream": 7}),
          dict(name="ncclDevKernel_AllReduce", ts=5, dur=10, args={"stream": 20}),
          dict(name="gemm_same_stream", ts=2, dur=3, args={"stream": 7}),
          dict(name="_helion_ssd_bwd_state_passing", ts=20, dur=10, args={"stream": 7}),
          dict(name="gemm_early", ts=0, dur=4, args={"stream": 20}),
          dict(name="gemm_late", ts=100, dur=4, args={"stream": 20})]
    r = profiling.cross_stream_overlap(ev, iters=2)
    assert set(r) == {"_helion_ssd_bwd_state_passing"}  # only ssd/norm kernels are reported
    k = r["_helion_ssd_bwd_state_passing"]
    assert k["us_per_iter"] == pytest.approx(10.0)  # 20 us over 2 iterations
    assert k["overlapped_us_per_iter"] == pytest.approx(4.5)  # 4 (gemm_early) + 5 (nccl), halved
    assert k["streams"] == ["7"]
    with pytest.raises(ValueError):
        profiling.cross_stream_overlap(ev, iters=0)


def test_ab_markdown_lists_step_vs_isolated_kernels():
    k = "_helion_ssd_bwd_state_passing"
    res = {"arms": ["a", "b"], "world_size": 1, "env": {"gpu": "X"}, "method": "m",
           "config": {"model": "m", "pattern": "MEM", "micro_batch_size": 1, "global_batch_size": 1,
                      "seq_length": 8, "dtype": "bf16", "data": "mock"},
           "per_arm": {lab: {"step_time_s": {"median": 1.0, "p90": 1.0, "n": 3}, "tokens_per_s_per_gpu": 1.0,
                             "tflops_per_gpu": 1.0} for lab in ("a", "b")},
           "speedup_vs_first": {"b_vs_a": {"speedup": 1.0, "ci_lo": 0.9, "ci_hi": 1.1}},
           "profile": {"b": {"device_ms_per_step": 1.0, "ssd_ms_per_step": 1.0, "norm_ms_per_step": 0.0,
                             "ssd_plus_norm_share_of_step": 0.5,
                             "ssd_norm_kernels": [{"kernel": k, "us_per_iter": 300.0, "category": "ssd"}],
                             "cross_stream_overlap": {k: {"overlapped_us_per_iter": 100.0}}, "streams": ["7", "20"],
                             "isolated_op": {"kernels": [{"kernel": k, "us_per_iter": 40.0}]}}}}
    res["per_arm"]["a"]["peak_mem_gb"] = 10.04
    md0 = ab.markdown(res)  # a record without the ratio of means (and, here, without the arms' means)
    assert next(ln for ln in md0.splitlines() if ln.startswith("| b |")).endswith("| 1.000x [0.900, 1.100] | - | - |")
    res["speedup_vs_first_mean"] = {"b_vs_a": {"speedup": 1.02, "ci_lo": 1.01, "ci_hi": 1.03}}
    for lab in ("a", "b"):
        res["per_arm"][lab]["step_time_s"]["mean"] = 1.0
    md = ab.markdown(res)
    assert "| b | 1000.0 | 1000.0 | 1000.0 | 3 |" in md and "| 1.000x [0.900, 1.100] | 1.020x [1.010, 1.030] | - |" in md
    assert next(ln for ln in md.splitlines() if ln.startswith("| a |")).endswith("| 10.0 |")
    assert next(ln for ln in md.splitlines() if ln.startswith("| b |")).endswith("| - |")  # not measured
    assert "Process (all arms)" not in md  # no process memory recorded (CPU)
    res["process_memory_gb"] = {"reserved_max": 71.31, "outside_allocator_max": 7.82}
    res["env"]["pytorch_cuda_alloc_conf"] = "expandable_segments:True"
    md2 = ab.markdown(res)
    assert ("at most 71.3 GiB reserved by PyTorch's allocator and 7.8 GiB of the device in use outside it "
            "(PYTORCH_CUDA_ALLOC_CONF expandable_segments:True)") in md2
    # 2 Mamba layers in "MEM": per-layer in-step 150, overlapped 50, alone 40
    assert f"| `{k}` | 150.0 | 50.0 | 40.0 |" in md
    assert "2 streams" in md


# ---------------------------------------------------------------------------------------------
# bench_norm_conv --profile
# ---------------------------------------------------------------------------------------------
def test_bench_norm_conv_help_lists_profile_on_cpu():
    r = subprocess.run([sys.executable, str(SCRIPTS / "bench_norm_conv.py"), "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--profile" in r.stdout and "--profile-calls" in r.stdout


def test_bench_norm_conv_profile_summary_and_cpu_skip():
    from nano_hybrid.bench import bench_norm_conv as bnc

    events = [{"name": "void _helion_rmsnorm_gated_bwd_kernel(float*)", "dur": 100.0},
              {"name": "_helion_rmsnorm_dweight_sum_kernel", "dur": 3.0},
              {"name": "void _helion_rmsnorm_gated_bwd_kernel(float*)", "dur": 110.0},
              {"name": "_helion_rmsnorm_dweight_sum_kernel", "dur": 5.0}]
    s = bnc._profile_summary(profiling.kernel_table(events, 2), wall_s=260e-6, n_calls=2)
    assert s["n_calls"] == 2
    assert s["device_us_per_call"] == pytest.approx(109.0)
    assert s["wall_us_per_call"] == pytest.approx(130.0)
    assert s["host_gap_us_per_call"] == pytest.approx(21.0)
    assert [(k["kernel"], k["us_per_call"], k["calls_per_call"]) for k in s["kernels"]] == [
        ("_helion_rmsnorm_gated_bwd_kernel", pytest.approx(105.0), 1.0),
        ("_helion_rmsnorm_dweight_sum_kernel", pytest.approx(4.0), 1.0)]
    import torch

    if not torch.cuda.is_available():
        calls = []
        assert bnc.profile_calls(lambda: calls.append(1), 3) == {"skipped": "needs a CUDA GPU"} and not calls
        assert bnc.main(["--ops", "rmsnorm", "--profile"]) == 2


def test_device_busy_counts_overlap_once_and_idle_gaps():
    # two iterations; kernels [0,10] and [5,12] overlap (busy 12), then a gap to [20,30]
    ev = [{"name": "a", "ts": 0.0, "dur": 10.0}, {"name": "b", "ts": 5.0, "dur": 7.0},
          {"name": "c", "ts": 20.0, "dur": 10.0}]
    r = profiling.device_busy(ev, 2)
    assert r == {"span_us_per_iter": 15.0, "busy_us_per_iter": 11.0, "idle_us_per_iter": 4.0}
    assert profiling.device_busy([{"name": "a", "dur": 3.0}], 1) == {}
    t = profiling.kernel_table(ev, 2)
    assert t["idle_us_per_iter"] == 4.0 and t["total_us_per_iter"] == 13.5


def test_device_gaps_name_the_neighbours_of_the_longest_idle_stretches():
    # a [0, 10), b [50, 60) overlapped by c [55, 155), d [200, 201): idle 40 us after a, 45 us after c (not b,
    # which ended first), nothing between b and c
    ev = [{"ts": 0, "dur": 10, "name": "a"}, {"ts": 50, "dur": 10, "name": "b"}, {"ts": 55, "dur": 100, "name": "c"},
          {"ts": 200, "dur": 1, "name": "d"}]
    assert profiling.device_gaps(ev, min_us=20) == [{"us": 45.0, "after": "c", "before": "d"},
                                             {"us": 40.0, "after": "a", "before": "b"}]
    assert profiling.device_gaps(ev, top=1, min_us=41) == [{"us": 45.0, "after": "c", "before": "d"}]
    assert profiling.device_gaps([], min_us=0) == []


def test_runtime_sync_calls_keep_only_stalling_calls_per_iteration():
    ev = [{"ph": "X", "cat": "cuda_runtime", "name": n, "dur": d} for n, d in
          [("cudaStreamSynchronize", 5), ("cudaLaunchKernel", 7), ("cudaMemcpyAsync", 9), ("cudaMemcpy", 3),
           ("cudaFree", 4), ("cudaStreamSynchronize", 1)]]
    ev.append({"ph": "X", "cat": "cpu_op", "name": "cudaDeviceSynchronize", "dur": 50})  # not a runtime event
    r = profiling.runtime_sync_calls(ev, 2)
    assert r == {"cudaStreamSynchronize": {"calls_per_iter": 1.0, "us_per_iter": 3.0},
                 "cudaMemcpy": {"calls_per_iter": 0.5, "us_per_iter": 1.5},
                 "cudaFree": {"calls_per_iter": 0.5, "us_per_iter": 2.0}}
    with pytest.raises(ValueError):
        profiling.runtime_sync_calls(ev, 0)


def test_smi_summary_numeric_ranges_and_reason_counts():
    fields = ("clocks.sm", "power.draw", "clocks_event_reasons.active")
    r = profiling.smi_summary(["1980, 650.5, 0x0", "1755, 700.0, 0x4", "1830, 690.0, 0x4", "garbled line"], fields)
    assert r["samples"] == 3
    assert r["clocks.sm"] == {"min": 1755.0, "median": 1830.0, "max": 1980.0}
    assert r["power.draw"]["max"] == 700.0 and r["clocks_event_reasons.active"] == {"0x0": 1, "0x4": 2}


def test_shell_scripts_parse_and_gpu_suite_runs_named_stages(tmp_path):
    """Every scripts/*.sh parses (bash -n). gpu_suite.sh refuses an unknown stage before any setup (exit 2), also
    inside a '+' group, and runs known stages in order, each with its log, a row in stages.tsv and a .FAILED file when
    it fails (here: a two-GPU stage on a host without two GPUs); its exit code counts the failed stages. The stages
    of a '+' group run side by side, each with its own log, row and .FAILED file."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    for sh in sorted((root / "scripts").glob("*.sh")):
        r = subprocess.run(["bash", "-n", str(sh)], capture_output=True, text=True)
        assert r.returncode == 0, f"{sh.name}: {r.stderr}"
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "SKIP_SETUP": "1"}
    r = subprocess.run(["bash", "scripts/gpu_suite.sh", "step", "nope"], cwd=root, capture_output=True, text=True,
                       env=env)
    assert r.returncode == 2 and "unknown stage 'nope'" in r.stderr
    assert not (out / "stages.tsv").exists()
    r = subprocess.run(["bash", "scripts/gpu_suite.sh", "parity", "convergence"], cwd=root, capture_output=True,
                       text=True, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    rows = [line.split("\t") for line in (out / "stages.tsv").read_text().splitlines()]
    assert rows[0] == ["stage", "rc", "seconds"] and [row[:2] for row in rows[1:]] == [["parity", "1"], ["convergence", "1"]]
    assert "parity needs 2 GPUs" in (out / "logs" / "parity.log").read_text()
    assert (out / "parity.FAILED").exists() and (out / "convergence.FAILED").exists()
    r = subprocess.run(["bash", "scripts/gpu_suite.sh", "step+nope"], cwd=root, capture_output=True, text=True,
                       env=env)
    assert r.returncode == 2 and "unknown stage 'nope'" in r.stderr
    out2 = tmp_path / "out2"
    r = subprocess.run(["bash", "scripts/gpu_suite.sh", "parity+convergence"], cwd=root, capture_output=True,
                       text=True, env={**env, "OUT": str(out2)})
    assert r.returncode == 2, r.stdout + r.stderr
    rows = [line.split("\t") for line in (out2 / "stages.tsv").read_text().splitlines()]
    assert sorted(row[:2] for row in rows[1:]) == [["convergence", "1"], ["parity", "1"]]
    assert "=== [parity+convergence]" in r.stdout and "--- [parity] rc 1" in r.stdout
    assert "convergence needs 2 GPUs" in (out2 / "logs" / "convergence.log").read_text()
    assert (out2 / "parity.FAILED").exists() and (out2 / "convergence.FAILED").exists()
    # a stage that needs a file names the variable that gives it
    out3 = tmp_path / "out3"
    env3 = {k: v for k, v in env.items() if k != "HELION_NEXT_WHEEL"}
    r = subprocess.run(["bash", "scripts/gpu_suite.sh", "helion_next"], cwd=root, capture_output=True, text=True,
                       env={**env3, "OUT": str(out3)})
    assert r.returncode == 1 and "helion_next needs HELION_NEXT_WHEEL" in (out3 / "logs" / "helion_next.log").read_text()


def test_gpu_suite_ends_its_stages_inside_the_call_limit(tmp_path):
    """With CALL_LIMIT, a stage is stopped (exit 124) in time for its 15 s kill delay and ARCHIVE_MARGIN before the
    call's limit, and the archive is still written; a stage with no time left is not started. Here a 'python3' that
    sleeps 60 s in pytest, under a call with 15 s left for the stage (room for a slow start), then under one that is
    already over."""
    import subprocess
    import time

    root = Path(__file__).resolve().parents[1]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text('#!/usr/bin/env bash\n[ "$2" = pytest ] && sleep 60\nexit 1\n')
    fake.chmod(0o755)
    base = {**os.environ, "SKIP_SETUP": "1", "PATH": f"{bin_dir}:{os.environ['PATH']}", "ARCHIVE_MARGIN": "5"}
    for label, limit, t0_ago in (("stopped", 35, 0), ("not_started", 30, 60)):
        out = tmp_path / label
        env = {**base, "OUT": str(out), "CALL_LIMIT": str(limit), "SUITE_T0": str(int(time.time()) - t0_ago),
               "ARCHIVE": str(tmp_path / f"{label}.tgz")}
        t0 = time.monotonic()
        r = subprocess.run(["bash", "scripts/gpu_suite.sh", "tests"], cwd=root, capture_output=True, text=True,
                           env=env)
        assert time.monotonic() - t0 < 60, r.stdout + r.stderr
        assert r.returncode == 1, r.stdout + r.stderr
        row = (out / "stages.tsv").read_text().splitlines()[1].split("\t")
        assert row[:2] == ["tests", "124"], row
        started = "not started" not in (out / "logs" / "tests.log").read_text()
        assert started == (label == "stopped") and (tmp_path / f"{label}.tgz").exists()
        if label == "stopped":
            assert 1 <= int(row[2]) <= 30, row  # 35 - 5 - 15 = 15 s at most, then TERM
    r = subprocess.run(["bash", "scripts/gpu_suite.sh", "tests"], cwd=root, capture_output=True, text=True,
                       env={**base, "OUT": str(tmp_path / "bad"), "CALL_LIMIT": "585.5"})
    assert r.returncode == 2 and "CALL_LIMIT must be whole seconds" in r.stderr


@pytest.mark.slow
def test_convergence_ab_script_a_vs_a_pair_with_resume(tmp_path):
    """scripts/convergence_ab.sh with BACKENDS="torch torch" (the A-vs-A pair) on CPU: both arms are
    stopped with SIGTERM mid-run, resumed from their checkpoints (RESUME_EXTRA reaching the resumed part only:
    no checkpoint after the last step), land in separate run dirs, and the deterministic CPU runs give
    bitwise-equal losses at every step (compare_runs.py's summary)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OUT": str(tmp_path), "RECIPE": "tiny_cpu", "GPUS": "0", "STOP_AT": "6",
           "BACKENDS": "torch torch", "PYTHON": sys.executable, "RESUME_EXTRA": "checkpoint.save_on_exit=false"}
    r = subprocess.run(["bash", "scripts/convergence_ab.sh", "train.train_iters=12", "optim.warmup_iters=2",
                        "train.log_interval=4"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for arm in ("torch", "torch_b"):
        lines = (tmp_path / f"convergence_{arm}" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines] == list(range(1, 13))
        assert "stopped after" in r.stdout
        part1, part2 = ((tmp_path / "logs" / f"convergence_{arm}_part{i}.log").read_text() for i in (1, 2))
        assert "[checkpoint] saved" in part1 and "[checkpoint] loaded" in part2 and "[checkpoint] saved" not in part2
    diff = json.loads((tmp_path / "compare_convergence" / "summary.json").read_text())["loss_diff"][0]
    assert diff["run"] == "convergence_torch_b" and diff["matching_steps"] == 12
    assert diff["all"]["max_abs_diff"] == 0.0


def test_kernel_counterparts_groups_ratios_and_top10_geomean(tmp_path):
    import math

    from nano_hybrid.bench import kernel_counterparts as kc

    def table(d):
        return {"rows": [{"kernel": k, "us_per_iter": v} for k, v in d.items()]}

    mamba = {k: 100.0 for ks in kc.GROUPS.values() for k in ks}
    helion = {k: 50.0 for ks in kc.GROUPS for k in ks}
    helion["_helion_ssd_bwd_db"] = 700.0  # dc_dcb + db (750 us) replace 4 x 100 us: 0.533x
    res = kc.counterparts(table(mamba), table(helion))
    by = {tuple(r["helion"]): r for r in res["groups"]}
    pair = by[("_helion_ssd_bwd_dc_dcb", "_helion_ssd_bwd_db")]
    assert pair["mamba_us"] == 400.0 and pair["helion_us"] == 750.0 and math.isclose(pair["ratio"], 400 / 750)
    # dx + dt together against dx + ddAcs_stable + cumsum_bwd: 300 / 100
    assert by[("_helion_ssd_bwd_dx", "_helion_ssd_bwd_dt")]["ratio"] == 3.0
    assert res["slower_than_counterpart"] == ["_helion_ssd_bwd_dc_dcb + _helion_ssd_bwd_db"]
    assert not res["missing_groups"]
    # one ratio per top-10 kernel, that of the group replacing it
    ratio_of = {tuple(r["helion"]): r["ratio"] for r in res["groups"]}
    want = [[ratio_of[hks] for hks, mks in kc.GROUPS.items() if k in mks][-1] for k in kc.BASELINE_TOP10]
    assert len(want) == 10 and [t["ratio"] for t in res["top10"]] == want
    assert res["top10_complete"] and math.isclose(res["top10_geomean"], math.exp(sum(map(math.log, want)) / 10))
    # a missing Helion kernel drops its group and is named
    del helion["_helion_ssd_bwd_dt"]
    res2 = kc.counterparts(table(mamba), table(helion))
    assert ["_helion_ssd_bwd_dx", "_helion_ssd_bwd_dt"] in res2["missing_groups"] and not res2["top10_complete"]
    # the CLI on a file without kernel tables stops with one message
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"kernels": {}}))
    assert kc.main([str(p)]) == 2


def test_tune_kernels_isolates_each_pair_in_a_child_with_its_share_of_the_budget():
    """tune_kernels.py with several (kernel, shape) pairs runs one --no-isolate child per pair, so a sticky CUDA
    error in one search cannot end the others; each child gets its share of the budget less its start-up time
    and keeps the write / from-scratch choices."""
    import argparse

    from nano_hybrid import kernel_search as tk

    args = argparse.Namespace(rep_ms=40.0, no_write=True, from_scratch=False)
    shapes = {"nano": dict(b=2), "tp2": dict(b=1)}
    cmds = tk.child_commands(args, tk.pairs_of(["ssd_bwd_dc_dcb", "ssd_bwd_db"], shapes), shapes, per_budget=70.0)
    pairs = [(c[c.index("--kernels") + 1], next(iter(json.loads(c[c.index("--model-dims") + 1])))) for c in cmds]
    assert pairs == [("ssd_bwd_dc_dcb", "nano"), ("ssd_bwd_db", "nano"), ("ssd_bwd_dc_dcb", "tp2"),
                     ("ssd_bwd_db", "tp2")]
    for c in cmds:
        assert c[1].endswith("tune_kernels.py") and "--no-isolate" in c and "--no-write" in c
        assert "--from-scratch" not in c
        assert float(c[c.index("--budget-s") + 1]) == 70.0 - tk.ISOLATE_OVERHEAD_S
    args.no_write, args.from_scratch = False, True
    (c,) = tk.child_commands(args, [("rmsnorm_fwd", "nano")], {"nano": dict(b=2)}, per_budget=5.0)
    assert "--no-write" not in c and "--from-scratch" in c and float(c[c.index("--budget-s") + 1]) == 10.0
    assert "--timing-lock" not in c
    for c in tk.child_commands(args, tk.pairs_of(["rmsnorm_fwd", "conv1d_fwd"], shapes), shapes, per_budget=70.0,
                               timing_lock="/x/lk"):
        assert c[c.index("--timing-lock") + 1] == "/x/lk"


def test_tune_kernels_jobs_share_the_budget(monkeypatch):
    """--jobs N hands each isolated child N pairs' share of the total budget (the wall time stays about the total)
    and never more children than pairs; where the GPU's memory holds fewer searches at once, the share of the rounds
    that takes; --jobs below 1 is refused."""
    from nano_hybrid.bench import tune_kernels as tk

    got = {}
    memory = [None]  # the GPU memory budget: none (no limit)
    monkeypatch.setattr(tk.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tk.tuning, "interpret_mode", lambda: False)
    monkeypatch.setattr(tk, "gpu_memory_budget", lambda: memory[0])
    monkeypatch.setattr(tk, "_run_isolated", lambda args, pairs, shapes, per_budget, jobs, mem_budget: got.update(
        names=list(dict.fromkeys(n for n, _ in pairs)), per_budget=per_budget, jobs=jobs, mem_budget=mem_budget) or 0)
    kernels = "rmsnorm_fwd,conv1d_fwd,conv1d_bwd,rmsnorm_bwd"
    assert tk.main(["--kernels", kernels, "--shapes", "nano", "--budget-s", "400", "--jobs", "2"]) == 0
    assert got == dict(names=kernels.split(","), per_budget=200.0, jobs=2, mem_budget=None)
    memory[0] = int(1.5 * tk.tuner.search_bytes(tk.tuner.SHAPE_PRESETS["nano"]))  # one Nano search at a time
    assert tk.main(["--kernels", kernels, "--shapes", "nano", "--budget-s", "400", "--jobs", "2"]) == 0
    assert got["per_budget"] == 100.0 and got["jobs"] == 2 and got["mem_budget"] == memory[0]
    memory[0] = None
    assert tk.main(["--kernels", kernels, "--shapes", "nano", "--budget-s", "400"]) == 0
    assert got["per_budget"] == 100.0 and got["jobs"] == 1
    assert tk.main(["--kernels", "rmsnorm_fwd,conv1d_fwd", "--shapes", "nano", "--budget-s", "400", "--jobs", "8"]) == 0
    assert got["per_budget"] == 400.0 and got["jobs"] == 2
    with pytest.raises(SystemExit):
        tk.main(["--kernels", kernels, "--jobs", "0"])
    # the default kernels: a run's overrides tune what its training step calls, presets every tunable kernel
    assert tk.main(["model=nano_proxy", "train.seq_length=1024", "--budget-s", "140"]) == 0
    assert got["names"] == sorted(tk.helion_training_kernels()) and got["jobs"] == 1
    # with the run's kernels.helion settings: the split state passing calls its two kernels instead of the fused one
    assert tk.main(["model=nano_proxy", "train.seq_length=1024", "kernels.helion.state_passing=split",
                    "--budget-s", "140"]) == 0
    assert "ssd_state_passing" in got["names"] and "ssd_chunk_state_passing" not in got["names"]
    assert tk.main(["--shapes", "nano", "--budget-s", "140"]) == 0
    assert got["names"] == sorted(tk.tuner.discover_tunable_kernels()) and len(got["names"]) > len(
        tk.helion_training_kernels())


def test_tune_kernels_run_children_at_once_and_in_turn(tmp_path):
    """run_children starts at most ``jobs`` children at once (with 3 jobs the three 1.5 s children overlap; with 1
    each starts after the previous ended), and names the children that fail or outrun their time."""
    from nano_hybrid import kernel_search as tk

    def child(name, seconds=1.5, rc=0):
        code = (f"import sys, time, pathlib; p = pathlib.Path({str(tmp_path)!r}) / {name!r}; "
                f"p.write_text(str(time.time())); time.sleep({seconds}); "
                f"p.write_text(p.read_text() + ' ' + str(time.time())); sys.exit({rc})")
        return [sys.executable, "-c", code]

    def spans(names):
        return [tuple(map(float, (tmp_path / n).read_text().split())) for n in names]

    assert tk.run_children([child(f"a{i}") for i in range(3)], jobs=3, timeout_s=60) == []
    s = spans(["a0", "a1", "a2"])
    assert max(b for b, _ in s) < min(e for _, e in s)  # all three ran at the same time
    assert tk.run_children([child(f"b{i}", 0.3) for i in range(3)], jobs=1, timeout_s=60) == []
    s = sorted(spans(["b0", "b1", "b2"]))
    assert all(s[i][1] <= s[i + 1][0] for i in range(2))  # one after the other
    bad = tk.run_children([child("c0", 0.1, rc=3), child("c1", 30)], jobs=2, timeout_s=3)
    assert len(bad) == 2 and bad[0].endswith("(exit 3)") and bad[1].endswith("(timeout)")
    # with a log folder: each child's output in its own file, named in its failure; $OUT points there
    logs = tmp_path / "logs"
    logs.mkdir()
    said = []
    code = "import os, sys; print('out is', os.environ['OUT']); sys.exit(int(sys.argv[1]))"
    bad = tk.run_children([[sys.executable, "-c", code, "0"], [sys.executable, "-c", code, "4"]], jobs=2,
                          timeout_s=60, log_dir=logs, say=said.append)
    assert bad == [f"{sys.executable} -c {code} 4; log {logs / '1.log'} (exit 4)"] and len(said) == 1
    assert [(logs / f"{i}.log").read_text() for i in (0, 1)] == [f"out is {logs}\n"] * 2



def test_run_children_keep_their_searches_within_the_gpu_memory(tmp_path):
    """Children whose searches' estimated GPU memory (``kernels.tuner.search_bytes`` at their --model-dims) would pass
    the budget wait: with room for two, the first two run side by side, a child larger than the whole budget waits
    until it can run alone, and the small one queued behind it starts first, as soon as there is room; one line per
    shape says how many of its searches run at once. ``admission_rounds`` counts the rounds this takes."""
    from kernels.tuner import search_bytes
    from nano_hybrid import kernel_search as tk

    small, big = dict(b=1, l=128, h=1, p=1, g=1, n=1, c=128), dict(b=1, l=1280, h=1, p=1, g=1, n=1, c=128)
    unit = search_bytes(small)
    assert search_bytes(big) > 2 * unit and tk.child_bytes(["python"]) == 0

    def child(name, dims, wait_for=None, then_s=0.2):
        # a0 and a1 each wait (at most 30 s) until the other has started: they end only after both ran at once; a1
        # then runs on for 5 s more, so a0's end leaves room for one small search but not for the large one
        code = (f"import time, pathlib; d = pathlib.Path({str(tmp_path)!r}); p = d / {name!r}; "
                f"p.write_text(str(time.time())); t = time.time()\n"
                f"while {wait_for!r} and not (d / str({wait_for!r})).exists() and time.time() - t < 30: "
                f"time.sleep(0.05)\n"
                f"time.sleep({then_s}); p.write_text(p.read_text() + ' ' + str(time.time()))")
        return [sys.executable, "-c", code, "--kernels", "k", "--model-dims", json.dumps({name: dims})]

    def span(name):
        return tuple(map(float, (tmp_path / name).read_text().split()))

    said = []
    cmds = [child("a0", small, "a1"), child("a1", small, "a0", then_s=5.0), child("huge", big), child("a2", small)]
    assert tk.run_children(cmds, jobs=4, timeout_s=60, mem_budget=2 * unit, say=said.append) == []
    s = {n: span(n) for n in ("a0", "a1", "a2", "huge")}
    assert max(s["a0"][0], s["a1"][0]) < min(s["a0"][1], s["a1"][1])  # the first two side by side
    assert s["a0"][1] <= s["a2"][0] < s["huge"][0]  # a2 waits for room, then skips ahead of huge
    assert all(e <= s["huge"][0] for _, e in (s["a0"], s["a1"], s["a2"]))  # the oversized one alone
    assert [(line.split(" hold ")[0], line.split(": ")[1].split(" at a time")[0]) for line in said] == [
        ("   searches at a0", "2"), ("   searches at a1", "2"), ("   searches at a2", "2"), ("   searches at huge", "1")]
    sizes = [unit, unit, search_bytes(big), unit]
    assert tk.admission_rounds(sizes, jobs=4, budget=2 * unit) == 3  # a0 + a1, a2, huge
    assert tk.admission_rounds(sizes, jobs=4, budget=None) == 1 and tk.admission_rounds(sizes, 1, None) == 4
    assert tk.admission_rounds([], jobs=4, budget=unit) == 0


def test_search_bytes_stays_above_the_measured_search_peaks():
    """The estimate that admits searches side by side is above every single search's peak measured on an H100 (two
    searches admitted on a lower estimate run out of memory together), and one search at 1 x 262144 is admitted
    alone within 85% of an 80 GiB GPU."""
    from kernels.tuner import SEARCH_PEAKS_SM90, search_bytes
    from nano_hybrid import kernel_search as ks

    for kernel, dims, peak in SEARCH_PEAKS_SM90:
        assert search_bytes(dims) > peak, (kernel, dims)
    long = dict(b=1, l=262144, h=64, p=64, g=8, n=128, c=128)
    assert ks.searches_at_once(search_bytes(long), 12, int(0.85 * 80 * 2**30)) == 1


def test_tune_kernels_takes_a_runs_overrides():
    """tune_kernels.py with a run's overrides tunes the mixer dims one rank of that run calls (per tensor-parallel
    rank heads and groups, the micro-batch, the sequence); presets still work; a split that does not divide is
    refused naming the keys."""
    from nano_hybrid.bench import tune_kernels as tk

    got = tk.resolve_shapes(["model=nano30b_slice", "train.micro_batch_size=2",
                             "parallel.tensor_model_parallel_size=2"], None, None)
    ((name, dims),) = got.items()
    assert dims == dict(b=2, l=dims["l"], h=32, p=64, g=4, n=128, c=128, w=4) and name.startswith("run_b2_")
    assert tk.resolve_shapes([], "nano,nano_b1", None) == {"nano": tk.tuner.SHAPE_PRESETS["nano"],
                                                            "nano_b1": tk.tuner.SHAPE_PRESETS["nano_b1"]}
    with pytest.raises(ValueError, match="mamba_num_groups=8 is not divisible by parallel.tensor_model_parallel_size=16"):
        tk.resolve_shapes(["model=nano30b_slice", "parallel.tensor_model_parallel_size=16"], None, None)
    with pytest.raises(ValueError, match="not both"):
        tk.resolve_shapes(["model=nano30b_slice"], "nano", None)


def test_bench_layers_backend_options():
    import dataclasses

    from nano_hybrid.config import ConfigError, compose

    cfg = compose(["model=tiny", "kernels.helion.bwd_states_dtype=fp32", "kernels.helion.save_conv_states=false"])
    be, fused = blay._backend("torch:zxbcdt_copy", cfg)
    assert be.name == "torch" and be.strided_zxbcdt is False and fused is False
    assert dataclasses.replace(blay._backend("torch", cfg)[0], strided_zxbcdt=True).strided_zxbcdt
    # helion entries run the composed kernels.helion settings plus their own keys
    assert blay._backend("helion", cfg)[0].settings.bwd_states_dtype == "fp32"
    own, fused = blay._backend("helion:kernels.helion.save_cumsum=false:model.mamba_fused_norm=true", cfg)
    assert own.settings.bwd_states_dtype == "fp32" and own.settings.save_cumsum is False and fused is True
    # the composed model.mamba_fused_norm is an arm's default
    on = compose(["model=tiny", "model.mamba_fused_norm=true"])
    assert blay._backend("torch", on)[1] is True and blay._backend("torch:model.mamba_fused_norm=false", on)[1] is False
    with pytest.raises(ConfigError, match="bogus"):
        blay._backend("torch:bogus", cfg)
    with pytest.raises(ConfigError, match="only kernels.helion.<setting> and model.mamba_fused_norm keys apply .*zxbcdt_copy"):
        blay._backend("helion:optim.fused=true", cfg)
    with pytest.raises(ConfigError, match="must be true or false"):
        blay._backend("torch:model.mamba_fused_norm=2", cfg)


def test_grad_match_compare_reports_error_cosine_and_scale_per_group():
    import torch

    from nano_hybrid.bench import grad_match as gm

    ref = {"decoder.layers.0.mixer.dt_bias": torch.tensor([3.0, 4.0]),
           "decoder.layers.0.mixer.in_proj.weight": torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
           "decoder.layers.1.self_attention.linear_qkv.weight": torch.tensor([1.0, 2.0])}
    g = {"decoder.layers.0.mixer.dt_bias": 1.1 * ref["decoder.layers.0.mixer.dt_bias"],  # 10% too large
         "decoder.layers.0.mixer.in_proj.weight": torch.tensor([[1.0, 0.5], [0.0, 1.0]]),  # orthogonal error
         "decoder.layers.1.self_attention.linear_qkv.weight": ref["decoder.layers.1.self_attention.linear_qkv.weight"]}
    c = gm.compare(g, ref)
    dt = c["params"]["decoder.layers.0.mixer.dt_bias"]
    assert dt["scale"] == pytest.approx(1.1) and dt["rel_err"] == pytest.approx(0.1) and dt["cos"] == pytest.approx(1.0)
    ip = c["groups"]["mixer.in_proj"]
    assert ip["scale"] == pytest.approx(1.0) and ip["rel_err"] == pytest.approx(0.5 / 2 ** 0.5)
    assert c["groups"]["attention"] == {"params": 1, "worst_rel_err": 0.0, "worst_param": None, "rel_err": 0.0,
                                        "scale": 1.0}
    assert gm.group_of("decoder.layers.3.mixer.norm.weight") == "mixer.norm"
    assert gm.group_of("decoder.layers.3.norm.weight") == "layer_norms"
    assert gm.group_of("decoder.layers.4.mlp.experts.weight1") == "experts"


@pytest.mark.slow
def test_grad_match_torch_a_vs_a_is_exact_on_cpu(tmp_path):
    """The whole script on CPU (model=tiny; its own process, as users run it): a trained probe state, two torch
    arms, bitwise-equal gradients."""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "scripts/grad_match.py", "--backends", "torch,torch", "--train-backend", "torch",
                        "--train-steps", "2", "--batches", "1", "--out", str(tmp_path), "model=tiny",
                        "train.seq_length=64", "train.micro_batch_size=2", "train.global_batch_size=2",
                        "train.train_iters=10", "optim.warmup_iters=1"], cwd=root, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "grad_match_torch_vs_torch.json").read_text())
    assert res["train_steps"] == 2 and len(res["train_loss"]) == 2
    assert res["probe_loss"]["torch"] == res["probe_loss"]["torch#2"]
    groups = res["vs"]["torch#2 vs torch"]
    assert {"mixer.A_log", "mixer.in_proj", "attention", "experts", "embedding"} <= set(groups)
    assert all(g["rel_err"] == 0.0 and g["scale"] == 1.0 for g in groups.values())


def test_fast_modules_markdown_reports_power_state_and_diag():
    from nano_hybrid.bench import check_fast_modules_gpu as cfm

    timing = {"median_ms": 11.5, "peak_mem_gb": 1.5, "target_ms": 11.0,
              "gpu_during_rounds": {"samples": 3, "clocks.sm": {"min": 1440.0, "median": 1680.0, "max": 1980.0},
                                    "power.draw": {"min": 160.0, "median": 420.0, "max": 688.6},
                                    "clocks_event_reasons.active": {"0x4": 2, "0x0": 1}},
              "diag": {"round_ms_median": 11.508, "per_call_ms_median": 11.546, "iters": 10, "rounds": 9,
                       "profiled_round_event_ms_per_iter": 11.27, "stalling_runtime_calls": {},
                       "profiled_round": {"total_us_per_iter": 10989.0, "span_us_per_iter": 11226.0,
                                          "busy_us_per_iter": 10989.0, "idle_us_per_iter": 238.0}}}
    r = {"gpu": "H200", "date": "d", "versions": {"torch": "t", "triton": "tr", "megatron_core": "m"}, "numerics": {},
         "timing": {"shapes": {"micro_batch": 2, "seq": 8192}, "attention_sdpa": timing,
                    "attention_unfused": {"median_ms": 133.5, "peak_mem_gb": 72.9}}}
    md = cfm._markdown(r)
    assert "| attention | sdpa | 11.50 | 1.5 | 11.0 |" in md and "| attention | unfused | 133.50 | 72.9 |  |" in md
    assert "1440.0 / 1680.0 / 1980.0 MHz, power max 688.6 W" in md and "{'0x4': 2, '0x0': 1}" in md
    assert "round timing 11.508 ms per step, per-call events 11.546 ms" in md
    assert "kernels 10989 us, span 11226 us, idle 238 us per step; stalling runtime calls none" in md
    assert "attention_unfused:" not in md  # nothing to say about a layer timed without sampling or --diag


def test_grad_match_bad_backend_is_one_error_line_before_work(capsys):
    from nano_hybrid.bench import grad_match as gm

    assert gm.main(["--backends", "torch,nope", "--train-backend", "torch", "model=tiny"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["error: unknown kernel backend 'nope'; choose one of: torch, mamba_ssm, helion"]


def test_arm_settings_are_checked_before_any_work():
    """check_arms checks each arm's switchable settings as apply_arm will apply them: without an optimizer
    (--fwd-bwd-only) an optim.fused arm is refused, and so is an unknown fp8 recipe; one ConfigError naming the arm."""
    from nano_hybrid.bench.arms import check_arms, parse_arm
    from nano_hybrid.config import ConfigError, compose

    cfg = compose(["model=tiny"])
    fused = [parse_arm("torch"), parse_arm("torch:optim.fused=true")]
    check_arms(cfg, fused, with_optimizer=True)
    with pytest.raises(ConfigError, match=r"^arm torch\+fused-true: optim.fused needs the optimizer step"):
        check_arms(cfg, fused, with_optimizer=False)
    check_arms(cfg, [parse_arm("torch")], with_optimizer=False)
    with pytest.raises(ConfigError, match=r"^arm torch\+fp8-nope: train.fp8='nope'; choose one of"):
        check_arms(cfg, [parse_arm("torch:train.fp8=nope")], with_optimizer=True)


def test_ab_step_time_fwd_bwd_only_builds_no_optimizer_and_leaves_weights(tmp_path):
    """--fwd-bwd-only: no optimizer, no weight update, so replays of the same batch give the same loss up to the
    MoE router's expert-bias update (made in finalize_model_grads, not by the optimizer); the first loss is the
    first loss of a full-step run (same weights, same batch); an optim.fused arm is refused."""
    common = ["--warmup", "0", "--blocks", "2", "--block-steps", "2", "--profile-steps", "0", "--n-boot", "200",
              "model=tiny", "train.micro_batch_size=1", "train.global_batch_size=1", "train.seq_length=32"]
    run = partial(subprocess.run, capture_output=True, text=True, timeout=300, cwd=REPO)
    # the three runs side by side: forward+backward only, full steps, and the refused optim.fused arm
    r_fb, r_full, r_bad = side_by_side(*[
        partial(run, [sys.executable, str(SCRIPTS / "ab_step_time.py"), "--backends", backends, *extra,
                      "--out", str(tmp_path / name), *common, f"run_dir={tmp_path / name / 'run'}"])
        for name, backends, extra in (("fb", "torch,torch", ["--fwd-bwd-only", "--tag", "fb"]),
                                      ("full", "torch,torch", []),
                                      ("bad", "torch,torch:optim.fused=true", ["--fwd-bwd-only"]))])
    outs = {}
    for name, r in (("fb", r_fb), ("full", r_full)):
        assert r.returncode == 0, r.stderr[-3000:]
        (f,) = (tmp_path / name).glob("ab_step_time_*.json")
        outs[name] = json.loads(f.read_text())
    fb = outs["fb"]
    assert fb["args"]["fwd_bwd_only"] is True and "forward+backward" in fb["method"]
    losses = [x for lab in fb["arms"] for x in fb["per_arm"][lab]["losses"]]
    assert len(losses) == 8
    first_batch = losses[0::2]  # block-steps 2: the two replayed batches alternate
    assert max(first_batch) - min(first_batch) < 0.01
    full = outs["full"]["per_arm"]["torch"]["losses"]
    assert full[0] == losses[0]
    # refused before the model is built: one line, the bad-input exit code
    assert r_bad.returncode == 2 and "Traceback" not in r_bad.stderr
    assert "nano-hybrid: model=" not in r_bad.stdout + r_bad.stderr  # the setup's banner: no model was built
    assert r_bad.stderr.strip().splitlines()[-1] == ("error: arm torch+fused-true: optim.fused needs the optimizer step "
                                                     "(not with --fwd-bwd-only)")


def test_bench_shape_grid_smoke_on_cpu(tmp_path, capsys):
    """bench_shape_grid.py end to end on the CPU: torch reference vs helion (interpret mode) at the tiny shape with
    packed documents; every field of the record is there, the helion errors are bf16-sized, and each phase of the
    shape is announced as it starts (a time limit shows where a shape stopped)."""
    from nano_hybrid.bench import bench_shape_grid as bsg

    assert len([s for s in bsg.GRID if s != "tiny"]) >= 12
    args = bsg.parse_args(["--shapes", "tiny", "--baseline", "torch", "--candidate", "helion", "--rounds", "1",
                           "--iters", "1", "--profile-iters", "0", "--device", "cpu", "--out", str(tmp_path)])
    res = bsg.run(args)
    r = res["shapes"]["tiny"]
    assert "error" not in r, r.get("traceback")
    assert set(r["rel_err_vs_fp32"]) == {"torch", "helion"} and r["rel_err_vs_fp32"]["helion"]["d_zxbcdt"] < 3e-2
    assert r["speedup_per_call"]["speedup"] > 0 and res["summary"]["shapes_run"] == 1
    assert "| tiny |" in bsg.markdown(res)
    phases = [ln.split("] ", 1)[1] for ln in capsys.readouterr().out.splitlines() if ln.startswith("   [")]
    assert [p.split(":")[0] for p in phases] == ["torch", "helion", "errors against the fp32 op", "timing"]
    # --resume keeps the record of the same settings (nothing runs), and runs again under other settings
    again = bsg.run(bsg.parse_args(["--shapes", "tiny", "--baseline", "torch", "--candidate", "helion", "--rounds",
                                    "1", "--iters", "1", "--profile-iters", "0", "--device", "cpu", "--out",
                                    str(tmp_path), "--resume"]))
    assert again["shapes"]["tiny"] == dict(r, earlier_call=True)
    assert "tiny: kept from the earlier call" in capsys.readouterr().out
    other = bsg.run(bsg.parse_args(["--shapes", "tiny", "--baseline", "torch", "--candidate", "helion", "--rounds",
                                    "2", "--iters", "1", "--profile-iters", "0", "--device", "cpu", "--out",
                                    str(tmp_path), "--resume"]))
    assert "earlier_call" not in other["shapes"]["tiny"] and "other settings" in capsys.readouterr().out


def test_shape_grid_records_the_state_passing_path_apart_from_config_notices(monkeypatch, tmp_path):
    """A shape's record lists the config notices (nearest shape, default) without the one line of an "auto"
    state-passing decision, and records the path the helion backend's runtime took at the shape ("split" here),
    also where an earlier shape with the same kernel dims already said it."""
    import warnings

    from kernels import tuning
    from kernels.registry import get_backend
    from kernels.settings import HelionSettings
    from kernels.ssd_helion import _state_key
    from nano_hybrid.bench import bench_shape_grid as bsg

    settings = HelionSettings(cache_dir=str(tmp_path / "cache"))
    shape = bsg.GRID["tiny"][0]
    dims = dict(b=shape.batch, l=-(-shape.seqlen // shape.chunk_size) * shape.chunk_size, h=shape.nheads,
                p=shape.headdim, g=shape.ngroups, n=shape.d_state, c=shape.chunk_size)

    def fake_shape(name, args, backends, device, log):
        tuning.runtime_for(settings).decisions[_state_key(dims, False)] = False
        warnings.warn("nano_hybrid kernels: no tuned sm90 config for ssd_bwd_dx at k; using the nearest tuned shape")
        warnings.warn("nano_hybrid kernels: state passing at k: split (tuned times: fused 72.3 us, split 12.6 + "
                      "24.0 us; kernels.helion.state_passing=auto)")
        warnings.warn("unrelated library warning")
        return {}

    monkeypatch.setattr(bsg, "run_shape", fake_shape)
    args = bsg.parse_args(["--shapes", "tiny", "--baseline", "torch", "--candidate", "helion", "--device", "cpu",
                           "--out", str(tmp_path)])
    helion = get_backend("helion", helion=settings.as_dict())
    try:
        rec = bsg.run(args, backends={"torch": get_backend("torch"), "helion": helion})["shapes"]["tiny"]
    finally:
        tuning.runtime_for(settings).clear()
    assert [m.split(";")[0] for m in rec["notices"]] == ["nano_hybrid kernels: no tuned sm90 config for ssd_bwd_dx at k"]
    assert rec["state_passing"] == "split"
    assert bsg.state_passing_taken(get_backend("torch"), shape) is None
    assert bsg.state_passing_taken(get_backend("helion", helion=dict(state_passing="fused")), shape) == "fused"


def _grid_args(tmp_path, *more):
    return ["--shapes", "tiny", "--baseline", "torch", "--candidate", "helion", "--rounds", "1", "--iters", "1",
            "--profile-iters", "0", "--device", "cpu", "--out", str(tmp_path), *more]


def test_shape_grid_warm_plan_orders_largest_first_and_warms_long_shapes_alone():
    """--warm-jobs' plan: the shapes largest first (zxbcdt's elements), those of more than 65536 tokens per call in a
    group of their own after the rest (nano_b1_l262144: last); each shape once."""
    from nano_hybrid.bench import bench_shape_grid as bsg

    names = [s for s in bsg.GRID if s != "tiny"]
    parallel, alone = bsg.warm_plan(names)
    assert alone == ["nano_b1_l262144"] and (parallel + alone)[-1] == "nano_b1_l262144"
    assert sorted(parallel + alone) == sorted(names)
    size = {n: bsg.GRID[n][0].batch * bsg.GRID[n][0].seqlen * bsg.GRID[n][0].zxbcdt_dim for n in names}
    assert [size[n] for n in parallel] == sorted((size[n] for n in parallel), reverse=True)
    assert parallel[0] == "nano_b8_l2048" and parallel[-1] == "nano_tp8"  # equal sizes keep the grid's order
    assert bsg.warm_plan(["tiny", "nano_proxy", "tiny"]) == (["nano_proxy", "tiny"], [])
    # a child warms one shape with the arguments that choose what compiles, and never tunes
    args = bsg.parse_args(_grid_args("/tmp/x", "--kernels-helion", "autotune=true,autotune_jobs=2", "--warm-jobs",
                                     "3", "--resume"))
    cmd = bsg.warm_command(args, "nano_proxy")
    assert cmd[1:4] == ["-P", "-m", "nano_hybrid.bench.bench_shape_grid"]
    assert "--resume" not in cmd and "--warm-jobs" not in cmd and "--rounds" not in cmd
    child = bsg.parse_args(cmd[4:])
    assert child.warm_only and child.shape_names == ["nano_proxy"] and child.device == "cpu"
    assert child.helion_settings == {"autotune": False, "autotune_jobs": 2} and args.helion_settings["autotune"]
    assert "warm_jobs" not in bsg.MEASURE_ARGS
    # the children compile but keep no Triton autotune results (their timings ran side by side)
    assert bsg._child_env()["TRITON_CACHE_AUTOTUNING"] == "0"


def test_shape_grid_warm_children_failures_are_reported_and_recorded(monkeypatch, tmp_path, capsys):
    """The parent side of --warm-jobs on a "cuda" device (the shapes' measuring faked): a child that exits 3, one
    that runs past --warm-timeout (killed) and one that succeeds are each one line; the grid still measures every
    shape and res["warm"] holds all three; children's output is under <out>/warm_logs/."""
    from nano_hybrid.bench import bench_shape_grid as bsg

    children = {"tiny": "import sys; print('boom', file=sys.stderr); sys.exit(3)",
                "nano_proxy": "print('compiled')",
                "nano_tp8": "import time; time.sleep(60)"}
    monkeypatch.setattr(bsg, "warm_command", lambda args, name: [sys.executable, "-c", children[name]])
    measured = []
    monkeypatch.setattr(bsg, "run_shape", lambda name, *a, **k: measured.append(name) or {})
    args = bsg.parse_args(["--shapes", "tiny,nano_proxy,nano_tp8", "--baseline", "torch", "--candidate", "helion",
                           "--device", "cuda", "--out", str(tmp_path), "--warm-jobs", "2", "--warm-timeout", "12"])
    res = bsg.run(args)
    out = capsys.readouterr().out
    assert measured == ["tiny", "nano_proxy", "nano_tp8"]
    assert "warm tiny: failed (exit 3, boom)" in out and re.search(r"warm nano_proxy: ok in [\d.]+ s", out)
    assert "warm nano_tp8: failed (timeout after 12 s, no output on stderr)" in out
    w = res["warm"]
    assert w["jobs"] == 2 and w["s"] >= 12 and list(w["shapes"]) == ["nano_proxy", "nano_tp8", "tiny"]
    assert w["shapes"]["tiny"]["ok"] is False and w["shapes"]["tiny"]["rc"] == 3 and w["shapes"]["nano_proxy"]["ok"]
    assert w["shapes"]["nano_tp8"] == dict(w["shapes"]["nano_tp8"], ok=False, rc="timeout")
    assert (tmp_path / "warm_logs" / "nano_proxy.out").read_text() == "compiled\n"
    # on the CPU --warm-jobs is one line and starts no child
    monkeypatch.setattr(bsg, "warm_shapes", lambda *a, **k: pytest.fail("warmed on the CPU"))
    res = bsg.run(bsg.parse_args(_grid_args(tmp_path, "--warm-jobs", "2")))
    assert "warm" not in res and "--warm-jobs: ignored on device cpu" in capsys.readouterr().out


def test_shape_grid_warm_only_runs_the_first_calls_and_measures_nothing(monkeypatch, tmp_path, capsys):
    """A --warm-only child at a shape: each backend's first call, then the fp32 reference's first call, with the
    helion settings' autotune off; no error check, no timing, no result file."""
    from nano_hybrid.bench import bench_shape_grid as bsg

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(bsg, "_end_with_parent", lambda: None)  # no watcher thread in the test process
    seen = []
    real = bsg.make_backends
    monkeypatch.setattr(bsg, "make_backends", lambda args: seen.append(dict(args.helion_settings)) or real(args))
    monkeypatch.setattr(bsg, "run", lambda *a: pytest.fail("measured in a warm child"))
    assert bsg.main(["--shapes", "tiny", "--baseline", "torch", "--candidate", "helion", "--device", "cpu",
                     "--kernels-helion", "autotune=true", "--warm-only"]) == 0
    out = capsys.readouterr().out
    phases = [ln.split("] ", 1)[1].split(":")[0] for ln in out.splitlines() if ln.startswith("   [")]
    assert phases == ["torch", "helion", "torch fp32"] and seen == [{"autotune": False}]
    assert re.search(r"warm tiny: torch [\d.]+ s, helion [\d.]+ s, fp32 [\d.]+ s", out)
    assert list(tmp_path.iterdir()) == []


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in state  # a zombie no parent reaps is gone too


def _wait_until(cond, timeout_s: float) -> bool:
    import time

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def _end_left(pids: list[int]) -> None:
    import signal

    for pid in pids:
        if not _gone(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_shape_grid_warm_children_end_with_the_measuring_process(tmp_path):
    """A measuring process stopped by SIGTERM (a stage's time limit) while warming kills its warm children first;
    a warm child whose parent is gone (killed outright) ends itself."""
    import signal
    import textwrap

    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent('''
        import sys
        from pathlib import Path
        from nano_hybrid.bench import bench_shape_grid as bsg
        bsg.warm_command = lambda args, name: [sys.executable, "-c",
                                               "import os, time; print(os.getpid(), flush=True); time.sleep(60)"]
        args = bsg.parse_args(["--shapes", "tiny", "--baseline", "torch", "--candidate", "helion", "--device", "cpu",
                               "--warm-jobs", "1"])
        bsg.warm_shapes(args, ["tiny"], Path(sys.argv[1]))
    '''))
    logs = tmp_path / "logs"
    proc = subprocess.Popen([sys.executable, str(driver), str(logs)], cwd=REPO)
    left = []  # processes of this test to end if it fails
    try:
        assert _wait_until(lambda: (logs / "tiny.out").is_file() and (logs / "tiny.out").read_text().strip(), 60)
        child = int((logs / "tiny.out").read_text())
        left.append(child)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert _wait_until(lambda: _gone(child), 5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _end_left(left)
    # a warm child's watcher: the middle process exits at once, its child notices within a second or two
    out = tmp_path / "orphan.txt"
    code = ("import os, subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import os, sys, time; "
            "from nano_hybrid.bench import bench_shape_grid as b; print(os.getpid(), flush=True); "
            "b._end_with_parent(0.1); time.sleep(60); print(\\'survived\\', flush=True)'], "
            f"stdout=open({str(out)!r}, 'w'), env=dict(os.environ, NANO_BENCH_WARM_PARENT=str(os.getpid()))); "
            "sys.exit(0)")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
    assert _wait_until(lambda: out.is_file() and out.read_text().strip(), 60)
    orphan = int(out.read_text().split()[0])
    try:
        assert _wait_until(lambda: _gone(orphan), 10), "a warm child outlived the process that started it"
    finally:
        _end_left([orphan])
    assert "survived" not in out.read_text()


def test_shape_grid_fp32_reference_out_of_memory_still_times_the_shape(monkeypatch, tmp_path, capsys):
    """An fp32 reference that runs out of GPU memory leaves the shape's errors unmeasured (None, with the reason and
    the sizes the message names) and the shape is still timed; the summary line and the markdown say so. Another
    exception still fails the shape."""
    import torch

    from nano_hybrid.bench import bench_shape_grid as bsg

    oom = torch.cuda.OutOfMemoryError
    msg = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
           "1.50 GiB is free.")

    def no_memory(p):
        raise oom(msg)

    monkeypatch.setattr(bsg, "_fp32_params", no_memory)
    res = bsg.run(bsg.parse_args(_grid_args(tmp_path)))
    r = res["shapes"]["tiny"]
    assert "error" not in r, r.get("traceback")
    assert r["rel_err_vs_fp32"] is None and r["err_ratio_max"] is None
    assert r["errors_skipped"] == "out of GPU memory in the error check (needs 2.00 GiB more, 1.50 GiB free)"
    assert r["speedup_per_call"]["speedup"] > 0 and res["summary"]["shapes_run"] == 1
    out = capsys.readouterr().out
    assert "errors not measured: out of GPU memory in the error check" in out and "err ratio not measured" in out
    assert "not measured (out of memory)" in bsg.markdown(res)

    def broken(p):
        raise RuntimeError("an unrelated failure")

    monkeypatch.setattr(bsg, "_fp32_params", broken)
    r = bsg.run(bsg.parse_args(_grid_args(tmp_path)))["shapes"]["tiny"]
    assert "an unrelated failure" in r["error"]


def test_shape_grid_resume_keeps_records_of_the_same_kernels_and_environment(monkeypatch, tmp_path, capsys):
    """--resume keeps an earlier record made at another git commit with the same kernels digest, backend settings,
    GPU and library versions; another kernels digest, another torch version or other backend settings run the shape
    again, and the line names what differs."""
    import json

    from nano_hybrid.bench import bench_shape_grid as bsg

    calls = []
    monkeypatch.setattr(bsg, "run_shape", lambda name, *a, **k: calls.append(name) or {"measured": len(calls)})
    argv = _grid_args(tmp_path, "--resume")
    first = bsg.run(bsg.parse_args(argv))
    assert len(first["env"]["kernels_digest"]) == 64 and calls == ["tiny"]
    partial = tmp_path / "shape_grid.partial.json"

    def edit(**env):
        old = json.loads(partial.read_text())
        old["env"].update(env)
        partial.write_text(json.dumps(old))

    edit(git_commit="0000000")
    capsys.readouterr()
    again = bsg.run(bsg.parse_args(argv))
    assert calls == ["tiny"] and again["shapes"]["tiny"]["earlier_call"] is True
    assert "tiny: kept from the earlier call" in capsys.readouterr().out
    edit(kernels_digest="0" * 64)
    assert "earlier_call" not in bsg.run(bsg.parse_args(argv))["shapes"]["tiny"] and calls == ["tiny"] * 2
    assert "other settings: kernels digest differ" in capsys.readouterr().out
    edit(torch="1.0")
    bsg.run(bsg.parse_args(argv))
    assert calls == ["tiny"] * 3 and "GPU/versions (torch 1.0 -> " in capsys.readouterr().out
    bsg.run(bsg.parse_args(argv + ["--kernels-helion", "state_passing=split"]))
    assert calls == ["tiny"] * 4
    assert "settings (backend settings) differ" in capsys.readouterr().out


def test_shape_grid_kernels_digest_covers_kernel_sources_and_configs(tmp_path):
    """The kernels digest changes with a kernel source or a committed config (tracked by git or not), and not with
    another file of the kernels folder."""
    from nano_hybrid.bench import bench_shape_grid as bsg

    k = tmp_path / "kernels"
    (k / "configs" / "sm90").mkdir(parents=True)
    (k / "ssd.py").write_text("x = 1\n")
    (k / "configs" / "sm90" / "ssd.json").write_text("{}\n")
    (k / "README.md").write_text("notes\n")
    base = bsg.kernels_digest(k)
    assert base == bsg.kernels_digest(k) and base != bsg.kernels_digest()
    (k / "README.md").write_text("other notes\n")
    (k / "notes.json").write_text("{}\n")
    assert bsg.kernels_digest(k) == base
    (k / "ssd.py").write_text("x = 2\n")  # the same length
    edited = bsg.kernels_digest(k)
    assert edited != base
    (k / "configs" / "sm90" / "ssd.json").write_text('{"a": 1}\n')
    changed = bsg.kernels_digest(k)
    assert changed != edited
    (k / "sub").mkdir()
    (k / "sub" / "new.py").write_text("")
    latest = bsg.kernels_digest(k)
    assert latest not in (base, edited, changed)
    # the user config cache a call without an exact committed config reads: a config tuned there changes it
    cache = tmp_path / "cache"
    assert bsg.kernels_digest(k, config_dirs=(str(cache),)) == latest  # no cache folder yet
    (cache / "sm90").mkdir(parents=True)
    (cache / "sm90" / "conv1d_fwd.json").write_text('{"b1": {}}\n')
    tuned = bsg.kernels_digest(k, config_dirs=(str(cache),))
    assert tuned != latest
    # the compile cache under it holds what the sources and configs give (a warming process writes it): not covered
    (cache / "compiled" / "sm90" / "conv1d_fwd").mkdir(parents=True)
    (cache / "compiled" / "sm90" / "conv1d_fwd" / "ab12.json").write_text('{"source": ""}\n')
    assert bsg.kernels_digest(k, config_dirs=(str(cache),)) == tuned


def test_shape_grid_resume_compares_settings_as_recorded():
    """--resume compares the backend settings as the earlier call's JSON recorded them (a float written as 120.0
    reads back equal), and the settings themselves rather than the order of --kernels-helion's items."""
    import argparse

    from nano_hybrid.bench import bench_shape_grid as bsg

    now = {"baseline": "mamba_ssm", "candidate": "helion", "rounds": 3, "iters": 3, "profile_iters": 2, "seed": 0,
           "zxbcdt_layout": "megatron"}
    settings = {"helion": {"backend": "helion", "autotune_budget_s": 120.0, "cache_dir": "", "autotune": True}}
    res = {"backend_settings": settings, "env": {"kernels_digest": "d"}}
    old = json.loads(json.dumps({"args": dict(now, kernels_helion="autotune_budget_s=120,autotune=true"),
                                 "backend_settings": settings, "env": {"kernels_digest": "d"}}))
    args = argparse.Namespace(**now, kernels_helion="autotune=true,autotune_budget_s=120")
    assert bsg._resume_differences(old, args, res) == []
    other = {"helion": dict(settings["helion"], autotune=False)}
    assert bsg._resume_differences(old, args, dict(res, backend_settings=other)) == ["settings (backend settings)"]


def test_shape_grid_times_an_a_vs_a_control_in_alternating_rounds(monkeypatch, tmp_path, capsys):
    """The timing phase times three arms in alternating rounds: the baseline, the candidate and the baseline again;
    the speedup is median(A) / median(B) over the first baseline arm's times, the A-vs-A control median(A) /
    median(A again), each with its interval; the record, the summary's control range, the printed line and the
    markdown carry the control."""
    from nano_hybrid.bench import bench_shape_grid as bsg

    real_op = bsg._op

    def tagged_op(backend, shape, p, seq):
        fwdbwd, outputs = real_op(backend, shape, p, seq)
        fwdbwd.arm = backend.name
        return fwdbwd, outputs

    timed = []

    def fake_time_calls(fn, iters, device):
        timed.append(fn.arm)
        return [float(len(timed))] * iters  # the k-th timed round takes k ms a call

    monkeypatch.setattr(bsg, "_op", tagged_op)
    monkeypatch.setattr(stats, "time_calls", fake_time_calls)
    res = bsg.run(bsg.parse_args(_grid_args(tmp_path, "--rounds", "3")))
    r = res["shapes"]["tiny"]
    assert "error" not in r, r.get("traceback")
    # rounds [A, B, A2], [A2, B, A], [A, B, A2]: A takes 1, 6, 7 ms, B 2, 5, 8 and A again 3, 4, 9
    assert timed == ["torch", "helion", "torch"] * 3
    assert stats.alternating_order(3, 3) == [[0, 1, 2], [2, 1, 0], [0, 1, 2]]
    assert set(r["ms_per_call"]) == {"torch", "helion"} and r["ms_per_call_control"]["median"] == 4.0
    assert r["ms_per_call"]["torch"]["median"] == 6.0 and r["ms_per_call"]["helion"]["median"] == 5.0
    for key, point in (("speedup_per_call", 6.0 / 5.0), ("control_per_call", 6.0 / 4.0)):
        c = r[key]
        assert set(c) == {"speedup", "ci_lo", "ci_hi", "ci_level"} and c["speedup"] == pytest.approx(point)
        assert c["ci_lo"] <= c["speedup"] <= c["ci_hi"]
    assert res["summary"]["control_per_call_range"] == [pytest.approx(1.5)] * 2
    out = capsys.readouterr().out
    assert "timing: 3 alternating rounds of 1 calls per arm (torch, helion, torch again)" in out
    assert "1.20x per call (A-vs-A 1.50 [" in out
    md = bsg.markdown(res)
    assert "| A-vs-A |" in md and "| 1.50 [" in md and "A-vs-A control per call 1.50 .. 1.50" in md


def test_shape_grid_a_shape_the_baseline_refuses_runs_the_candidate_alone(monkeypatch, tmp_path, capsys):
    """A baseline that refuses a shape (KernelBackend.shape_refusal) never runs there, nor does the fp32 reference
    (its op): the candidate runs alone (first call, timing, device time), errors are not measured, no speedup; the
    summary counts the shape as run, lists it under candidate_only and leaves it out of the geomeans; the markdown
    says "refused". A candidate that refuses a shape fails it before any work."""
    import dataclasses

    import torch

    from kernels.registry import get_backend
    from nano_hybrid.bench import bench_shape_grid as bsg

    def never(*a, **k):
        pytest.fail("the refusing baseline ran")

    torch_refusing = dataclasses.replace(get_backend("torch"), max_mixer_elements=1,
                                         mamba_split_conv1d_scan_combined=never)
    helion = get_backend("helion")
    res = bsg.run(bsg.parse_args(_grid_args(tmp_path, "--rounds", "2")),
                  backends={"torch": torch_refusing, "helion": helion})
    r = res["shapes"]["tiny"]
    assert "error" not in r, r.get("traceback")
    assert "32-bit offsets" in r["baseline_refused"] and "first_call_s_torch" not in r and r["first_call_s_helion"] > 0
    assert r["rel_err_vs_fp32"] is None and r["err_ratio_max"] is None
    assert r["errors_skipped"] == f"no reference: {r['baseline_refused']}"
    assert set(r["ms_per_call"]) == {"helion"} and r["ms_per_call"]["helion"]["n"] == 2
    assert not {"speedup_per_call", "control_per_call", "speedup_device", "ms_per_call_control"} & set(r)
    s = res["summary"]
    assert s["shapes_run"] == 1 and s["candidate_only"] == ["tiny"] and s["shapes_failed"] == []
    assert s["geomean_speedup_per_call"] is None and s["min_speedup_per_call"] is None
    assert s["control_per_call_range"] is None
    out = capsys.readouterr().out
    assert "torch refuses the shape" in out and re.search(r"helion alone \(torch refuses the shape\): [\d.]+ ms", out)
    row = next(ln for ln in bsg.markdown(res).splitlines() if ln.startswith("| tiny |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "refused" and cells[3:6] == ["-", "-", "-"]
    assert cells[6] == "no reference: torch indexes with 32-bit offsets"
    assert "helion alone (torch refuses): tiny" in bsg.markdown(res)
    # the device time of the candidate alone
    monkeypatch.setattr(profiling, "profile_device_table", lambda fn, iters: {
        "total_us_per_iter": 7.0, "rows": [{"kernel": "k", "us_per_iter": 7.0, "calls_per_iter": 1, "x": 0}]})
    rec = {}
    bsg._device_time(rec, {"helion": (lambda: None, None)}, ["helion"], 2)
    assert rec == {"device_us_per_call": {"helion": 7.0},
                   "device_kernels": {"helion": [{"kernel": "k", "us_per_iter": 7.0, "calls_per_iter": 1}]}}
    # a warming child at the shape: the candidate's first call only
    seen = []
    rec = bsg.run_shape("tiny", bsg.parse_args(_grid_args(tmp_path)), {"torch": torch_refusing, "helion": helion},
                        torch.device("cpu"), seen.append, warm_only=True)
    assert [k for k in rec if k.startswith("first_call_s_")] == ["first_call_s_helion"]
    assert not any("fp32" in m for m in seen)
    # a candidate that refuses the shape fails it, before any tensor is made
    monkeypatch.setattr(bsg, "make_params", never)
    res = bsg.run(bsg.parse_args(_grid_args(tmp_path)),
                  backends={"torch": get_backend("torch"),
                            "helion": dataclasses.replace(helion, max_mixer_elements=1)})
    r = res["shapes"]["tiny"]
    assert r["error"].startswith("candidate refuses: kernel backend 'helion' indexes with 32-bit offsets")
    assert res["summary"]["shapes_failed"] == ["tiny"] and res["summary"]["shapes_run"] == 0
    assert "| tiny | ERROR | candidate refuses" in bsg.markdown(res)


def _lose_context_at(monkeypatch, bsg, bad: str):
    """run_shape faked: shape ``bad`` raises a CUDA error, the others record their name; the probe says the
    context is lost; torch.cuda.empty_cache calls are counted (returned list)."""
    import torch

    def fake_shape(name, *a, **k):
        if name == bad:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return {"measured": name}

    emptied = []
    monkeypatch.setattr(bsg, "run_shape", fake_shape)
    monkeypatch.setattr(bsg, "_cuda_context_lost", lambda device: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    return emptied


def test_shape_grid_continues_in_a_new_process_after_losing_the_cuda_context(monkeypatch, tmp_path, capsys):
    """On a "cuda" device, a shape that raises and leaves the CUDA context lost is recorded with cuda_context_lost;
    the partial json is written, the shapes still to run go to a continuing process (faked), and its records join
    the result in order, each with continued_in_child (a record from further down the chain keeps its number);
    no torch.cuda.empty_cache after the loss. A continuing process that fails leaves the shapes it did not record
    as "not run" errors; stale results in its folder are not taken."""
    import json

    from nano_hybrid.bench import bench_shape_grid as bsg

    emptied = _lose_context_at(monkeypatch, bsg, "nano_tp4")
    names = ["nano_tp8", "nano_tp4", "nano_proxy", "tiny", "nano_tp2"]
    calls = []

    def fake_child(args, todo, k, out):
        parent = json.loads((out.parent / "shape_grid.partial.json").read_text())
        calls.append((list(todo), k, out, list(parent["shapes"]), parent["shapes"]["nano_tp4"]))
        out.mkdir(parents=True, exist_ok=True)
        shapes = {"nano_proxy": {"measured": "nano_proxy"}, "tiny": {"measured": "tiny", "continued_in_child": 2},
                  "nano_tp2": {"measured": "nano_tp2"}}
        (out / "shape_grid.partial.json").write_text(json.dumps({"shapes": shapes}))
        return 1, "a warning"

    monkeypatch.setattr(bsg, "_continue_in_child", fake_child)
    argv = ["--shapes", ",".join(names), "--baseline", "torch", "--candidate", "helion", "--device", "cuda",
            "--out", str(tmp_path)]
    res = bsg.run(bsg.parse_args(argv))
    assert list(res["shapes"]) == names
    lost = res["shapes"]["nano_tp4"]
    assert lost["cuda_context_lost"] is True and "illegal memory access" in lost["error"]
    (todo, k, out, before, lost_then), = calls
    assert todo == ["nano_proxy", "tiny", "nano_tp2"] and k == 1 and out == tmp_path / "continued_1"
    assert before == ["nano_tp8", "nano_tp4"] and lost_then["cuda_context_lost"] is True  # written before the child
    assert [res["shapes"][n].get("continued_in_child") for n in names] == [None, None, 1, 2, 1]
    assert [res["shapes"][n].get("measured") for n in names] == ["nano_tp8", None, "nano_proxy", "tiny", "nano_tp2"]
    assert emptied == [1]  # after nano_tp8 only
    assert res["summary"]["shapes_failed"] == ["nano_tp4"] and res["continued"]["rc"] == 1
    saved = json.loads((tmp_path / "shape_grid.partial.json").read_text())
    assert list(saved["shapes"]) == names and saved["shapes"]["tiny"]["continued_in_child"] == 2
    assert "CUDA context lost at nano_tp4; 3 shapes continue in a new process" in capsys.readouterr().out

    # a continuing process that dies after one shape; a stale shape_grid.json of an earlier call is not read
    (tmp_path / "continued_1" / "shape_grid.json").write_text(json.dumps({"shapes": {n: {} for n in names}}))

    def dying_child(args, todo, k, out):
        (out / "shape_grid.partial.json").write_text(json.dumps({"shapes": {"nano_proxy": {"measured": "x"}}}))
        return -11, "Segmentation fault"

    monkeypatch.setattr(bsg, "_continue_in_child", dying_child)
    res = bsg.run(bsg.parse_args(argv))
    assert list(res["shapes"]) == names and res["shapes"]["nano_proxy"] == {"measured": "x", "continued_in_child": 1}
    for n in ("tiny", "nano_tp2"):
        assert res["shapes"][n] == {"error": "not run: the continuing process failed (rc -11, Segmentation fault)",
                                    "continued_in_child": 1}
    assert res["summary"]["shapes_failed"] == ["nano_tp2", "nano_tp4", "tiny"]
    assert "not run" in bsg.markdown(res)
    # the last shape losing the context starts no process; on the CPU a failing shape never probes the context
    monkeypatch.setattr(bsg, "_continue_in_child", lambda *a: pytest.fail("continued with nothing to run"))
    res = bsg.run(bsg.parse_args(argv[:1] + ["nano_tp8,nano_tp4"] + argv[2:]))
    assert res["shapes"]["nano_tp4"]["cuda_context_lost"] and "continued" not in res
    assert "CUDA context lost at nano_tp4; 0 shapes continue" in capsys.readouterr().out
    monkeypatch.setattr(bsg, "_cuda_context_lost", lambda device: pytest.fail("probed on the CPU"))
    res = bsg.run(bsg.parse_args(_grid_args(tmp_path, "--shapes", "nano_tp4,tiny")))
    assert "error" in res["shapes"]["nano_tp4"] and res["shapes"]["tiny"]["measured"] == "tiny"


def test_shape_grid_continuing_process_measures_as_its_parent(monkeypatch, tmp_path):
    """The continuing process's command: this module at the remaining shapes with the parent's measuring arguments,
    its own --out and number, no --resume and no warming; its environment keeps the parent's Triton autotune
    caching (a warm child's turns it off). The real child runs on the CPU and leaves its records; a failing one's
    last stderr line comes back."""
    import json

    from nano_hybrid.bench import bench_shape_grid as bsg

    args = bsg.parse_args(["--quick", "--baseline", "torch", "--candidate", "helion", "--kernels-helion",
                           "autotune=true,autotune_jobs=2", "--iters", "7", "--profile-iters", "2", "--seed", "3",
                           "--zxbcdt-layout", "contiguous", "--device", "cuda", "--out", "/tmp/x", "--resume",
                           "--warm-jobs", "2"])
    cmd = bsg.continue_command(args, ["nano_proxy", "tiny"], "/tmp/x/continued_1", 1)
    assert cmd[:4] == [sys.executable, "-P", "-m", "nano_hybrid.bench.bench_shape_grid"]
    assert "--resume" not in cmd and "--warm-jobs" not in cmd and "--warm-only" not in cmd
    child = bsg.parse_args(cmd[4:])
    assert {k: getattr(child, k) for k in bsg.MEASURE_ARGS} == {k: getattr(args, k) for k in bsg.MEASURE_ARGS}
    assert child.rounds == 3 and child.helion_settings == args.helion_settings  # --quick's rounds, autotune kept
    assert child.shape_names == ["nano_proxy", "tiny"] and child.out == "/tmp/x/continued_1"
    assert child.continuation == 1 and child.device == "cuda" and not child.resume and child.warm_jobs == 0
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "1")
    assert bsg._child_env(measuring=True)["TRITON_CACHE_AUTOTUNING"] == "1"
    assert bsg._child_env()["TRITON_CACHE_AUTOTUNING"] == "0"
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING")
    assert "TRITON_CACHE_AUTOTUNING" not in bsg._child_env(measuring=True)
    # a real continuing process at the tiny shape on the CPU, run as the command says with the test-only
    # aten::mm.dtype shim of tests/conftest.py loaded first (helion's interpret mode needs it)
    real = bsg.continue_command

    def with_shim(*a):
        cmd = real(*a)
        assert cmd[1:4] == ["-P", "-m", "nano_hybrid.bench.bench_shape_grid"]
        return [cmd[0], "-P", "-c", "import conftest, runpy; runpy.run_module('nano_hybrid.bench.bench_shape_grid', "
                "run_name='__main__', alter_sys=True)", *cmd[4:]]

    monkeypatch.setattr(bsg, "continue_command", with_shim)
    # the child finds tests/conftest.py on its PYTHONPATH (_child_env keeps what the variable already holds)
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH", "")])))
    cpu = bsg.parse_args(_grid_args(tmp_path))
    rc, _ = bsg._continue_in_child(cpu, ["tiny"], 1, tmp_path / "continued_1")
    assert rc == 0
    rec = json.loads((tmp_path / "continued_1" / "shape_grid.json").read_text())["shapes"]["tiny"]
    assert "error" not in rec and rec["control_per_call"]["speedup"] > 0
    monkeypatch.setattr(bsg, "continue_command", lambda *a: [sys.executable, "-c", "import sys; "
                        "print('first', file=sys.stderr); print('boom', file=sys.stderr); sys.exit(3)"])
    assert bsg._continue_in_child(cpu, ["tiny"], 1, tmp_path / "c") == (3, "boom")


def test_tune_kernels_takes_the_grid_shapes():
    """--shapes also names bench_shape_grid.py's shapes (their model dims), so a grid can be tuned before it runs; a
    packed-document shape carries its documents per sequence ("docs"); unknown names are refused."""
    from nano_hybrid.bench import tune_kernels as tk

    got = tk.resolve_shapes([], "m2_small_c256,nano,nemh_8b_docs4", None)
    assert got == {"m2_small_c256": dict(b=8, l=2048, h=24, p=64, g=1, n=128, c=256, w=4),
                   "nano": dict(b=2, l=8192, h=64, p=64, g=8, n=128, c=128, w=4),
                   "nemh_8b_docs4": dict(b=1, l=8192, h=128, p=64, g=8, n=128, c=128, w=4, docs=4)}
    with pytest.raises(ValueError, match="unknown shapes"):
        tk.resolve_shapes([], "nano_b3", None)
    # 'grid': every grid shape, once, beside the presets named with it
    grid = tk.resolve_shapes([], "nano_proxy,grid", None)
    assert "tiny" not in grid and grid["nano_b2_l8192_docs8"]["docs"] == 8
    assert {"nano_tp8", "m2_small_c256", "nemh_8b", "nano_b2_l3000", "nano_proxy", "nano_b1_l262144"} <= set(grid)
    assert len(grid) == 16
    # a grid shape named like a preset has the grid's dims under 'grid' (the grid's nano_tp2 is micro-batch 1, the
    # preset's 2), and the preset's where it is named alone
    from nano_hybrid.bench.mixer import GRID

    assert grid["nano_tp2"] == GRID["nano_tp2"][0].model_dims() and grid["nano_tp2"]["b"] == 1
    assert tk.resolve_shapes([], "grid,nano_tp2", None)["nano_tp2"]["b"] == 1
    assert tk.resolve_shapes([], "nano_tp2", None)["nano_tp2"] == dict(tk.tuner.SHAPE_PRESETS["nano_tp2"])


def test_packed_shapes_tune_the_conv_kernels_with_seq_idx_and_share_the_rest():
    """A packed-document shape's conv1d kernels have their own config entries (seq1) and their search case passes
    seq_idx; its other kernels have the unpacked shape's entries, so a shape list with both searches those once."""
    import torch

    from kernels import tuner
    from nano_hybrid.bench import tune_kernels as tk
    from nano_hybrid.kernel_search import pairs_of

    registry = tuner.discover_tunable_kernels()
    shapes = tk.resolve_shapes([], "nemh_8b,nemh_8b_docs4", None)
    names = sorted(registry)
    pairs = pairs_of(names, shapes, registry)
    assert [n for n, s in pairs if s == "nemh_8b_docs4"] == ["conv1d_bwd", "conv1d_fwd"]
    assert len(pairs) == len(names) + 2 and len(pairs_of(names, shapes)) == 2 * len(names)
    small = dict(b=2, l=200, h=4, p=16, g=2, n=16, c=64, w=4)
    for name in ("conv1d_fwd", "conv1d_bwd"):
        packed = registry[name][1](dict(small, docs=3), "cpu")
        assert packed.dims["seq"] == 1 and packed.dims == registry[name][1].dims(dict(small, docs=3))
        seq = next(a for a in packed.args if isinstance(a, torch.Tensor) and a.dtype == torch.int32)
        assert seq.shape == (2, 256) and seq[0, :200].unique().tolist() == [0, 1, 2] and (seq[:, 199:] == 2).all()
        assert registry[name][1].dims(small)["seq"] == 0


def test_pretune_tunes_the_missing_kernels_at_once_then_nothing(monkeypatch, tmp_path):
    """kernels.helion.autotune before the first step: the kernels without a config at the run's mixer dims are
    searched in isolated children, autotune_jobs at a time under a shared timing lock, each with the first-use
    budget, into the user cache; a second process (under the same lock) finds nothing left and starts none."""
    from kernels.settings import HelionSettings
    from nano_hybrid import kernel_search as tk

    missing = [["conv1d_fwd", "ssd_bwd_dx", "ssd_bwd_db"], []]
    seen = {}
    monkeypatch.setattr(tk, "missing_kernels", lambda registry, names, shapes, root: (
        seen.update(names=names, shapes=shapes, root=root) or missing.pop(0)))
    monkeypatch.setattr(tk, "run_children", lambda cmds, jobs, timeout_s, log_dir, say: (
        seen.update(cmds=cmds, jobs=jobs, timeout_s=timeout_s, log_dir=log_dir) or ["ssd_bwd_db @ x (timeout)"]))
    lines = []
    dims = dict(b=4, l=1024, h=16, p=64, g=8, n=128, c=128, w=4)
    s = HelionSettings(autotune=True, autotune_budget_s=20, autotune_jobs=2, cache_dir=str(tmp_path / "cache"))
    assert tk.pretune(dims, s, say=lines.append) == ["ssd_bwd_db @ x (timeout)"]
    assert seen["root"] == tmp_path / "cache" and list(seen["shapes"].values()) == [dims]
    assert seen["names"] == sorted(tk.helion_training_kernels(s))  # what a training step calls, not every kernel
    assert seen["jobs"] == 2 and seen["timeout_s"] == 20 + tk.ISOLATE_OVERHEAD_S + tk.first_use.SEARCH_MARGIN_S
    assert [c[c.index("--kernels") + 1] for c in seen["cmds"]] == ["conv1d_fwd", "ssd_bwd_dx", "ssd_bwd_db"]
    for c in seen["cmds"]:
        assert float(c[c.index("--budget-s") + 1]) == 20.0 and c[c.index("--out-root") + 1] == str(tmp_path / "cache")
        assert Path(c[c.index("--timing-lock") + 1]).parent == seen["log_dir"] and "--no-write" not in c
    assert len(lines) == 2 and "tuning 3 kernels" in lines[0] and "2 at a time" in lines[0]
    assert "tuned 2 of 3" in lines[1] and "ssd_bwd_db" in lines[1]
    lines.clear()
    assert tk.pretune(dims, s, say=lines.append) == [] and lines == []  # the second process: nothing left


def test_trainer_pretunes_only_helion_autotune_on_a_gpu(monkeypatch):
    """The trainer's pretune step runs for the helion backend with autotune on a CUDA device, at the run's mixer
    dims (per tensor-parallel rank); not with autotune off, on CPU, or without Mamba layers."""
    from types import SimpleNamespace

    import torch

    from kernels.settings import HelionSettings
    from nano_hybrid import kernel_search as tk
    from nano_hybrid import trainer
    from nano_hybrid.config import compose

    calls = []
    monkeypatch.setattr(tk, "pretune", lambda dims, settings, say, fused_norm: calls.append(dims) or fused.append(
        fused_norm) or [])
    fused = []
    cfg = compose(["model=nano_proxy", "train.seq_length=1024", "train.micro_batch_size=4"])
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    on, off = HelionSettings(autotune=True), HelionSettings()

    def plan(settings, device):
        return SimpleNamespace(backend=SimpleNamespace(settings=settings), device=device)

    for settings, device in ((off, gpu), (on, cpu), (None, gpu)):
        assert trainer.pretune_kernels(cfg, plan(settings, device), print) == [] and calls == []
    assert trainer.pretune_kernels(cfg, plan(on, gpu), print) == []
    assert calls == [dict(b=4, l=1024, h=16, p=64, g=8, n=128, c=128, w=4)] and fused == [False]
    cfg.model.mamba_fused_norm = True  # the run's model.mamba_fused_norm picks the kernels pretuned
    assert trainer.pretune_kernels(cfg, plan(on, gpu), print) == [] and fused == [False, True]
    calls.pop()
    cfg.model.hybrid_override_pattern = "*E*E"
    assert trainer.pretune_kernels(cfg, plan(on, gpu), print) == [] and len(calls) == 1


def test_gpu_suite_refuses_tokenizing_stages_without_the_tokenizer_file(tmp_path):
    """The stages that tokenize with the 131k BPE (long, seeds, data) stop before any setup with one line naming the
    missing tokenizer file and how to make it; with the file there, the same stage passes the check."""
    import shutil
    import subprocess

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "scripts").mkdir()
    shutil.copy(root / "scripts" / "gpu_suite.sh", tmp_path / "scripts" / "gpu_suite.sh")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "SKIP_SETUP": "1"}
    for stage in ("long", "seeds", "data", "tests+long"):
        r = subprocess.run(["bash", "scripts/gpu_suite.sh", stage], cwd=tmp_path, capture_output=True, text=True,
                           env=env)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "needs data/tokenizers/tekken_131k.json" in r.stderr and "prepare_tokenizer.py" in r.stderr
        assert not (tmp_path / "out" / "stages.tsv").exists()
    (tmp_path / "data" / "tokenizers").mkdir(parents=True)
    (tmp_path / "data" / "tokenizers" / "tekken_131k.json").write_text("[]")
    # the file is there: the check passes and the unknown stage after it is what stops the run
    r = subprocess.run(["bash", "scripts/gpu_suite.sh", "long", "nope"], cwd=tmp_path, capture_output=True, text=True,
                       env=env)
    assert r.returncode == 2 and "unknown stage 'nope'" in r.stderr and "tekken" not in r.stderr



def test_early_tracebacks_print_a_failure_when_it_happens(tmp_path):
    """gpu_suite.sh's tests stage runs pytest with --early-tracebacks (tests/early_tracebacks.py): a failure's
    traceback is printed right after it fails, before the tests after it run, so a run its time limit stops still
    says why. Without the option (and with --tb=no -rN) the reason is not printed at all."""
    root = Path(__file__).resolve().parents[1]
    assert "--early-tracebacks" in (root / "scripts" / "gpu_suite.sh").read_text()
    (tmp_path / "test_x.py").write_text(
        "def test_a():\n    assert 1 + 1 == 3, 'the reason it failed'\n\n"
        "def test_b():\n    print('test_b ran')\n")
    env = dict(os.environ, PYTHONPATH=str(root / "tests"))

    def run(*extra):
        r = subprocess.run([sys.executable, "-m", "pytest", "-p", "early_tracebacks", "-p", "no:cacheprovider", "-v",
                            "--tb=no", "-rN", "-s", "--rootdir", str(tmp_path), *extra, str(tmp_path / "test_x.py")],
                           cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 1, r.stdout + r.stderr
        return r.stdout

    out = run("--early-tracebacks")
    assert "test_x.py::test_a (call) failed:" in out and "the reason it failed" in out
    assert out.index("the reason it failed") < out.index("test_b ran")
    assert "the reason it failed" not in run()


def test_gpu_suite_passes_only_flags_its_scripts_accept(capsys):
    """Every `python3 scripts/X.py ... --flag` in gpu_suite.sh names a flag that X's argument parser lists in --help:
    a stage fails on the GPU host, after setup, when a script lacks a flag the suite passes."""
    import contextlib
    import importlib
    import io
    import re

    root = Path(__file__).resolve().parents[1]
    text = (root / "scripts" / "gpu_suite.sh").read_text().replace("\\\n", " ")
    calls = re.findall(r"python3 scripts/(\w+)\.py([^;&|\n]*)", text)
    assert len({name for name, _ in calls}) >= 10
    checked = 0
    for name, args in calls:
        flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", args))
        if not flags:
            continue
        wrapper = (root / "scripts" / f"{name}.py").read_text()
        module = re.search(r"^from ([\w.]+) import main", wrapper, re.M).group(1)
        main = importlib.import_module(module).main
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as e:
            main(["--help"])
        assert e.value.code in (0, None), name
        missing = sorted(f for f in flags if f not in buf.getvalue())
        assert not missing, f"scripts/{name}.py does not accept {missing}"
        checked += 1
    assert checked >= 10


def test_gpu_suite_archive_holds_the_output_without_checkpoints(tmp_path):
    """ARCHIVE=file.tgz: after the stages, one archive of $OUT (logs, stages.tsv, .FAILED files), leaving out
    checkpoints (here: two-GPU stages that fail at once on a host without two GPUs)."""
    import subprocess
    import tarfile

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    (out / "convergence_seeds" / "long_helion" / "checkpoints").mkdir(parents=True)
    (out / "convergence_seeds" / "long_helion" / "checkpoints" / "model.pt").write_text("weights")
    (out / "convergence_seeds" / "long_helion" / "metrics.jsonl").write_text('{"step": 1}\n')
    archive = tmp_path / "take" / "results.tgz"
    r = subprocess.run(["bash", "scripts/gpu_suite.sh", "parity+convergence"], cwd=root, capture_output=True,
                       text=True, env={**os.environ, "OUT": str(out), "SKIP_SETUP": "1", "ARCHIVE": str(archive)})
    assert r.returncode == 2, r.stdout + r.stderr
    with tarfile.open(archive) as tf:
        names = {n.removeprefix("./") for n in tf.getnames()}
    assert {"stages.tsv", "logs/parity.log", "logs/convergence.log", "parity.FAILED",
            "convergence_seeds/long_helion/metrics.jsonl"} <= names
    assert not any("checkpoints" in n for n in names)


def test_triton_source_dumps_and_compares(tmp_path):
    """scripts/triton_source.py writes each kernel's Triton source at a shape with the config a run selects (on the
    CPU, compiled mode) and marks the configs whose indexing this host lowers otherwise than a GPU would;
    ``--compare`` names the pairs whose source differs from an earlier dump, with their diff; it refuses interpret
    mode and a --compare folder it did not write."""
    from nano_hybrid.bench import triton_source as ts

    env = {k: v for k, v in os.environ.items() if k != "HELION_INTERPRET"}
    cmd = [sys.executable, str(SCRIPTS / "triton_source.py"), "--kernels", "rmsnorm_fwd",
           "--shapes", "nano_b4_l1024,nano_proxy"]

    def run(*extra, env=env):
        return subprocess.run(cmd + list(extra), capture_output=True, text=True, timeout=300, cwd=REPO, env=env)

    r = run("--out", str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr[-3000:]
    man = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert set(man["pairs"]) == {"nano_b4_l1024/rmsnorm_fwd", "nano_proxy/rmsnorm_fwd"} and man["arch"] == "sm90"
    src = (tmp_path / "a" / "nano_b4_l1024" / "rmsnorm_fwd.py").read_text()
    assert "@triton.jit" in src and man["pairs"]["nano_b4_l1024/rmsnorm_fwd"]["how"] in ("exact", "nearest")
    assert set(man["host_indexing"]) == {"block_ptr", "tensor_descriptor"}
    # nano_proxy's committed rmsnorm_fwd config asks for TMA descriptors: pointers where this host has none
    proxy = man["pairs"]["nano_proxy/rmsnorm_fwd"]
    assert "tensor_descriptor" in json.dumps(proxy["config"]["indexing"]) and proxy["how"] == "exact"
    assert proxy["indexing_as_pointer"] == ([] if man["host_indexing"]["tensor_descriptor"] else ["tensor_descriptor"])
    r = run("--out", str(tmp_path / "b"), "--compare", str(tmp_path / "a"))
    assert r.returncode == 0 and "2 identical, 0 differing" in r.stdout, r.stdout + r.stderr[-2000:]
    summary = json.loads((tmp_path / "b" / "compare.json").read_text())
    assert ("nano_proxy/rmsnorm_fwd" in summary["unlike_gpu"]) is bool(proxy["indexing_as_pointer"])
    # an edited source (as after a kernel edit or another Helion version) is named, with its diff
    (tmp_path / "a" / "nano_b4_l1024" / "rmsnorm_fwd.py").write_text(src.replace("@triton.jit", "@triton.jit\n# edited"))
    man["pairs"]["nano_b4_l1024/rmsnorm_fwd"]["sha256"] = "0" * 64
    new = json.loads((tmp_path / "b" / "manifest.json").read_text())
    summary, diff = ts.compare(new, man, tmp_path / "b", tmp_path / "a")
    assert summary["differing"] == ["nano_b4_l1024/rmsnorm_fwd"] and summary["identical"] == ["nano_proxy/rmsnorm_fwd"]
    assert "-# edited" in diff
    r = run("--out", str(tmp_path / "d"), "--compare", str(tmp_path / "nothing"))
    assert r.returncode == 2 and "no manifest.json there" in r.stderr
    r = run("--out", str(tmp_path / "e"), env={**env, "HELION_INTERPRET": "1"})
    assert r.returncode == 2 and "needs HELION_INTERPRET unset" in r.stderr


def test_triton_source_registers(tmp_path):
    """``--registers`` compiles each dumped kernel for the arch with this host's Triton and ptxas (no GPU) and records
    its registers per thread, spill and stack bytes, warps and stages, the warps and stages being those of the
    config the run selects; an arch that is not an NVIDIA sm refuses before any work."""
    env = {k: v for k, v in os.environ.items() if k != "HELION_INTERPRET"}
    cmd = [sys.executable, str(SCRIPTS / "triton_source.py"), "--kernels", "rmsnorm_fwd,ssd_bwd_state_passing",
           "--shapes", "nano_b4_l1024", "--registers"]
    r = subprocess.run(cmd + ["--out", str(tmp_path / "a")], capture_output=True, text=True, timeout=600, cwd=REPO,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    man = json.loads((tmp_path / "a" / "manifest.json").read_text())
    for pair, e in man["pairs"].items():
        f = e["ptxas"]
        assert 0 < f["registers"] <= 255, pair
        assert f["spill_store_bytes"] >= 0 and f["spill_load_bytes"] >= 0 and f["stack_frame_bytes"] >= 0, pair
        assert (f["num_warps"], f["num_stages"]) == (e["config"]["num_warps"], e["config"]["num_stages"]), pair
        assert f["maxnreg"] == e["config"].get("maxnreg"), pair
        assert f["triton"] == man["triton"]
        assert f"{pair:<48} {f['registers']:>4}" in r.stdout
        if e["how"] == "exact":
            assert e["search"]["time_ms"] > 0 and e["search"]["gpu"], pair
    r = subprocess.run(cmd + ["--out", str(tmp_path / "b"), "--arch", "gfx942"], capture_output=True, text=True,
                       timeout=300, cwd=REPO, env=env)
    assert r.returncode == 2 and "--registers needs an NVIDIA --arch" in r.stderr
    assert not (tmp_path / "b").exists()  # refused before any work


def test_ptxas_figures_apply_the_register_cap():
    """A config's maxnreg (which Helion leaves out of the launch without a CUDA device) caps the registers of the
    compile ``--registers`` reads: a kernel holding 128 fp32 values per thread uses more than 64 registers without the
    cap and at most 64 with it, and the figures record the cap."""
    import triton
    import triton.language as tl

    from nano_hybrid.bench.triton_source import ptxas_figures

    @triton.jit
    def wide(x, y, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        v = tl.load(x + o, mask=o < n)
        tl.store(y + o, tl.exp(v) * tl.sum(v * v, 0), mask=o < n)

    import torch
    x = torch.empty(4096)
    launch = dict(fn=wide, args=(x, x, 4096, 4096), options=dict(num_warps=1, num_stages=1))
    free = ptxas_figures(launch, "sm90")
    capped = ptxas_figures(launch, "sm90", maxnreg=64)
    assert free["registers"] > 64 and free["maxnreg"] is None
    assert capped["registers"] <= 64 and capped["maxnreg"] == 64


def test_persistent_kernel_compiles_for_the_given_sm_count(tmp_path, monkeypatch):
    """A persistent pid_type's host code asks the GPU for its SM count, a compile-time constant of the kernel's loop:
    ``launch_of`` gives it ``num_sms`` instead, so ``--registers`` reads such a config's figures on the CPU (its cap
    applied); without a count the host code cannot run here."""
    import helion

    from kernels import ssd_helion_bwd as bwd
    from nano_hybrid.bench.triton_source import ARCH_NUM_SMS, launch_of, ptxas_figures

    monkeypatch.delenv("HELION_INTERPRET", raising=False)
    args, _ = bwd._example_args("ssd_bwd_dt", dict(b=1, l=256, h=4, p=16, g=2, n=16, c=64), "cpu")
    bound = helion.kernel(bwd.ssd_bwd_dt.fn, static_shapes=True).bind(args)
    cfg = helion.Config(block_sizes=[], num_warps=1, num_stages=1, pid_type="persistent_interleaved")
    src = tmp_path / "dt.py"
    src.write_text(bound.to_triton_code(cfg))
    launch = launch_of(src, "ssd_bwd_dt", tuple(args), num_sms=ARCH_NUM_SMS["sm90"])
    assert ARCH_NUM_SMS["sm90"] == 132 and [a for a in launch["args"] if isinstance(a, int) and a == 132]  # _NUM_SM
    figures = ptxas_figures(launch, "sm90", maxnreg=32)
    assert 0 < figures["registers"] <= 32 and figures["maxnreg"] == 32
    with pytest.raises(AssertionError):  # helion.runtime.get_num_sm on a CPU tensor: there is no GPU to ask
        launch_of(src, "ssd_bwd_dt", tuple(args))


def test_uninitialized_factories_keep_the_asked_device_dtype_and_shape():
    """The cases the tools bind are built where they will run: torch.randn / torch.rand under
    uninitialized_factories keep the device (here "meta", which needs no GPU), dtype and shape they are asked for,
    and are restored afterwards."""
    import torch

    from nano_hybrid.bench.triton_source import uninitialized_factories

    gen = torch.Generator().manual_seed(0)
    with uninitialized_factories():
        a = torch.randn(3, 4, generator=gen, device="meta", dtype=torch.bfloat16)
        b = torch.rand((2, 5), device=torch.device("meta"))
    assert (a.device.type, a.dtype, tuple(a.shape)) == ("meta", torch.bfloat16, (3, 4))
    assert (b.device.type, b.dtype, tuple(b.shape)) == ("meta", torch.float32, (2, 5))
    assert torch.randn(2, device="meta").device.type == "meta" and torch.randn(2).device.type == "cpu"
    torch.manual_seed(0)
    assert torch.equal(torch.randn(3), torch.randn(3, generator=torch.Generator().manual_seed(0)))  # the real one


def test_bench_compile_cache_times_both_modes_in_fresh_processes(tmp_path):
    """scripts/bench_compile_cache.py times each kernel's first-call work in a fresh process with an empty compile
    cache and again in a second one that loads every kernel from the entries the first stored (same config source);
    it refuses interpret mode."""
    env = {k: v for k, v in os.environ.items() if k != "HELION_INTERPRET"}
    cmd = [sys.executable, str(SCRIPTS / "bench_compile_cache.py"), "--kernels", "rmsnorm_fwd,conv1d_fwd",
           "--shapes", "nano_proxy", "--arch", "sm90", "--device", "cpu", "--out", str(tmp_path / "out")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((tmp_path / "out" / "compile_cache.json").read_text())
    assert rep["arch"] == "sm90" and rep["kernels"] == ["rmsnorm_fwd", "conv1d_fwd"]
    cold, cached = rep["results"]["nano_proxy"]["cold"], rep["results"]["nano_proxy"]["cached"]
    assert set(cold["kernels"]) == set(cached["kernels"]) == {"rmsnorm_fwd", "conv1d_fwd"}
    for name in cold["kernels"]:
        assert not cold["kernels"][name]["from_cache"] and cached["kernels"][name]["from_cache"]
        assert cold["kernels"][name]["how"] == cached["kernels"][name]["how"] == "exact"
    assert "nano_proxy" in r.stdout and "cold" in r.stdout and "cached" in r.stdout
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env={**env, "HELION_INTERPRET": "1"})
    assert r.returncode == 2 and "HELION_INTERPRET is set" in r.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="interpret-mode run (CPU)")
def test_bench_configs_times_variants_against_the_selected_config(tmp_path, capsys):
    """scripts/bench_configs.py runs a kernel's selected config, each --variant layered over it and the selected one
    again (the A-vs-A control), checks every arm's outputs against the selected config's and writes the record; bad
    variants and an unknown kernel fail before any work with one message."""
    from nano_hybrid.bench import bench_configs as bc

    rc = bc.main(["--kernel", "rmsnorm_fwd", "model=tiny", "--variant", 'w8={"num_warps": 8}', "--rounds", "2",
                  "--iters", "1", "--warmup", "0", "--out", str(tmp_path)])
    assert rc == 0
    (path,) = tmp_path.glob("configs_rmsnorm_fwd_*.json")
    d = json.loads(path.read_text())
    assert list(d["configs"]) == ["selected", "w8", "selected#2"]
    assert d["configs"]["w8"] == {**d["configs"]["selected"], "num_warps": 8}
    assert d["configs"]["selected#2"] == d["configs"]["selected"]
    assert all(c["bitwise_equal"] and c["max_abs_diff"] == 0.0 for c in d["checks"].values())
    assert {arm: t["n"] for arm, t in d["times_us"].items()} == {"selected": 2, "w8": 2, "selected#2": 2}
    assert set(d["vs_selected"]) == {"w8", "selected#2"}
    assert path.with_suffix(".md").is_file()
    for bad, msg in ((["--variant", "w8"], "expected NAME=JSON"), (["--variant", "w8={num_warps: 8}"], "is not JSON"),
                     (["--variant", "selected={\"num_warps\": 8}"], "other than 'selected'"),
                     (["--variant", 'a={"num_warps": 8}', "--variant", 'a={"num_warps": 2}'], "distinct"),
                     (["--variant", "a=[]"], "non-empty JSON object")):
        with pytest.raises(SystemExit):
            bc.main(["--kernel", "rmsnorm_fwd", "model=tiny", "--out", str(tmp_path), *bad])
        assert msg in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bc.main(["--kernel", "nope", "model=tiny", "--out", str(tmp_path)])
    assert "unknown kernels ['nope']" in capsys.readouterr().err
    rc = bc.main(["--kernel", "rmsnorm_fwd", "model=tiny", "--out", str(tmp_path / "bad"), "--variant",
                  'x={"no_such_key": 1}'])
    assert rc == 2 and "--variant x:" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_bench_configs_body_arms(tmp_path, capsys):
    """--body NAME=FILE:FUNC runs another Helion kernel on the kernel's inputs as arm NAME (selected config) and
    NAME+VARIANT (each variant over it), its outputs checked against the selected config's; a missing file, a name
    that is not a Helion kernel and a malformed spec fail before any run with one message."""
    from nano_hybrid.bench import bench_configs as bc

    body = tmp_path / "body.py"
    body.write_text("from kernels.rmsnorm_gated_helion import rmsnorm_gated_fwd_kernel as fwd\nnot_a_kernel = 3\n")
    out = tmp_path / "out"
    rc = bc.main(["--kernel", "rmsnorm_fwd", "model=tiny", "--variant", 'w8={"num_warps": 8}', "--body",
                  f"same={body}:fwd", "--rounds", "2", "--iters", "1", "--warmup", "0", "--out", str(out)])
    assert rc == 0
    (path,) = out.glob("configs_rmsnorm_fwd_*.json")
    d = json.loads(path.read_text())
    assert list(d["configs"]) == ["selected", "w8", "same", "same+w8", "selected#2"]
    assert d["configs"]["same"] == d["configs"]["selected"]
    assert d["configs"]["same+w8"] == d["configs"]["w8"]
    assert d["bodies"] == {"same": f"{body}:fwd"}
    assert all(c["bitwise_equal"] for c in d["checks"].values())
    assert set(d["times_us"]) == set(d["configs"])
    for spec, msg in ((f"x={tmp_path}/none.py:fwd", "no file"), (f"x={body}:not_a_kernel", "no Helion kernel"),
                      (f"x={body}:missing", "no Helion kernel")):
        rc = bc.main(["--kernel", "rmsnorm_fwd", "model=tiny", "--out", str(tmp_path / "bad"), "--body", spec])
        assert rc == 2 and msg in capsys.readouterr().err and not (tmp_path / "bad").exists()
    for bad, msg in ((["--body", "x"], "expected NAME=FILE:FUNC"), (["--body", f"w8={body}:fwd", "--variant",
                                                                     'w8={"num_warps": 8}'], "distinct")):
        with pytest.raises(SystemExit):
            bc.main(["--kernel", "rmsnorm_fwd", "model=tiny", "--out", str(tmp_path), *bad])
        assert msg in capsys.readouterr().err


def test_bench_configs_body_module_is_importable_by_name(tmp_path):
    """A --body file is loaded as module ``bench_configs_body_NAME`` and registered in sys.modules, where Helion's
    compiler looks up a kernel's globals (a body with a tunable fragment fails to compile otherwise); a file that
    fails to import leaves no module behind."""
    import sys

    from nano_hybrid.bench import bench_configs as bc

    body = tmp_path / "body.py"
    body.write_text("from kernels.rmsnorm_gated_helion import rmsnorm_gated_fwd_kernel as fwd\n")
    kernel = bc.load_body("reg", str(body), "fwd")
    mod = sys.modules.pop("bench_configs_body_reg")
    assert mod.fwd is kernel and mod.__file__ == str(body)
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no')\n")
    with pytest.raises(bc.VariantError, match="does not import: RuntimeError: no"):
        bc.load_body("broken", str(broken), "fwd")
    assert "bench_configs_body_broken" not in sys.modules
