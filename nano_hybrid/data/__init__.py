"""Data: tokenizers (byte, tiktoken, hf), indexed-dataset preparation, megatron-core datasets (train and
validation splits) and sampling."""

from nano_hybrid.data.dataset import (
    DataConfigError,
    DataSpec,
    PretrainingSampler,
    build_data_iterator,
    build_datasets,
    build_train_dataset,
    build_valid_dataset,
    missing_paths,
    train_split_tokens,
)
from nano_hybrid.data.prepare import (
    DataPreparationError,
    corpus_tokenizer_type,
    ensure_corpus,
    stdlib_sources,
    write_indexed_dataset,
)
from nano_hybrid.data.tokenizer import (
    ByteTokenizer,
    MegatronTextTokenizer,
    TokenizerError,
    TokenizerSpec,
    build_tokenizer,
    padded_vocab_size,
)

__all__ = [
    "ByteTokenizer",
    "DataConfigError",
    "DataPreparationError",
    "DataSpec",
    "PretrainingSampler",
    "build_data_iterator",
    "build_tokenizer",
    "build_train_dataset",
    "build_valid_dataset",
    "build_datasets",
    "corpus_tokenizer_type",
    "MegatronTextTokenizer",
    "TokenizerError",
    "TokenizerSpec",
    "padded_vocab_size",
    "ensure_corpus",
    "missing_paths",
    "train_split_tokens",
    "stdlib_sources",
    "write_indexed_dataset",
]
