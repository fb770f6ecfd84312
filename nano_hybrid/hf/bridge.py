"""Export to and import from Hugging Face Nemotron-H folders.

- :func:`export_checkpoint`: a saved checkpoint (any TP/EP/PP/DP layout) -> HF folder, streamed one
  layer at a time (the global tensors are read straight from the ``torch_dist`` files; no model is
  built, no process group, no GPU), so the 30B model exports with one layer in memory.
- :func:`export_model`: the same from a model in memory whose tensors are whole (one process, TP=EP=PP=1).
- :func:`load_hf_weights`: ``checkpoint.init_from_hf``: every rank copies its own slice of each HF tensor
  into its parameters (megatron's sharded state dict says which slice), before the optimizer exists.
- :func:`check_init_from_hf`: the folder's ``config.json`` against the run's config, before any work.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from nano_hybrid.arch import HybridArch
from nano_hybrid.errors import RunError
from nano_hybrid.hf.config import first_mismatch, hf_config
from nano_hybrid.hf.io import (
    DEFAULT_SHARD_BYTES,
    LazyHFTensors,
    NormalizedHFTensors,
    ShardWriter,
    checkpoint_model_tensors_meta,
    model_global_tensors,
    read_checkpoint_tensors,
    sharded_tensors,
)
from nano_hybrid.hf.mapping import HF_PREFIX, MappingError, check_all_used, hf_to_mcore_global, mcore_global_to_hf

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# kept in fp32 whatever the export dtype (transformers keeps it fp32: _keep_in_fp32_modules_strict)
FP32_TENSORS = ("e_score_correction_bias",)
_END_KEYS = ("embedding.word_embeddings.weight", "decoder.final_norm.weight", "output_layer.weight")
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")


class HFBridgeError(RunError):
    """Bad input for export/import (path, config, tensors); one-line message (a run stops with exit 2)."""


def _model_dict(cfg) -> dict:
    from nano_hybrid.model.config import model_dict

    return model_dict(cfg.model if "model" in cfg else cfg)


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(torch.float32) if name.endswith(FP32_TENSORS) else t.to(dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]


def _write_config_and_tokenizer(out: Path, m: dict, vocab: int, dtype: torch.dtype, run_cfg, log=print) -> list[str]:
    """config.json with the tokenizer's token ids, and the tokenizer files (when the run's tokenizer is
    available here; otherwise one line says so)."""
    from nano_hybrid.data import TokenizerSpec, build_tokenizer
    from nano_hybrid.hf.tokenizer import token_ids, write_tokenizer_files

    tok, files, note = None, [], None
    tok_cfg = OmegaConf.select(run_cfg, "data.tokenizer") if run_cfg is not None else None
    if tok_cfg is None:
        note = "the run's config has no data.tokenizer"
    else:
        try:
            spec = TokenizerSpec.from_cfg(tok_cfg)
            tok = build_tokenizer(spec)
        except ValueError as e:
            note = f"the run's tokenizer is not available here ({e})"
    ids = token_ids(tok) if tok is not None else {}
    conf = hf_config(m, vocab, dtype=_dtype_name(dtype), token_ids=ids)
    (out / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    if tok is not None:
        files, note = write_tokenizer_files(spec, tok, out)
    if note:
        log(f"[export_hf] tokenizer: {note}")
    return files


def check_out_dir(out_dir: str | Path) -> Path:
    """Refuse an export folder that is an existing file, a non-empty folder or lies under a file (one line)."""
    out = Path(out_dir)
    if out.is_dir():
        if any(out.iterdir()):
            raise HFBridgeError(f"{out} exists and is not empty (choose a new folder)")
    elif out.exists():
        raise HFBridgeError(f"{out} is an existing file (choose a new folder)")
    else:
        above = next(p for p in out.absolute().parents if p.exists())
        if not above.is_dir():
            raise HFBridgeError(f"{out}: {above} is a file, not a folder (choose a new folder)")
    return out


def _prepare_out(out_dir: str | Path) -> Path:
    out = check_out_dir(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HFBridgeError(f"{out}: cannot create the folder ({e.strerror})") from None
    return out


# -------------------------------------------------------------------------------------- export
def resolve_checkpoint(path: str | Path) -> Path:
    """An ``iter_*`` checkpoint, a checkpoints folder (its newest complete one) or a run folder."""
    from nano_hybrid.checkpoint import REFUSE_FRESH, CheckpointError, resolve_load_path

    p = Path(path)
    if not p.exists():
        raise HFBridgeError(f"{path}: no such checkpoint, checkpoints folder or run folder")
    if (p / "checkpoints").is_dir() and not (p / "nano_hybrid_checkpoint.json").is_file():
        p = p / "checkpoints"
    try:
        found = resolve_load_path(str(p), p)
    except CheckpointError as e:
        raise HFBridgeError(str(e).replace("checkpoint.load=", "").replace(REFUSE_FRESH, "")) from None
    if found is None:
        raise HFBridgeError(f"{path}: no complete checkpoint")
    if not (found / "config.yaml").is_file():
        raise HFBridgeError(f"{found}: no config.yaml (the run's config is needed for config.json)")
    return found


def export_checkpoint(ckpt: str | Path, out_dir: str | Path, *, dtype: str = "bf16",
                      max_shard_bytes: int = DEFAULT_SHARD_BYTES, log=print) -> Path:
    """Write the HF folder for a saved checkpoint; returns the folder."""
    if dtype not in DTYPES:
        raise HFBridgeError(f"dtype {dtype!r}; choose bf16 or fp32")
    check_out_dir(out_dir)
    t0 = time.perf_counter()
    path = resolve_checkpoint(ckpt)
    run_cfg = OmegaConf.load(path / "config.yaml")
    m = _model_dict(run_cfg)
    a = HybridArch.from_model_cfg(m)
    meta = checkpoint_model_tensors_meta(path)
    if "embedding.word_embeddings.weight" not in meta:
        raise HFBridgeError(f"{path}: no embedding.word_embeddings.weight among the checkpoint's tensors")
    vocab = meta["embedding.word_embeddings.weight"][0][0]
    hf_config(m, vocab)  # unsupported architectures fail before anything is written
    out = _prepare_out(out_dir)
    target = DTYPES[dtype]
    by_layer: dict[int, list[str]] = {}
    for k in meta:
        mt = _LAYER_RE.match(k)
        if mt:
            by_layer.setdefault(int(mt.group(1)), []).append(k)
    used: set = set()
    writer = ShardWriter(out, max_shard_bytes)
    ends = read_checkpoint_tensors(path, [k for k in _END_KEYS if k in meta], meta)
    writer.add({n: _cast(n, t, target) for n, t in mcore_global_to_hf(ends, a, layers=[], used=used).items()})
    for i in range(a.num_layers):
        src = read_checkpoint_tensors(path, by_layer.get(i, []), meta)
        writer.add({n: _cast(n, t, target) for n, t in mcore_global_to_hf(src, a, layers=[i], ends=False, used=used).items()})
    check_all_used(meta, used, "checkpoint")
    shards = writer.close()
    tok_files = _write_config_and_tokenizer(out, m, vocab, target, run_cfg, log)
    log(f"[export_hf] {path} -> {out}: {len(shards)} shard(s), {writer.total_bytes / 1e9:.3f} GB {dtype}"
        f"{', tokenizer ' + ', '.join(tok_files) if tok_files else ''} in {time.perf_counter() - t0:.1f}s")
    log("[export_hf] transformers runs the Mamba layers with mamba-ssm and causal-conv1d when they are installed; "
        "without them it logs '... falling back to its reference PyTorch implementation' (the same outputs, slower)")
    return out


def export_model(model_chunks, cfg, out_dir: str | Path, *, dtype: str = "bf16",
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write the HF folder for a model in memory (every tensor whole on this process)."""
    if dtype not in DTYPES:
        raise HFBridgeError(f"dtype {dtype!r}; choose bf16 or fp32")
    check_out_dir(out_dir)
    from megatron.core.utils import unwrap_model

    chunks = [unwrap_model(c) for c in (model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks])]
    m = _model_dict(cfg)
    a = HybridArch.from_model_cfg(m)
    src = model_global_tensors(chunks)
    vocab = src["embedding.word_embeddings.weight"].shape[0]
    hf_config(m, vocab)
    out = _prepare_out(out_dir)
    target = DTYPES[dtype]
    writer = ShardWriter(out, max_shard_bytes)
    writer.add({n: _cast(n, t, target) for n, t in mcore_global_to_hf(src, a).items()})
    writer.close()
    _write_config_and_tokenizer(out, m, vocab, target, cfg if "data" in cfg else None)
    return out


# -------------------------------------------------------------------------------------- import
def hf_tensor_names(a: HybridArch) -> set[str]:
    """Every tensor name of the published HF layout for architecture ``a``."""
    names = {f"{HF_PREFIX}embeddings.weight", f"{HF_PREFIX}norm_f.weight"}
    if not a.tied_embeddings:
        names.add("lm_head.weight")
    per = {
        "M": [f"mixer.{n}" for n in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
                                      "norm.weight", "out_proj.weight")],
        "*": [f"mixer.{n}_proj.weight" for n in "qkvo"],
        "E": ["mixer.gate.weight", "mixer.gate.e_score_correction_bias", "mixer.shared_experts.up_proj.weight",
              "mixer.shared_experts.down_proj.weight"]
        + [f"mixer.experts.{e}.{n}.weight" for e in range(a.num_moe_experts) for n in ("up_proj", "down_proj")],
        "-": ["mixer.up_proj.weight", "mixer.down_proj.weight"],
    }
    for i, s in enumerate(a.hybrid_override_pattern):
        names.add(f"{HF_PREFIX}layers.{i}.norm.weight")
        names.update(f"{HF_PREFIX}layers.{i}.{n}" for n in per[s])
    return names


def read_hf_config(folder: str | Path) -> dict:
    f = Path(folder) / "config.json"
    if not f.is_file():
        raise HFBridgeError(f"checkpoint.init_from_hf={folder}: no config.json there")
    return json.loads(f.read_text())


def check_init_from_hf(cfg, folder: str | Path) -> None:
    """Raise HFBridgeError naming the first architecture field where ``folder/config.json`` differs
    from the run (``cfg.model`` with the vocab padded for ``cfg.parallel``)."""
    from nano_hybrid.model.config import padded_vocab_size

    m = _model_dict(cfg)
    vocab = padded_vocab_size(int(m["vocab_size"]), int(m["make_vocab_size_divisible_by"]),
                              int(cfg.parallel.tensor_model_parallel_size))
    try:
        ours = hf_config(m, vocab)
    except MappingError as e:
        raise HFBridgeError(f"checkpoint.init_from_hf: this model cannot take Nemotron-H weights: {e}") from None
    bad = first_mismatch(read_hf_config(folder), ours)
    if bad is not None:
        raise HFBridgeError(f"checkpoint.init_from_hf={folder} does not match the model config: {bad}")
    for f in ("model.safetensors.index.json", "model.safetensors"):
        if (Path(folder) / f).is_file():
            return
    raise HFBridgeError(f"checkpoint.init_from_hf={folder}: no model.safetensors(.index.json) there")


def _storages(module: torch.nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in list(module.parameters()) + list(module.buffers())}


def load_hf_weights(model_chunks, folder: str | Path, cfg) -> dict:
    """Copy an HF Nemotron-H folder's weights into this rank's model (any TP/EP/PP layout); see
    :func:`_load_hf_weights`. Every failure is an HFBridgeError (one line)."""
    from safetensors import SafetensorError

    try:
        return _load_hf_weights(model_chunks, folder, cfg)
    except MappingError as e:
        raise HFBridgeError(f"checkpoint.init_from_hf={folder}: {e}") from None
    except (SafetensorError, OSError, json.JSONDecodeError) as e:  # a damaged or truncated file, an unreadable index
        raise HFBridgeError(f"checkpoint.init_from_hf={folder}: unreadable weights ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None


@torch.no_grad()
def _load_hf_weights(model_chunks, folder: str | Path, cfg) -> dict:
    """Copy an HF Nemotron-H folder's weights into this rank's model (any TP/EP/PP layout).

    Every tensor of the folder must map to the model and every model tensor must be covered; each
    rank reads only the tensors of its own layers. Returns {"tensors": n, "seconds": s}."""
    from megatron.core.utils import unwrap_model

    t0 = time.perf_counter()
    check_init_from_hf(cfg, folder)
    chunks = [unwrap_model(c) for c in (model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks])]
    a = HybridArch.from_model_cfg(_model_dict(cfg))
    src = NormalizedHFTensors(LazyHFTensors(folder))
    want = hf_tensor_names(a)
    if set(src) != want:
        missing, extra = sorted(want - set(src)), sorted(set(src) - want)
        raise HFBridgeError(f"checkpoint.init_from_hf={folder}: tensors do not fit the model "
                            f"({len(missing)} missing, e.g. {missing[:2]}; {len(extra)} unexpected, e.g. {extra[:2]})")
    targets = sharded_tensors(chunks)
    owned = set().union(*(_storages(c) for c in chunks))
    layers = sorted({int(mt.group(1)) for k in targets if (mt := _LAYER_RE.match(k))})
    filled: set = set()

    def fill(glob: dict) -> None:
        for key, g in glob.items():
            sh = targets.get(key)
            if sh is None:
                continue  # another pipeline stage's tensor
            if tuple(g.shape) != tuple(sh.global_shape):
                raise HFBridgeError(f"{key}: HF gives {tuple(g.shape)}, the model's global shape is {tuple(sh.global_shape)}")
            if sh.data.untyped_storage().data_ptr() not in owned:
                raise HFBridgeError(f"{key}: the sharded state dict holds a copy, not the parameter; cannot load in place")
            part = g[sh.global_slice()]  # this rank's slice: each rank checks what it loads
            if part.is_floating_point() and not bool(torch.isfinite(part).all()):
                raise HFBridgeError(f"checkpoint.init_from_hf={folder}: non-finite values in the weights of {key}; "
                                    "nothing was trained from them")
            sh.data.copy_(part.reshape(sh.local_shape))
            filled.add(key)

    used: set = set()
    if any(k in targets for k in _END_KEYS):
        fill(hf_to_mcore_global(src, a, layers=[], used=used))
    for i in layers:
        fill(hf_to_mcore_global(src, a, layers=[i], ends=False, used=used))
    missing = sorted(set(targets) - filled)
    if missing:
        raise HFBridgeError(f"checkpoint.init_from_hf={folder}: {len(missing)} model tensors not covered, e.g. {missing[:3]}")
    return {"tensors": len(filled), "seconds": time.perf_counter() - t0}
