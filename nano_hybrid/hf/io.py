"""Reading and writing the tensors: megatron ``torch_dist`` checkpoints, Hugging Face safetensors folders,
and the model in memory (megatron's sharded state dict, which names every tensor by its global key)."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

from nano_hybrid.hf.mapping import MappingError

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
DEFAULT_SHARD_BYTES = 5 * 1024**3


# ------------------------------------------------------------------------ megatron dist checkpoint
def checkpoint_model_tensors_meta(ckpt: str | Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Key -> (global shape, dtype) of every model tensor in a ``torch_dist`` checkpoint (optimizer state
    and non-tensor objects left out). Reads only the ``.metadata`` file."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(ckpt)).read_metadata()
    out = {}
    for key, v in md.state_dict_metadata.items():
        if key.startswith("optimizer.") or not isinstance(v, TensorStorageMetadata):
            continue
        out[key] = (tuple(v.size), v.properties.dtype)
    return out


def read_checkpoint_tensors(ckpt: str | Path, keys, meta: dict | None = None) -> dict[str, torch.Tensor]:
    """The global tensors ``keys`` of a ``torch_dist`` checkpoint, whatever TP/EP/PP/DP layout saved it
    (``torch.distributed.checkpoint`` assembles each tensor from its shards; no process group needed)."""
    from torch.distributed.checkpoint import FileSystemReader, load

    meta = checkpoint_model_tensors_meta(ckpt) if meta is None else meta
    state = {k: torch.empty(meta[k][0], dtype=meta[k][1]) for k in keys}
    if state:
        with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": what is meant here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            load(state, storage_reader=FileSystemReader(str(ckpt)), no_dist=True)
    return state


# ------------------------------------------------------------------------------- model in memory
def sharded_tensors(model_chunks) -> dict:
    """key -> megatron ``ShardedTensor`` (this rank's piece, ``data`` a view of the parameter or buffer)
    for every model tensor, factories (the Mamba in_proj / conv1d component split) applied."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sd: dict = {}
    for i, m in enumerate(model_chunks):
        part = m.sharded_state_dict()
        sd.update({f"{i}/{k}": v for k, v in part.items()})
    apply_factories(sd)
    out = {}
    for v in nested_values(sd):
        if isinstance(v, ShardedTensor):
            if v.flattened_range is not None:
                raise MappingError(f"{v.key}: flattened model tensors are not supported")
            out[v.key] = v
    return out


def model_global_tensors(model_chunks) -> dict[str, torch.Tensor]:
    """Global tensors of a model whose every tensor is whole on this process (TP=EP=PP=1)."""
    out = {}
    for key, sh in sharded_tensors(model_chunks).items():
        if tuple(sh.local_shape) != tuple(sh.global_shape) or sh.prepend_axis_num:
            raise MappingError(f"{key} is sharded on this process ({tuple(sh.local_shape)} of {tuple(sh.global_shape)}); "
                               "export a saved checkpoint instead (python -m nano_hybrid.export_hf)")
        out[key] = sh.data.detach()
    return out


# ---------------------------------------------------------------------------- safetensors folders
class _KeyedTensors(Mapping):
    """A read-on-access tensor mapping whose keys are those of ``self._where`` (key -> where to read it)."""

    _where: dict

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key) -> bool:
        return key in self._where


class LazyHFTensors(_KeyedTensors):
    """The tensors of a Hugging Face folder (``model.safetensors`` or shards + index), read on access."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / SAFE_INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.folder / SAFE_SINGLE).is_file():
            with safe_open(self.folder / SAFE_SINGLE, framework="pt") as f:
                weight_map = {k: SAFE_SINGLE for k in f.keys()}
        else:
            raise FileNotFoundError(f"{self.folder}: no {SAFE_INDEX} or {SAFE_SINGLE}")
        self._files = {name: safe_open(self.folder / name, framework="pt") for name in sorted(set(weight_map.values()))}
        self._where = weight_map

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._files[self._where[key]].get_tensor(key)



class NormalizedHFTensors(_KeyedTensors):
    """A view of HF tensors in the published layout (``backbone.`` prefix, one tensor per routed expert),
    whichever of the two layouts the folder uses (transformers saves ``model.`` + stacked 3-D experts)."""

    def __init__(self, src: Mapping):
        from nano_hybrid.hf.mapping import HF_PREFIX

        self.src = src
        self._where: dict[str, tuple[str, int | None]] = {}
        for k in src:
            name = HF_PREFIX + k[len("model."):] if k.startswith("model.") else k
            for n in ("up_proj", "down_proj"):
                if name.endswith(f".mixer.experts.{n}"):
                    num = self._num_experts(k)
                    base = name[: -len(n)]
                    for e in range(num):
                        self._where[f"{base}{e}.{n}.weight"] = (k, e)
                    break
            else:
                self._where[name] = (k, None)

    def _num_experts(self, k: str) -> int:
        src = self.src
        if isinstance(src, LazyHFTensors):
            return src._files[src._where[k]].get_slice(k).get_shape()[0]
        return src[k].shape[0]

    def __getitem__(self, key: str) -> torch.Tensor:
        k, e = self._where[key]
        if e is None:
            return self.src[k]
        src = self.src
        if isinstance(src, LazyHFTensors):
            return src._files[src._where[k]].get_slice(k)[e]
        return src[k][e]



class ShardWriter:
    """Writes tensors to ``model-0000i-of-0000N.safetensors`` shards of at most ``max_bytes`` each and
    the ``model.safetensors.index.json`` that maps every tensor to its shard."""

    def __init__(self, folder: str | Path, max_bytes: int = DEFAULT_SHARD_BYTES):
        self.folder = Path(folder)
        self.max_bytes = int(max_bytes)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if self._pending and self._pending_bytes + nbytes > self.max_bytes:
                self._flush()
            self._pending[name] = t.detach().contiguous().cpu()
            self._pending_bytes += nbytes
            self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        tmp = f".shard-{len(self._written) + 1:05d}.tmp"
        save_file(self._pending, str(self.folder / tmp), metadata={"format": "pt"})
        self._written.append((tmp, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        if self._pending or not self._written:
            self._flush()
        n = len(self._written)
        umask = os.umask(0)
        os.umask(umask)
        weight_map, files = {}, []
        for i, (tmp, names) in enumerate(self._written, 1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(self.folder / tmp, self.folder / final)
            os.chmod(self.folder / final, 0o666 & ~umask)  # safetensors writes 0600; a model folder is shared
            files.append(final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return files
