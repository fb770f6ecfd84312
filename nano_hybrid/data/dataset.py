"""Training data through megatron-core: BlendedMegatronDatasetBuilder + GPTDataset (or MockGPTDataset),
and a sampler that starts at ``consumed_samples`` and shards each global micro-batch over DP ranks.

Sample order: the GPTDataset's own (seeded) shuffle; the sampler walks it sequentially. Global sample
``i`` of step ``s`` is the same for any DP size, so a resume at ``consumed_samples`` continues exactly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from nano_hybrid.schema import DataSchema, optional_defaults


class DataConfigError(ValueError):
    """Bad ``data.*`` settings or a missing dataset; raised before any work."""


# the schema's defaults, for the keys a plain mapping (tests, tools) may leave out
_DATA_DEFAULTS = optional_defaults(DataSchema)


@dataclass(frozen=True)
class DataSpec:
    kind: str  # "indexed" | "mock"
    paths: tuple[str, ...]
    weights: tuple[float, ...] | None
    split: str
    cache_dir: str | None
    num_workers: int
    valid_paths: tuple[str, ...] = ()  # separate validation prefixes (then ``split`` is not used)
    valid_seed: int | None = None  # shuffle seed of the validation samples (None: the run's seed)

    @staticmethod
    def from_cfg(data_cfg) -> "DataSpec":
        """From ``cfg.data`` or a plain mapping (a key it leaves out takes the schema's default). A null
        ``split`` gives every document to training."""

        def get(key: str):
            return data_cfg.get(key, _DATA_DEFAULTS[key])

        kind = str(get("kind"))
        if kind not in ("indexed", "mock"):
            raise DataConfigError(f"data.kind must be 'indexed' or 'mock', got {kind!r}")
        paths = tuple(str(p) for p in (get("paths") or ()))
        valid_paths = tuple(str(p) for p in (get("valid_paths") or ()))
        weights = get("weights")
        weights = tuple(float(w) for w in weights) if weights else None
        split = str(get("split") or "100,0,0")
        if kind == "indexed":
            if not paths:
                raise DataConfigError("data.paths is empty: give one or more indexed-dataset prefixes (without .bin/.idx)")
            if weights is not None and (len(weights) != len(paths) or any(w <= 0 for w in weights)):
                raise DataConfigError(f"data.weights must be {len(paths)} positive numbers, got {list(weights)}")
            parts = split.replace("/", ",").split(",")
            try:
                nums = [float(x) for x in parts]
            except ValueError:
                nums = []
            if not 1 <= len(nums) <= 3 or any(x < 0 for x in nums) or not sum(nums) > 0 or nums[0] <= 0:
                raise DataConfigError(
                    f"data.split={split!r} must be Megatron's train,valid,test weights, e.g. \"969,30,1\" (train > 0)"
                )
        num_workers = int(get("num_workers"))
        if num_workers < 0:
            raise DataConfigError(f"data.num_workers must be >= 0, got {num_workers}")
        valid_seed = get("valid_seed")
        if valid_seed is not None and (not isinstance(valid_seed, int) or isinstance(valid_seed, bool) or valid_seed < 0):
            raise DataConfigError(f"data.valid_seed={valid_seed!r} must be an integer >= 0 or null (the run's seed)")
        return DataSpec(kind, paths, weights, split, get("cache_dir"), num_workers, valid_paths, valid_seed)

    @property
    def split_has_valid(self) -> bool:
        parts = self.split.replace("/", ",").split(",")
        return len(parts) > 1 and float(parts[1]) > 0


def missing_paths(spec: DataSpec) -> list[str]:
    return [p for p in spec.paths + spec.valid_paths if not (Path(f"{p}.bin").is_file() and Path(f"{p}.idx").is_file())]


def index_cache_dir(spec: DataSpec) -> str:
    """Where megatron keeps the sample indices of ``spec``'s prefixes: ``data.cache_dir`` (null: ``<dir of the first
    path>/cache``) / a key of the .bin/.idx files' paths, sizes and modification times. megatron names its cache files
    after the dataset settings, not the data, so a corpus written again at the same prefix (``prepare_data.py``,
    Megatron's ``preprocess_data.py``) would reuse indices of the old documents; under the key it gets new ones."""
    import hashlib

    root = spec.cache_dir or str(Path(spec.paths[0]).parent / "cache")
    h = hashlib.sha1()
    for prefix in [*spec.paths, *(spec.valid_paths or [])]:
        for suffix in (".idx", ".bin"):
            st = os.stat(f"{prefix}{suffix}")
            h.update(f"{prefix}{suffix}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return str(Path(root) / f"data-{h.hexdigest()[:16]}")


def build_datasets(spec: DataSpec, tokenizer, seq_length: int, num_samples: int, seed: int, valid_samples: int = 0):
    """(train, valid) as built by megatron-core's BlendedMegatronDatasetBuilder (GPTDataset, a BlendedDataset
    over several prefixes, or MockGPTDataset). The validation split comes from ``spec.split`` (Megatron's
    train,valid,test weights over each prefix's documents) or from ``spec.valid_paths``; ``valid`` is None
    when ``valid_samples`` is 0.

    ``seed`` shuffles the documents and samples of both splits (a different seed, a different training order);
    with ``spec.valid_seed`` set the validation samples are shuffled with that seed instead, so runs of
    different seeds evaluate on the same samples."""
    if spec.valid_seed is not None and valid_samples and spec.valid_seed != seed:
        train = build_datasets(_without_valid_seed(spec), tokenizer, seq_length, num_samples, seed)[0] if num_samples else None
        valid = build_datasets(_without_valid_seed(spec), tokenizer, seq_length, 0, spec.valid_seed, valid_samples)[1]
        return train, valid
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    blend = blend_per_split = None
    if spec.kind == "indexed":
        missing = missing_paths(spec)
        if missing:
            raise DataConfigError(f"data path(s) not found: {', '.join(p + '.bin/.idx' for p in missing)}")
        cache = index_cache_dir(spec)
        weights = list(spec.weights) if spec.weights else None
        if spec.valid_paths:
            blend_per_split = [(list(spec.paths), weights), (list(spec.valid_paths), None), None]
            split = None
        else:
            blend, split = (list(spec.paths), weights), spec.split
            if valid_samples and not spec.split_has_valid:
                raise DataConfigError(
                    f"train.eval_interval asks for validation but data.split={spec.split!r} gives the validation "
                    "split no documents (e.g. data.split=\"969,30,1\", or set data.valid_paths)"
                )
        cls = GPTDataset
    else:
        if valid_samples:
            raise DataConfigError("data=mock has no validation data (synthetic tokens); set train.eval_interval=0")
        cache, cls, split = spec.cache_dir, MockGPTDataset, None
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
        path_to_cache=cache,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # The step builds one causal mask for the whole batch instead of one [1, s, s] mask per sample.
        create_attention_mask=False,
        mid_level_dataset_surplus=0.005,
    )
    if spec.kind == "indexed":
        _keep_needed_splits(config, spec, bool(valid_samples))
    if spec.kind == "indexed" and not num_samples:  # validation only (a separate valid_seed): no training split
        _drop_train_split(config, spec)
    train, valid, _ = BlendedMegatronDatasetBuilder(cls, [num_samples, valid_samples, 0], lambda: True, config).build()
    if num_samples and (train is None or len(train) < num_samples):
        n = 0 if train is None else len(train)
        raise DataConfigError(f"the training split holds {n} samples, {num_samples} are needed")
    if valid_samples and (valid is None or len(valid) < valid_samples):
        n = 0 if valid is None else len(valid)
        raise DataConfigError(f"the validation split holds {n} samples, {valid_samples} are needed")
    return train, (valid if valid_samples else None)


def train_split_tokens(dataset) -> int | None:
    """Tokens in one pass over a built training split (GPTDataset, or the sum over a BlendedDataset's parts;
    a blend's weights may repeat one part sooner); None for synthetic data (MockGPTDataset)."""
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    if isinstance(dataset, MockGPTDataset):
        return None
    if isinstance(dataset, GPTDataset):
        return dataset._get_num_tokens_per_epoch()
    parts = getattr(dataset, "datasets", None)
    if parts:
        counts = [train_split_tokens(d) for d in parts]
        return None if any(c is None for c in counts) else sum(counts)
    return None


def _without_valid_seed(spec: DataSpec) -> DataSpec:
    import dataclasses

    return dataclasses.replace(spec, valid_seed=None)


def _drop_train_split(config, spec: DataSpec) -> None:
    if spec.valid_paths:
        config.blend_per_split = [None, config.blend_per_split[1], None]
    else:
        matrix = list(config.split_matrix)
        matrix[0] = None
        config.split_matrix = matrix


def _keep_needed_splits(config, spec: DataSpec, need_valid: bool) -> None:
    """Build only the splits the run reads (train, and valid when validating): megatron builds every split with
    a nonzero weight, and GPTDataset loops forever on a split that holds no tokens (e.g. the 0.1% test split of a
    small corpus). A needed split without documents is one clear error instead."""
    if spec.valid_paths:
        config.blend_per_split = [config.blend_per_split[0], config.blend_per_split[1] if need_valid else None, None]
        return
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    matrix = list(config.split_matrix)
    matrix[2] = None
    if not need_valid:
        matrix[1] = None
    for i, name in ((0, "training"), (1, "validation")):
        if matrix[i] is None:
            continue
        for p in spec.paths:
            n = len(IndexedDataset(p))
            if int(round(matrix[i][1] * n)) <= int(round(matrix[i][0] * n)):
                raise DataConfigError(f"data.split={spec.split!r} gives the {name} split of {p} none of its {n} documents")
    config.split_matrix = matrix


def build_train_dataset(spec: DataSpec, tokenizer, seq_length: int, num_samples: int, seed: int):
    """The training split as built by megatron-core (GPTDataset, or BlendedDataset over several prefixes)."""
    return build_datasets(spec, tokenizer, seq_length, num_samples, seed)[0]


def build_valid_dataset(spec: DataSpec, tokenizer, seq_length: int, num_samples: int, seed: int):
    """The validation split (``num_samples`` samples) of the same build as the training split."""
    return build_datasets(spec, tokenizer, seq_length, 0, seed, valid_samples=num_samples)[1]


class PretrainingSampler:
    """Yields this DP rank's micro-batches of dataset indices, starting at ``consumed_samples``.

    Global micro-batch ``k`` covers indices ``[k*mbs*dp, (k+1)*mbs*dp)``; rank ``r`` takes the ``r``-th
    slice of ``mbs`` indices (as Megatron's MegatronPretrainingSampler does).
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        if consumed_samples % (micro_batch_size * dp_size):
            raise ValueError(
                f"consumed_samples {consumed_samples} is not a multiple of micro_batch_size*dp ({micro_batch_size * dp_size})"
            )
        if consumed_samples > total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} > dataset size {total_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.dp_size)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.dp_size
        begin = self.consumed_samples
        while begin + step <= self.total_samples:
            first = begin + self.dp_rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))
            begin += step


def build_data_iterator(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, num_workers: int = 0):
    """An iterator of collated micro-batches (dicts of tensors) for this DP rank."""
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
    )
    return iter(loader)
