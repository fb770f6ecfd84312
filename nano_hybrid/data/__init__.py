"""Data: byte-level tokenizer, indexed-dataset preparation, megatron-core dataset loading and sampling."""

from nano_hybrid.data.dataset import (
    DataConfigError,
    DataSpec,
    PretrainingSampler,
    build_data_iterator,
    build_train_dataset,
    missing_paths,
)
from nano_hybrid.data.prepare import DataPreparationError, ensure_corpus, stdlib_sources, write_indexed_dataset
from nano_hybrid.data.tokenizer import ByteTokenizer, build_tokenizer

__all__ = [
    "ByteTokenizer",
    "DataConfigError",
    "DataPreparationError",
    "DataSpec",
    "PretrainingSampler",
    "build_data_iterator",
    "build_tokenizer",
    "build_train_dataset",
    "ensure_corpus",
    "missing_paths",
    "stdlib_sources",
    "write_indexed_dataset",
]
