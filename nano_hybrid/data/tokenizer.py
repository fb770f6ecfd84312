"""Byte-level tokenizer: token id = byte value (0..255), plus end-of-document and padding ids.

Needs no vocabulary file and no network. It duck-types what megatron-core's GPTDataset uses
(``vocab_size``, ``eod``, ``pad``, ``unique_identifiers``); ``vocab_size`` is the number of real
ids (258), the model's embedding is padded separately (``padded_vocab_size``).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

N_BYTES = 256
EOD_ID = 256
PAD_ID = 257


class ByteTokenizer:
    """UTF-8 bytes as tokens; ``eod`` = 256, ``pad`` = 257."""

    vocab_size = N_BYTES + 2
    eod = EOD_ID
    pad = PAD_ID

    def __init__(self) -> None:
        self.unique_identifiers = OrderedDict(cls=type(self).__name__, vocab_size=self.vocab_size)
        # GPTDataset looks up the other special tokens here to warn about pad/eod id clashes.
        self.special_tokens_dict = {"eod_token": EOD_ID, "pad_token": PAD_ID}

    def tokenize(self, data: bytes | str) -> np.ndarray:
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        return np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)

    def detokenize(self, ids) -> str:
        arr = np.asarray(ids, dtype=np.int64)
        return bytes(int(i) for i in arr if 0 <= i < N_BYTES).decode("utf-8", errors="replace")

    def padded_vocab_size(self, multiple: int) -> int:
        """Vocab size rounded up to ``multiple`` (Megatron's make_vocab_size_divisible_by)."""
        if multiple < 1:
            raise ValueError(f"vocab padding multiple must be >= 1, got {multiple}")
        return -(-self.vocab_size // multiple) * multiple


def build_tokenizer(name: str) -> ByteTokenizer:
    if name != "byte":
        raise ValueError(f"unknown tokenizer {name!r}; available: byte")
    return ByteTokenizer()
