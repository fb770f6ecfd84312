"""Bad input fails before any work with one ``error: ...`` line and exit code 2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nano_hybrid.errors import EXIT_BAD_INPUT
from nano_hybrid.train import main

REPO = Path(__file__).resolve().parent.parent

CASES = [
    (["train.no_such_key=1"], "bad config override"),
    (["model=no_such_model"], "bad config override"),
    (["recipe=no_such_recipe"], "unknown recipe"),
    (["--lr", "1"], "unexpected option"),
    (["train.micro_batch_size=0"], "train.micro_batch_size=0 must be a positive integer"),
    (["train.train_iters=abc"], "train.train_iters='abc' must be a positive integer"),
    (["train.micro_batch_size=4", "train.global_batch_size=6"], "train.global_batch_size=6 must be a multiple"),
    (["train.seq_length=100000"], "exceeds model.seq_length"),
    (["train.device=tpu"], "train.device='tpu'"),
    (["optim.decay_style=step"], "optim.decay_style='step'"),
    (["optim.min_lr=1.0"], "optim.min_lr=1.0 must be in"),
    (["optim.warmup_iters=1000"], "optim.warmup_iters=1000"),
    (["logger.wandb.mode=cloud"], "logger.wandb.mode='cloud'"),
    (["data.kind=parquet"], "data.kind must be"),
    (["data.tokenizer.type=gpt2"], "data.tokenizer.type"),
    (["model.vocab_size=128"], "the byte tokenizer has 258 ids but the model's embedding has 128"),
    (["data.paths=[/nonexistent/corpus]", "data.prepare_if_missing=null"], "data path not found: /nonexistent/corpus.bin/.idx"),
    (["data.paths=[/nonexistent/corpus]", "data.prepare_if_missing=web"], "data.prepare_if_missing='web'"),
    (["kernels.backend=cudnn"], "cudnn"),
    (["parallel=tp2"], "world"),
    # model dims that megatron or torch would only reject after start-up (a traceback, or a crash at the first step)
    (["model.mamba_chunk_size=0"], "model.mamba_chunk_size=0 must be a positive integer"),
    (["model.mamba_conv_width=-1"], "model.mamba_conv_width=-1 must be a positive integer"),
    (["model.mamba_num_groups=0"], "model.mamba_num_groups=0 must be a positive integer"),
    (["model.mamba_num_heads=7"], "model.mamba_num_heads=7 must be divisible by model.mamba_num_groups=2"),
    (["model.moe_router_topk=0"], "model.moe_router_topk=0 must be a positive integer"),
    (["model.make_vocab_size_divisible_by=0"], "model.make_vocab_size_divisible_by=0 must be a positive integer"),
    (["model.num_query_groups=3"], "model.num_attention_heads=4 must be divisible by model.num_query_groups=3"),
    (["model.hidden_size=250"], "use model.moe_experts_impl=sequential"),
    (["model.moe_ffn_hidden_size=254"], "the expert width 254 to be multiples of 8"),
    # values of the right type that torch, numpy or megatron would refuse only after start-up, or take silently
    (["optim.adam_beta1=1.5"], "optim.adam_beta1=1.5 must be < 1"),
    (["optim.adam_beta2=1.0"], "optim.adam_beta2=1.0 must be < 1"),
    (["optim.weight_decay=nan"], "optim.weight_decay=nan must be a finite number"),
    (["optim.clip_grad=nan"], "optim.clip_grad=nan must be a finite number"),
    (["optim.lr=inf"], "optim.lr=inf must be a finite number"),
    (["optim.adam_eps=inf"], "optim.adam_eps=inf must be a finite number"),
    (["seed=-1"], "seed=-1 must be in [0, 2**31)"),
    (["seed=4294967295"], "seed=4294967295 must be in [0, 2**31)"),
    (["run_dir="], "run_dir is empty"),
    (["model.init_method_std=-0.02"], "model.init_method_std=-0.02 must be > 0 and finite"),
    (["model.norm_epsilon=-1"], "model.norm_epsilon=-1 must be > 0 and finite"),
    (["model.hidden_dropout=1.5"], "model.hidden_dropout=1.5 must be in [0, 1)"),
    (["model.hybrid_override_pattern=''"], "model.hybrid_override_pattern is empty"),
    (["model.moe_router_load_balancing_type=bogus"], "model.moe_router_load_balancing_type='bogus'; choose one of"),
    (["model.moe_router_dtype=bogus"], "model.moe_router_dtype='bogus'; choose one of null, fp32, fp64"),
    (["model.moe_router_score_function=softmax", "model.moe_router_enable_expert_bias=true"],
     "megatron rejected model config 'tiny': Expert bias"),
    (["kernels.deterministic=maybe"], "kernels.deterministic='maybe' must be true or false"),
    (["checkpoint.save_on_exit=maybe"], "checkpoint.save_on_exit='maybe' must be true or false"),
    (["model.squared_relu=maybe"], "model.squared_relu='maybe' must be true or false"),
    (["kernels.helion.autotune_budget_s=inf"], "must be a finite number of seconds > 0"),
]


@pytest.mark.parametrize("overrides,message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_fails_before_work(overrides, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = main([f"run_dir={run_dir}", *overrides])  # an override may set run_dir itself
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == EXIT_BAD_INPUT
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert message in err[0], err[0]
    assert not run_dir.exists()  # nothing was started


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only checks")
@pytest.mark.parametrize(
    "overrides,message",
    [(["kernels.backend=mamba_ssm"], "mamba"), (["train.precision=bf16"], "needs a CUDA device"),
     (["train.device=cuda"], "no CUDA GPU")],
)
def test_gpu_only_settings_on_cpu(overrides, message, tmp_path, capsys):
    rc = main([*overrides, f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == EXIT_BAD_INPUT and len(err) == 1 and message in err[0], err


def test_command_line_exit_code_and_single_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(
        [sys.executable, "-m", "nano_hybrid.train", "data.paths=[/nonexistent/corpus]", "data.prepare_if_missing=null",
         f"run_dir={tmp_path / 'run'}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == EXIT_BAD_INPUT
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: data path not found: /nonexistent/corpus.bin/.idx"], p.stderr[-2000:]
    assert "Traceback" not in p.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["convergence_ab_h200", "convergence_ab_h200_2000", "convergence_ab_h200_2000_lowlr",
                                  "convergence_seeds_h200",
                                  "nano30b_slice_h200", "tiny_cpu"])
def test_every_recipe_composes_with_its_overrides(name):
    """Each committed recipe expands to overrides Hydra accepts, and they land in the config."""
    import yaml

    from nano_hybrid.config import compose, expand_recipe, list_recipes

    assert name in list_recipes()
    overrides = expand_recipe([f"recipe={name}"])
    cfg = compose([f"recipe={name}"])
    for o in overrides:
        key, _, value = o.partition("=")
        if "." in key and not key.startswith("+"):
            node = cfg
            for part in key.split("."):
                node = node[part]
            want = yaml.safe_load(value)
            assert node == want or str(node) == value, f"{name}: {key} is {node!r}, recipe says {value!r}"


def test_kernel_notices_show_as_one_line_and_library_noise_is_filtered():
    """After the trainer's start-up filter, a kernels notice is its own line (no file:line, no source line), other
    warnings keep Python's display, the known harmless ones are gone; warnings recorded (as pytest does) are whole."""
    code = """
import warnings
from nano_hybrid.errors import filter_startup_warnings
filter_startup_warnings(); filter_startup_warnings()
warnings.warn("nano_hybrid kernels: no tuned sm90 config for k at m4; using its default (said once per kernel)")
warnings.warn("max_num_sm_multipler is reduced from 128 to 16 due to the restriction of _SymmetricMemory")
warnings.warn("some other warning")
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    warnings.warn("nano_hybrid kernels: recorded")
assert [str(x.message) for x in w] == ["nano_hybrid kernels: recorded"] and w[0].category is UserWarning
"""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    assert lines[0] == "nano_hybrid kernels: no tuned sm90 config for k at m4; using its default (said once per kernel)"
    assert "max_num_sm_multipler" not in p.stderr
    assert any(line.endswith("UserWarning: some other warning") for line in lines[1:]), p.stderr


def test_an_override_wins_over_the_recipe_before_or_after_it():
    from nano_hybrid.config import compose

    base = int(compose(["recipe=tiny_cpu"]).train.micro_batch_size)
    for argv in (["train.micro_batch_size=3", "recipe=tiny_cpu"], ["recipe=tiny_cpu", "train.micro_batch_size=3"]):
        assert int(compose(argv).train.micro_batch_size) == 3 != base


@pytest.mark.parametrize("override,hint", [("modle=tiny", "did you mean model?"), ("sed=3", "did you mean seed?")])
def test_a_misspelt_top_level_key_or_group_gets_the_closest_name(override, hint, tmp_path, capsys):
    assert main([override, f"run_dir={tmp_path / 'run'}"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and err[0].endswith(hint), err


@pytest.mark.parametrize("module", ["train", "plan", "inspect"])
def test_help_prints_the_usage_and_the_config_groups(module, capsys):
    import importlib

    assert importlib.import_module(f"nano_hybrid.{module}").main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(importlib.import_module(f"nano_hybrid.{module}").__doc__.strip()[:40])
    assert "nano30b_slice" in out and "tiny_cpu" in out
