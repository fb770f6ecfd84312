"""The ``model`` and ``data`` groups' schema (nano_hybrid/schema.py ModelSchema, DataSchema): unknown and missing keys
fail before any work with one line naming the key; the shipped YAMLs compose to the configs they always did."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from omegaconf import OmegaConf

from nano_hybrid.config import CONFIG_DIR, ConfigError, compose, group_options, list_recipes
from nano_hybrid.errors import EXIT_BAD_INPUT
from nano_hybrid.model.config import MODEL_DEFAULTS, REQUIRED
from nano_hybrid.schema import DataSchema, ModelSchema, RunConfig, check_keys, defaults
from nano_hybrid.train import main

TINY = ["model=tiny", "train.seq_length=64", "train.micro_batch_size=2", "train.global_batch_size=2",
        "optim.warmup_iters=1", "logger.wandb.mode=disabled"]


def _one_error(capsys, rc: int, *needles: str) -> str:
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == EXIT_BAD_INPUT and len(err) == 1 and err[0].startswith("error: "), (rc, err)
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


@pytest.mark.parametrize("override, needle", [
    ("+model.foo=1", "model.foo is not a key"),
    ("+data.foo=1", "data.foo is not a key"),
    ("+model.hidden_sizes=1", "model.hidden_sizes is not a key; did you mean model.hidden_size?"),
    ("+data.num_worker=1", "data.num_worker is not a key; did you mean data.num_workers?"),
    ("+data.tokenizer.vocab=1", "data.tokenizer.vocab is not a key; did you mean data.tokenizer.vocab_size?"),
])
def test_an_unknown_key_is_one_line_before_any_work(override, needle, tmp_path, capsys):
    run = tmp_path / "run"
    _one_error(capsys, main([*TINY, override, f"run_dir={run}"]), needle)
    assert not run.exists()


def test_a_missing_required_model_key_is_one_line_naming_it(tmp_path, capsys):
    run = tmp_path / "run"
    _one_error(capsys, main([*TINY, "~model.hidden_size", f"run_dir={run}"]), "model.hidden_size is required")
    assert not run.exists()
    with pytest.raises(ConfigError, match=r"^model\.num_attention_heads is required"):
        check_keys(compose(["model=nano_proxy", "model.num_attention_heads=???"]))


def test_every_model_yaml_states_every_required_key():
    required = {f.name for f in dataclasses.fields(ModelSchema) if f.default == "???"}
    assert required == set(REQUIRED) >= {"name", "hybrid_override_pattern", "hidden_size", "num_attention_heads",
                                         "vocab_size", "seq_length"}
    for name in group_options("model"):
        data = yaml.safe_load((CONFIG_DIR / "model" / f"{name}.yaml").read_text())
        assert required <= set(data), name
        check_keys(compose([f"model={name}"]))


@pytest.mark.parametrize("group, schema", [("model", ModelSchema), ("data", DataSchema)])
def test_group_files_start_from_the_schema_and_hold_only_what_differs(group, schema):
    base = defaults(schema)
    for path in sorted((CONFIG_DIR / group).glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        order = data.pop("defaults")
        assert order[0] == "schema" and order[-1] == "_self_", path
        same = sorted(k for k, v in data.items() if k in base and base[k] == v)
        assert not same, f"{path} restates schema defaults {same}"
        assert set(data) <= set(base), f"{path} has keys the schema lacks: {sorted(set(data) - set(base))}"


def test_the_code_reads_the_schemas_defaults():
    """The one place of each default: the readers of a plain mapping fill in the schema's values."""
    assert MODEL_DEFAULTS == {k: v for k, v in defaults(ModelSchema).items() if k not in REQUIRED}
    assert (MODEL_DEFAULTS["make_vocab_size_divisible_by"], MODEL_DEFAULTS["mamba_num_groups"],
            MODEL_DEFAULTS["lm_head_loss"], MODEL_DEFAULTS["recompute_modules"]) == (128, 8, "plain", ["moe", "layernorm"])


# What the model and data groups composed to before they had a schema (the YAMLs stated every key): each
# composed config holds exactly these keys with these values (plus data.corpus_dir, null outside data=corpus).
NANO_COMMON = {
    "make_vocab_size_divisible_by": 128, "untie_embeddings_and_output_weights": True, "position_embedding_type": "none",
    "norm_epsilon": 1e-5, "hidden_dropout": 0.0, "attention_dropout": 0.0, "mamba_head_dim": 64,
    "mamba_state_dim": 128, "mamba_num_groups": 8, "mamba_chunk_size": 128, "mamba_conv_width": 4,
    "mamba_fused_norm": False, "squared_relu": True, "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
    "moe_router_bias_update_rate": 1e-3, "moe_router_topk_scaling_factor": 2.5, "moe_router_dtype": "fp32",
    "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 1e-4,
    "moe_token_dispatcher_type": "allgather", "attention_impl": "sdpa", "moe_experts_impl": "grouped",
    "use_cpu_initialization": False, "recompute": "none", "recompute_modules": ["moe", "layernorm"],
    "lm_loss_chunk_tokens": 4096,
}
NANO30B = {**NANO_COMMON, "name": "nano30b",
           "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", "hidden_size": 2688,
           "ffn_hidden_size": 1856, "vocab_size": 131072, "seq_length": 8192, "init_method_std": 0.0173,
           "mamba_num_heads": 64, "num_attention_heads": 32, "num_query_groups": 2, "kv_channels": 128,
           "num_moe_experts": 128, "moe_router_topk": 6, "moe_ffn_hidden_size": 1856,
           "moe_shared_expert_intermediate_size": 3712, "lm_head_loss": "chunked_compiled"}
BEFORE = {
    "nano30b": NANO30B,
    "nano30b_slice": {**NANO30B, "name": "nano30b_slice", "hybrid_override_pattern": "MEMEM*EMEMEM*",
                      "num_moe_experts": 32},
    "nano_proxy": {**NANO_COMMON, "name": "nano_proxy", "hybrid_override_pattern": "MEMEM*EME", "hidden_size": 512,
                   "ffn_hidden_size": 256, "vocab_size": 131072, "seq_length": 4096, "init_method_std": 0.02,
                   "mamba_num_heads": 16, "num_attention_heads": 8, "num_query_groups": 2, "kv_channels": 64,
                   "num_moe_experts": 16, "moe_router_topk": 4, "moe_ffn_hidden_size": 256,
                   "moe_shared_expert_intermediate_size": 512, "lm_head_loss": "chunked_compiled"},
    "tiny": {**NANO_COMMON, "name": "tiny", "hybrid_override_pattern": "MEM*E", "hidden_size": 256,
             "ffn_hidden_size": 512, "vocab_size": 512, "seq_length": 256, "init_method_std": 0.02,
             "mamba_num_heads": 8, "mamba_head_dim": 32, "mamba_state_dim": 32, "mamba_num_groups": 2,
             "mamba_chunk_size": 64, "num_attention_heads": 4, "num_query_groups": 2, "kv_channels": 64,
             "num_moe_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 256,
             "moe_shared_expert_intermediate_size": 512, "lm_head_loss": "plain"},
}
BYTE_TOKENIZER = {"type": "byte", "path": None, "vocab_size": None, "num_special_tokens": 1000, "pattern": "v2"}
BPE_TOKENIZER = {"type": "tiktoken", "path": "data/tokenizers/tekken_131k.json", "vocab_size": 131072,
                 "num_special_tokens": 1000, "pattern": "v2"}
DATA_DEFAULT = {"kind": "indexed", "paths": ["data/stdlib/stdlib"], "weights": None, "split": "969,30,1",
                "valid_paths": None, "valid_seed": None, "tokenizer": BYTE_TOKENIZER, "prepare_if_missing": "stdlib",
                "prepare_workers": 1, "cache_dir": None, "num_workers": 0, "corpus_dir": None}
DATA_BEFORE = {
    "default": DATA_DEFAULT,
    "stdlib_bpe131k": {**DATA_DEFAULT, "paths": ["data/stdlib_bpe131k/stdlib"], "tokenizer": BPE_TOKENIZER,
                       "prepare_workers": 4},
    "mock": {**DATA_DEFAULT, "kind": "mock", "paths": [], "split": None, "prepare_if_missing": None},
    "corpus": {**DATA_DEFAULT, "corpus_dir": "data/corpus/site", "paths": ["data/corpus/site/train"],
               "valid_paths": ["data/corpus/site/valid"], "split": "100,0,0", "valid_seed": 1234,
               "tokenizer": BPE_TOKENIZER, "prepare_if_missing": None},
}


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_each_model_yaml_composes_to_the_config_it_always_did(name):
    assert sorted(group_options("model")) == sorted(BEFORE)
    cfg = compose([f"model={name}"])
    assert OmegaConf.to_container(cfg.model, resolve=True) == BEFORE[name]
    data = "default" if name == "tiny" else "stdlib_bpe131k"  # the Nano models' default data
    assert OmegaConf.to_container(cfg.data, resolve=True) == DATA_BEFORE[data]


@pytest.mark.parametrize("name", sorted(DATA_BEFORE))
def test_each_data_yaml_composes_to_the_config_it_always_did(name):
    assert sorted(group_options("data")) == sorted(DATA_BEFORE)
    cfg = compose([f"data={name}"])
    assert OmegaConf.to_container(cfg.data, resolve=True) == DATA_BEFORE[name]


RECIPE_MODEL = {"convergence_ab_h200": ("nano30b_slice", {"hybrid_override_pattern": "MEM*E"}, "stdlib_bpe131k"),
                "convergence_ab_h200_2000": ("nano30b_slice", {"hybrid_override_pattern": "MEM*E"}, "stdlib_bpe131k"),
                "convergence_ab_h200_2000_lowlr": ("nano30b_slice", {"hybrid_override_pattern": "MEM*E"},
                                                   "stdlib_bpe131k"),
                "convergence_seeds_h200": ("nano_proxy", {"lm_head_loss": "chunked"}, "corpus"),
                "nano30b_slice_h200": ("nano30b_slice", {}, "stdlib_bpe131k"),
                "tiny_cpu": ("tiny", {}, "default")}


@pytest.mark.parametrize("recipe", sorted(RECIPE_MODEL))
def test_each_recipe_composes_to_the_model_and_data_it_always_did(recipe):
    assert sorted(list_recipes()) == sorted(RECIPE_MODEL)
    model, changed, data = RECIPE_MODEL[recipe]
    cfg = compose([f"recipe={recipe}"])
    check_keys(cfg)
    assert OmegaConf.to_container(cfg.model, resolve=True) == {**BEFORE[model], **changed}
    assert OmegaConf.to_container(cfg.data, resolve=True) == DATA_BEFORE[data]
    run = RunConfig.from_cfg(cfg)
    assert run.model.name == model and run.data.tokenizer.type == DATA_BEFORE[data]["tokenizer"]["type"]
