"""The Hugging Face bridge against transformers' ``NemotronHForCausalLM`` (pure-PyTorch path, CPU, fp32).

- export (model=tiny, and a config with every layer kind M * - E and 6 experts): transformers' logits on
  the same tokens agree (max abs diff < 5e-4, argmax 100%); a deliberately wrong mapping fails that check;
- HF -> ours -> HF is bitwise; ours -> HF -> ours trains with the same losses (bitwise) as the run the
  weights came from, and a trained checkpoint's export re-imports bitwise;
- model=nano30b's config.json equals the published Nemotron-3 Nano 30B-A3B config in every architecture field;
- TP2 and EP2 (2 gloo ranks): import slices every tensor right (same loss as one process), the checkpoint
  those ranks save exports back to the imported tensors bitwise;
- bad input: a config mismatch stops ``nano_hybrid.train`` with one line naming the field (exit 2); the
  export CLI refuses a missing checkpoint the same way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from gloo_ranks import spawn_ranks

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

from nano_hybrid.config import compose  # noqa: E402
from nano_hybrid.hf import export_model, load_hf_weights  # noqa: E402
from nano_hybrid.hf import mapping as hf_mapping  # noqa: E402
from nano_hybrid.hf.bridge import export_checkpoint  # noqa: E402
from nano_hybrid.hf.config import ARCH_FIELDS, hf_config  # noqa: E402
from nano_hybrid.hf.io import LazyHFTensors, NormalizedHFTensors, model_global_tensors, read_checkpoint_tensors  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TINY = ["model=tiny", "kernels.backend=torch", "parallel=single"]
# every layer kind (Mamba, attention, dense MLP, MoE) and 6 routed experts, top-3
ALL_KINDS = TINY + ["model.name=allkinds", "model.hybrid_override_pattern=M*-EME", "model.num_moe_experts=6",
                    "model.moe_router_topk=3", "model.ffn_hidden_size=384"]
TRAIN = ["model=tiny", "data=mock", "kernels.backend=torch", "train.seq_length=64", "train.micro_batch_size=2",
         "train.global_batch_size=4", "optim.warmup_iters=1", "train.torch_threads=1", "seed=1234",
         "train.train_iters=3", "checkpoint.interval=0", "logger.wandb.mode=disabled"]

# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json (architecture fields; values as published, see
# shared/reference/nemotron3_nano_facts.md section 1)
PUBLISHED_NANO = {
    "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", "num_hidden_layers": 52,
    "hidden_size": 2688, "vocab_size": 131072, "tie_word_embeddings": False,
    "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
    "chunk_size": 128, "use_conv_bias": True, "mamba_hidden_act": "silu", "mamba_proj_bias": False, "expand": 2,
    "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 0.0001, "mamba_ssm_cache_dtype": "float32",
    "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "attention_bias": False,
    "intermediate_size": 1856, "mlp_hidden_act": "relu2", "mlp_bias": False, "use_bias": False,
    "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "layer_norm_epsilon": 1e-05, "norm_eps": 1e-05,
    "residual_in_fp32": False, "rescale_prenorm_residual": True, "attention_dropout": 0.0, "hidden_dropout": 0.0,
}


def _tokens(b=2, s=64, vocab=256, seed=0):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def _perturb(model, seed=1):
    """Give the 1-D weights (norms, A_log, D, dt_bias, conv bias) and the expert bias non-default values,
    so a mapping that swaps or drops them shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
        for n, b in model.named_buffers():
            if n.endswith("expert_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def _our_logits(model, tok):
    pos = torch.arange(tok.shape[1])[None].expand_as(tok)
    with torch.no_grad():
        return model(tok, pos, None).float()


def _hf_model(folder):
    from transformers import NemotronHForCausalLM

    m, info = NemotronHForCausalLM.from_pretrained(folder, dtype=torch.float32, use_mamba_kernels=False,
                                                   output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return m.eval()


def _hf_logits(folder, tok):
    with torch.no_grad():
        return _hf_model(folder)(tok).logits.float()


def _agreement(a, b) -> dict:
    return {"max_abs": (a - b).abs().max().item(), "argmax": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}


def assert_logits_match(ours, theirs):
    r = _agreement(ours, theirs)
    assert r["max_abs"] < 5e-4 and r["argmax"] == 1.0, r
    return r


@pytest.fixture(scope="module")
def single():
    """One-process megatron state; the models are built under it."""
    from megatron.core import parallel_state as ps

    from nano_hybrid.parallel import destroy_parallel, initialize_parallel

    created = not ps.model_parallel_is_initialized()
    initialize_parallel(compose(TINY))
    yield
    if created:
        destroy_parallel()


def _build(overrides, seed=1):
    from nano_hybrid.model import build_model

    cfg = compose(overrides)
    model = build_model(cfg)
    _perturb(model, seed)
    return cfg, model.eval()


@pytest.fixture(scope="module")
def exported(single, tmp_path_factory):
    """model=tiny and the all-kinds model, each exported in fp32: {name: (cfg, model, folder)}."""
    out = {}
    for name, ov in (("tiny", TINY), ("allkinds", ALL_KINDS)):
        cfg, model = _build(ov)
        folder = tmp_path_factory.mktemp("hf") / name
        export_model(model, cfg, folder, dtype="fp32")
        out[name] = (cfg, model, folder)
    return out


@pytest.mark.parametrize("name", ["tiny", "allkinds"])
def test_export_matches_transformers(exported, name):
    cfg, model, folder = exported[name]
    conf = json.loads((folder / "config.json").read_text())
    assert conf["model_type"] == "nemotron_h" and conf["hybrid_override_pattern"] == cfg.model.hybrid_override_pattern
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    tok = _tokens()
    assert_logits_match(_our_logits(model, tok), _hf_logits(folder, tok))


def test_exported_tokenizer_encodes_bytes(exported):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(exported["tiny"][2])
    text = "def f(x):\n    return 'é' + x  # ok\n"
    assert tok(text)["input_ids"] == list(text.encode("utf-8"))
    assert tok.eos_token_id == 256 and tok.pad_token_id == 257
    assert tok.decode(list(text.encode("utf-8"))) == text


def test_tiktoken_tokenizer_converts_exactly(tmp_path):
    """A Megatron TikTokenizer file (10 special ids, 256 bytes and some merges) written as tokenizer.json:
    AutoTokenizer gives megatron's ids for every text, special tokens included, and decodes back."""
    import base64

    from transformers import AutoTokenizer

    from nano_hybrid.data import TokenizerSpec, build_tokenizer
    from nano_hybrid.hf.tokenizer import write_tokenizer_files

    merged = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"  ", b"    ", b"re", b"turn", b"ur", b"rn",
              b"tu", b"retu", b"return", b"\xc3\xa9", b"de", b"def", b"ef"]
    ranks = [bytes([i]) for i in range(256)] + merged
    (tmp_path / "bpe.json").write_text(json.dumps([
        {"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("utf-8", "replace")}
        for i, t in enumerate(ranks)]))
    spec = TokenizerSpec.from_cfg({"type": "tiktoken", "path": str(tmp_path / "bpe.json"), "vocab_size": 10 + len(ranks),
                                   "num_special_tokens": 10, "pattern": "v2"})
    ours = build_tokenizer(spec)
    files, note = write_tokenizer_files(spec, ours, tmp_path)
    assert note is None and "tokenizer.json" in files
    hf = AutoTokenizer.from_pretrained(tmp_path)
    texts = ["def the(): return thing\n    the é  ", "x</s>y <s> <SPECIAL_9> 😀\r\n\tturn retu", " " * 9 + "inning"]
    for text in texts:
        ids = ours.tokenize(text)
        assert hf(text, add_special_tokens=False)["input_ids"] == ids, text
        assert hf.decode(ids) == text
    assert any(i >= 10 + 256 for i in ours.tokenize(texts[0]))  # merges were used
    assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id) == (ours.eod, ours.pad, ours.bos) == (2, 4, 1)


def test_wrong_mapping_fails(exported, tmp_path, monkeypatch):
    """Attention q/k/v taken as three contiguous blocks (not megatron's per-group interleave), and a config
    with the MoE scaling factor left at 1.0: both must fail the logits check."""
    cfg, model, _ = exported["tiny"]
    tok = _tokens()
    ours = _our_logits(model, tok)

    def contiguous_qkv(w, a):
        hd = a.kv_channels
        return torch.split(w, [a.num_attention_heads * hd, a.num_query_groups * hd, a.num_query_groups * hd], 0)

    monkeypatch.setattr(hf_mapping, "_qkv_split", contiguous_qkv)
    export_model(model, cfg, tmp_path / "qkv", dtype="fp32")
    with pytest.raises(AssertionError):
        assert_logits_match(ours, _hf_logits(tmp_path / "qkv", tok))
    monkeypatch.undo()

    export_model(model, cfg, tmp_path / "scale", dtype="fp32")
    conf_file = tmp_path / "scale" / "config.json"
    conf = json.loads(conf_file.read_text())
    conf["routed_scaling_factor"] = 1.0
    conf_file.write_text(json.dumps(conf))
    with pytest.raises(AssertionError):
        assert_logits_match(ours, _hf_logits(tmp_path / "scale", tok))


def test_hf_to_ours_to_hf_is_bitwise(single, tmp_path):
    """A folder written by transformers (its own layout: ``model.`` prefix, 3-D experts) -> our model ->
    export: every tensor bitwise equal (fp32), and the bf16 default export is the bf16 rounding of it."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from nano_hybrid.model import build_model

    cfg = compose(ALL_KINDS)
    conf = hf_config(dict(cfg.model), 512, dtype="float32")
    torch.manual_seed(3)
    hf = NemotronHForCausalLM(NemotronHConfig(**{k: v for k, v in conf.items() if k != "architectures"}))
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.5 if p.dim() == 1 else 0.02))
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.05)
    hf.save_pretrained(tmp_path / "orig")
    model = build_model(cfg)
    load_hf_weights(model, tmp_path / "orig", cfg)
    export_model(model, cfg, tmp_path / "fp32", dtype="fp32")
    export_model(model, cfg, tmp_path / "bf16")
    orig = NormalizedHFTensors(LazyHFTensors(tmp_path / "orig"))
    fp32 = LazyHFTensors(tmp_path / "fp32")
    bf16 = LazyHFTensors(tmp_path / "bf16")
    assert set(fp32) == set(orig) == set(bf16) and len(orig) > 40
    for k in orig:
        assert fp32[k].dtype == orig[k].dtype and torch.equal(fp32[k], orig[k]), k
        want = orig[k] if k.endswith("e_score_correction_bias") else orig[k].to(torch.bfloat16)
        assert bf16[k].dtype == want.dtype and torch.equal(bf16[k], want), k
    tok = _tokens()
    with torch.no_grad():
        assert_logits_match(_our_logits(model.eval(), tok), hf.eval()(tok).logits.float())


def test_nano30b_config_equals_published(single):
    from transformers import NemotronHConfig

    from nano_hybrid.model.config import padded_vocab_size

    cfg = compose(["model=nano30b", "kernels.backend=torch"])
    m = dict(cfg.model)
    ours = hf_config(m, padded_vocab_size(int(m["vocab_size"]), int(m["make_vocab_size_divisible_by"]), 1))
    diff = {k: (ours.get(k), v) for k, v in PUBLISHED_NANO.items() if ours.get(k) != v}
    assert not diff, diff
    assert set(ARCH_FIELDS) <= set(PUBLISHED_NANO)
    loaded = NemotronHConfig(**{k: v for k, v in ours.items() if k != "architectures"})
    assert loaded.hybrid_override_pattern == PUBLISHED_NANO["hybrid_override_pattern"]
    assert loaded.num_hidden_layers == 52 and loaded.layers_block_type.count("moe") == 23


def test_config_mismatch_stops_with_one_line(exported, capsys):
    from nano_hybrid import train

    folder = exported["tiny"][2]
    rc = train.main([*TRAIN, f"checkpoint.init_from_hf={folder}", "model.num_moe_experts=4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: ") and "n_routed_experts: folder has 8, this run has 4" in err[0], err
    rc = train.main([*TRAIN, f"checkpoint.init_from_hf={folder}/nowhere"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "no config.json" in err[0], err


def test_init_from_hf_refuses_non_finite_or_damaged_weights_in_one_line(exported, tmp_path):
    """A NaN in one tensor of the folder, or a truncated safetensors file: one HFBridgeError naming the folder (and
    the tensor), not weights that train into NaN or a safetensors traceback."""
    import shutil

    from safetensors.torch import load_file, save_file

    from nano_hybrid.hf import HFBridgeError

    cfg, _, folder = exported["tiny"]
    _, model = _build(TINY)
    nan = tmp_path / "nan"
    shutil.copytree(folder, nan)
    (st,) = sorted(nan.glob("*.safetensors"))
    tensors = load_file(st)
    name = next(k for k in sorted(tensors) if "embeddings" in k)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, st, metadata={"format": "pt"})
    with pytest.raises(HFBridgeError, match=r"init_from_hf=.*nan: non-finite values in the weights of embedding"):
        load_hf_weights(model, nan, cfg)
    cut = tmp_path / "cut"
    shutil.copytree(folder, cut)
    (st,) = sorted(cut.glob("*.safetensors"))
    st.write_bytes(st.read_bytes()[:100])
    with pytest.raises(HFBridgeError, match=r"init_from_hf=.*cut: unreadable weights \(SafetensorError"):
        load_hf_weights(model, cut, cfg)


def test_export_cli_refuses_missing_checkpoint(tmp_path, capsys):
    from nano_hybrid import export_hf

    assert export_hf.main([str(tmp_path / "none"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "no such checkpoint" in err[0], err


# ----------------------------------------------------------------------------------- training runs
def _train(run_dir: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_SILENT="true")
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "nano_hybrid.train", *TRAIN, f"run_dir={run_dir}", *extra],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_ours_to_hf_to_ours_trains_with_the_same_losses(single, tmp_path):
    """R: a fresh run (3 steps). S: the same run started from R's initial weights exported to HF
    (``checkpoint.init_from_hf``): the same losses, bitwise. R's trained checkpoint exported and
    imported again gives R's tensors bitwise, and transformers' logits of the export match ours."""
    from nano_hybrid.model import build_model
    from nano_hybrid.parallel import initialize_parallel

    cfg = compose(TRAIN)
    initialize_parallel(cfg)  # the seeds of the run: build_model draws R's initial weights
    export_model(build_model(cfg), cfg, tmp_path / "init", dtype="fp32")
    procs = {"R": _train(tmp_path / "R"), "S": _train(tmp_path / "S", f"checkpoint.init_from_hf={tmp_path / 'init'}")}
    for name, p in procs.items():
        assert p.wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    assert "init_from_hf: " in (tmp_path / "S.log").read_text()
    assert _losses(tmp_path / "S") == _losses(tmp_path / "R") and len(_losses(tmp_path / "R")) == 3

    ckpt = tmp_path / "R" / "checkpoints" / "iter_0000003"
    export_checkpoint(tmp_path / "R", tmp_path / "trained", dtype="fp32", max_shard_bytes=4_000_000)
    shards = sorted(p.name for p in (tmp_path / "trained").glob("*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors", shards
    model = build_model(cfg)
    load_hf_weights(model, tmp_path / "trained", cfg)
    got = model_global_tensors([model])
    want = read_checkpoint_tensors(ckpt, list(got))
    for k in got:
        assert torch.equal(got[k], want[k]), k
    tok = _tokens()
    assert_logits_match(_our_logits(model.eval(), tok), _hf_logits(tmp_path / "trained", tok))


# ------------------------------------------------------------------------------------ TP2 and EP2
def _layout_worker(rank, world, hf_folder, out_dir):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    from nano_hybrid.checkpoint import save_checkpoint
    from nano_hybrid.model import build_model
    from nano_hybrid.parallel import destroy_parallel, initialize_parallel
    from nano_hybrid.trainer import TrainState

    for layout in ("tp2", "ep2"):
        cfg = compose([*TRAIN, f"parallel={layout}", f"run_dir={out_dir}/{layout}"])
        initialize_parallel(cfg)
        model = build_model(cfg)
        load_hf_weights(model, hf_folder, cfg)
        tok = _tokens(s=32)
        pos = torch.arange(32)[None].expand_as(tok)
        with torch.no_grad():
            loss = model.eval()(tok, pos, None, labels=tok).float().mean().item()
        save_checkpoint(Path(out_dir) / layout / "checkpoints", TrainState(step=1), model, config=cfg, model_name="tiny")
        if rank == 0:
            (Path(out_dir) / f"{layout}.json").write_text(json.dumps({"loss": loss}))
        ps.destroy_model_parallel()
    destroy_parallel()


def test_import_and_export_under_tp2_and_ep2(exported, tmp_path):
    cfg, model, folder = exported["tiny"]
    spawn_ranks(_layout_worker, 2, str(folder), str(tmp_path))
    tok = _tokens(s=32)
    with torch.no_grad():
        ref = model(tok, torch.arange(32)[None].expand_as(tok), None, labels=tok).float().mean().item()
    orig = LazyHFTensors(folder)
    for layout in ("tp2", "ep2"):
        loss = json.loads((tmp_path / f"{layout}.json").read_text())["loss"]
        assert abs(loss - ref) < 1e-5 * abs(ref), (layout, loss, ref)
        export_checkpoint(tmp_path / layout, tmp_path / f"{layout}-hf", dtype="fp32")
        back = LazyHFTensors(tmp_path / f"{layout}-hf")
        assert set(back) == set(orig)
        for k in orig:
            assert torch.equal(back[k], orig[k]), (layout, k)
        conf = json.loads((tmp_path / f"{layout}-hf" / "config.json").read_text())
        assert conf == json.loads((folder / "config.json").read_text())
