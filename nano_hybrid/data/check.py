"""Before any work: a Megatron indexed dataset's ``.idx`` and ``.bin`` agree, and match what preparation recorded.

The ``.idx`` (megatron-core's layout: header ``MMIDIDX``, version 1, dtype code, sequence and document counts,
then int32 sequence lengths, int64 byte pointers, int64 document indices) fixes the size of the ``.bin``:
``sum(lengths) * itemsize`` bytes, the last sequence ending where the file ends. A truncated or replaced ``.bin``
or ``.idx`` fails this check with one line naming the file.

``write_indexed_dataset`` also records a fingerprint in ``<prefix>.json``: both sizes, the CRC-32 of the whole
``.idx`` and of 16 evenly spaced 64 KiB blocks of the ``.bin`` (about 1 MiB read for any corpus size), so a
``.bin`` overwritten in place with other tokens of the same length is caught too, at a cost of milliseconds.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np

IDX_MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8
ITEMSIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # megatron DType code -> bytes per token
SAMPLE_BLOCKS = 16
SAMPLE_BYTES = 64 * 1024
FINGERPRINT = "crc32:idx+16x64KiB-bin"


class CorpusCheckError(ValueError):
    """An indexed dataset whose files disagree; the message names the file."""


def _crc_file(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _crc_samples(path: Path, size: int) -> str:
    crc = 0
    with open(path, "rb") as f:
        for k in range(SAMPLE_BLOCKS):
            start = 0 if size <= SAMPLE_BYTES else (size - SAMPLE_BYTES) * k // (SAMPLE_BLOCKS - 1)
            f.seek(start)
            crc = zlib.crc32(f.read(SAMPLE_BYTES), crc)
    return f"{crc:08x}"


def fingerprint(prefix: str | Path) -> dict:
    """What ``<prefix>.json`` records: sizes and cheap checksums of ``prefix.idx`` / ``prefix.bin``."""
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    bin_size = bin_.stat().st_size
    return {"method": FINGERPRINT, "idx_bytes": idx.stat().st_size, "bin_bytes": bin_size,
            "idx_crc32": _crc_file(idx), "bin_sample_crc32": _crc_samples(bin_, bin_size)}


def read_index(prefix: str | Path) -> dict:
    """Counts and sizes from ``prefix.idx``; CorpusCheckError if the file is not a complete index."""
    idx = Path(f"{prefix}.idx")
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:9] != IDX_MAGIC:
        raise CorpusCheckError(f"{idx}: not a Megatron indexed-dataset index (bad header)")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != 1 or code not in ITEMSIZE:
        raise CorpusCheckError(f"{idx}: unsupported index (version {version}, dtype code {code})")
    want = HEADER_BYTES + n_seq * (4 + 8) + n_doc * 8
    if size != want:
        raise CorpusCheckError(f"{idx}: {size:,} bytes, but its header ({n_seq:,} sequences, {n_doc:,} documents) "
                               f"needs {want:,} (truncated or not written to the end)")
    lengths = np.memmap(idx, dtype=np.int32, mode="r", offset=HEADER_BYTES, shape=(n_seq,)) if n_seq else np.zeros(0, np.int32)
    tokens = int(lengths.sum(dtype=np.int64))
    last_end = 0
    if n_seq:
        pointers = np.memmap(idx, dtype=np.int64, mode="r", offset=HEADER_BYTES + 4 * n_seq, shape=(n_seq,))
        last_end = int(pointers[-1]) + int(lengths[-1]) * ITEMSIZE[code]
    return {"sequences": n_seq, "documents": max(n_doc - 1, 0), "tokens": tokens, "itemsize": ITEMSIZE[code],
            "bin_bytes": tokens * ITEMSIZE[code], "last_end": last_end}


def check_corpus(prefix: str | Path) -> dict:
    """CorpusCheckError (one line naming the file) unless ``prefix.idx`` and ``prefix.bin`` agree with each
    other and with the fingerprint in ``prefix.json`` when there is one; returns the index summary."""
    bin_ = Path(f"{prefix}.bin")
    info = read_index(prefix)
    size = bin_.stat().st_size
    if size != info["bin_bytes"] or info["last_end"] != info["bin_bytes"]:
        raise CorpusCheckError(
            f"{bin_}: {size:,} bytes, but {prefix}.idx describes {info['tokens']:,} tokens = {info['bin_bytes']:,} bytes "
            "(truncated, or the .bin and .idx come from different preparations); rebuild it with scripts/prepare_data.py")
    try:
        recorded = json.loads(Path(f"{prefix}.json").read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if isinstance(recorded, dict) and recorded.get("method") == FINGERPRINT:
        now = fingerprint(prefix)
        for key, path in (("idx_bytes", f"{prefix}.idx"), ("idx_crc32", f"{prefix}.idx"), ("bin_bytes", bin_),
                          ("bin_sample_crc32", bin_)):
            if recorded.get(key) != now[key]:
                raise CorpusCheckError(
                    f"{path}: {key.replace('_', ' ')} is {now[key]}, but {prefix}.json recorded {recorded.get(key)} "
                    "when the corpus was written (changed since); rebuild it with scripts/prepare_data.py")
    return info
