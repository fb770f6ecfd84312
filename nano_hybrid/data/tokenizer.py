"""Tokenizers: ``data.tokenizer.type = byte | tiktoken | hf``.

- ``byte``: UTF-8 bytes as ids 0..255, ``eod`` = 256, ``pad`` = 257 (no file, no network); ``model=tiny``'s
  default, so the quick start stays fast.
- ``tiktoken``: megatron-core's ``TikTokenTokenizer`` (on ``tiktoken``), the tokenizer behind Megatron-LM's
  ``--tokenizer-type TikTokenizer``: a JSON list of ``{rank, token_bytes, token_str}`` BPE ranks, ``vocab_size``
  ids in all of which the first ``num_special_tokens`` are special (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2 = eod,
  ``<pad>`` 4), the split regex ``v1``/``v2``. The Nano default is the 131,072-entry Tekken BPE
  (``scripts/prepare_tokenizer.py`` writes it to ``data/tokenizers/tekken_131k.json``).
- ``hf``: megatron-core's ``HuggingFaceTokenizer`` (transformers ``AutoTokenizer``) on a local tokenizer folder
  or ``tokenizer.json`` file, as Megatron-LM's ``--tokenizer-type HuggingFaceTokenizer``; ``eod`` is the
  tokenizer's EOS token.

All of them duck-type what megatron-core's GPTDataset needs (``vocab_size``, ``eod``, ``pad``,
``unique_identifiers``) and tokenize a string to a list of ids exactly as Megatron-LM's
``tools/preprocess_data.py`` does with the same tokenizer. ``vocab_size`` is the number of ids the tokenizer
can emit; the model's embedding is ``model.vocab_size`` padded as Megatron pads it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nano_hybrid.schema import TokenizerSchema, defaults

N_BYTES = 256
EOD_ID = 256
PAD_ID = 257

TOKENIZER_TYPES = ("byte", "tiktoken", "hf")
# The Nano configs' default tokenizer file (relative to the working directory), written by
# scripts/prepare_tokenizer.py from the mistral-common package (Apache-2.0).
TEKKEN_131K_PATH = "data/tokenizers/tekken_131k.json"
TEKKEN_SOURCE = "mistral_common/data/tekken_240718.json"
TIKTOKEN_PATTERNS = ("v1", "v2")
# the schema's defaults, for the keys a plain mapping or a command line leaves out
_TOKENIZER_DEFAULTS = defaults(TokenizerSchema)


class TokenizerError(ValueError):
    """Bad ``data.tokenizer.*`` settings or a tokenizer file that cannot be loaded."""


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int = 1) -> int:
    """Megatron's rule: round up to a multiple of ``make_vocab_size_divisible_by x tensor_model_parallel_size``."""
    multiple = int(divisible_by) * int(tp)
    if multiple < 1:
        raise ValueError(f"vocab padding multiple must be >= 1, got {multiple}")
    return int(math.ceil(vocab_size / multiple) * multiple)


class ByteTokenizer:
    """UTF-8 bytes as tokens; ``eod`` = 256, ``pad`` = 257."""

    vocab_size = N_BYTES + 2
    eod = EOD_ID
    pad = PAD_ID
    bos = None

    def __init__(self) -> None:
        self.unique_identifiers = OrderedDict(cls=type(self).__name__, vocab_size=self.vocab_size)
        # GPTDataset looks up the other special tokens here to warn about pad/eod id clashes.
        self.special_tokens_dict = {"eod_token": EOD_ID, "pad_token": PAD_ID}

    def describe(self) -> str:
        return f"byte ({self.vocab_size} ids)"

    def tokenize(self, data: bytes | str) -> np.ndarray:
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        return np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)

    def detokenize(self, ids) -> str:
        arr = np.asarray(ids, dtype=np.int64)
        return bytes(int(i) for i in arr if 0 <= i < N_BYTES).decode("utf-8", errors="replace")

    def padded_vocab_size(self, multiple: int) -> int:
        """Vocab size rounded up to ``multiple`` (Megatron's make_vocab_size_divisible_by)."""
        return padded_vocab_size(self.vocab_size, multiple)


class MegatronTextTokenizer:
    """A megatron-core text tokenizer (``MegatronTokenizer.from_pretrained``) with the attributes this project uses."""

    def __init__(self, kind: str, path: str, tokenizer) -> None:
        self.kind = kind
        self.path = path
        self._tok = tokenizer
        self.vocab_size = int(tokenizer.vocab_size)
        self.eod = tokenizer.eod
        if self.eod is None:
            raise TokenizerError(f"the {kind} tokenizer at {path} has no EOS token to end documents with")
        self.pad = tokenizer.pad
        self.bos = tokenizer.bos
        self.unique_identifiers = tokenizer.unique_identifiers

    def describe(self) -> str:
        return f"{self.kind} {self.path} ({self.vocab_size:,} ids, eod {self.eod}, pad {self.pad}, bos {self.bos})"

    def tokenize(self, text: str) -> list[int]:
        return self._tok.tokenize(text)

    def detokenize(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "tiktoken":  # whole-sequence decode (megatron's joins per-token strings, splitting UTF-8)
            return self._tok._tokenizer.tokenizer.decode(ids)
        return self._tok.detokenize(ids)

    def padded_vocab_size(self, multiple: int) -> int:
        return padded_vocab_size(self.vocab_size, multiple)


@dataclass(frozen=True)
class TokenizerSpec:
    """The validated ``data.tokenizer`` group (or a bare type name such as ``"byte"``)."""

    type: str = _TOKENIZER_DEFAULTS["type"]
    path: str | None = None
    vocab_size: int | None = None  # tiktoken: ids in all (special + BPE ranks), Megatron's --vocab-size
    # tiktoken: Megatron's --tiktoken-num-special-tokens
    num_special_tokens: int = _TOKENIZER_DEFAULTS["num_special_tokens"]
    pattern: str = _TOKENIZER_DEFAULTS["pattern"]  # tiktoken: Megatron's --tiktoken-pattern

    @staticmethod
    def from_cfg(cfg) -> "TokenizerSpec":
        if cfg is None or isinstance(cfg, str):
            cfg = {"type": cfg or _TOKENIZER_DEFAULTS["type"]}

        def get(key: str):
            return cfg.get(key, _TOKENIZER_DEFAULTS[key])

        kind = str(get("type"))
        if kind not in TOKENIZER_TYPES:
            raise TokenizerError(f"data.tokenizer.type={kind!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
        path = get("path")
        path = None if path in (None, "") else str(path)
        if kind != "byte" and path is None:
            raise TokenizerError(f"data.tokenizer.type={kind} needs data.tokenizer.path (a tokenizer file or folder)")
        vocab_size = get("vocab_size")
        num_special = get("num_special_tokens")
        pattern = str(get("pattern"))
        if kind == "tiktoken":
            if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
                raise TokenizerError(f"data.tokenizer.vocab_size={vocab_size!r} must be a positive integer for tiktoken")
            if not isinstance(num_special, int) or isinstance(num_special, bool) or not 7 <= num_special < vocab_size:
                raise TokenizerError(
                    f"data.tokenizer.num_special_tokens={num_special!r} must be an integer in [7, vocab_size={vocab_size})"
                )
            if pattern not in TIKTOKEN_PATTERNS:
                raise TokenizerError(f"data.tokenizer.pattern={pattern!r}; choose one of {', '.join(TIKTOKEN_PATTERNS)}")
        return TokenizerSpec(kind, path, vocab_size if kind == "tiktoken" else None,
                             int(num_special) if kind == "tiktoken" else _TOKENIZER_DEFAULTS["num_special_tokens"],
                             pattern)

    def check_files(self) -> None:
        """Raise TokenizerError (one line) when the tokenizer's file or folder is missing."""
        if self.type == "byte":
            return
        p = Path(self.path)
        if not p.exists():
            hint = (" (python scripts/prepare_tokenizer.py writes the 131k Tekken BPE there)"
                    if self.type == "tiktoken" else "")
            raise TokenizerError(f"tokenizer file not found: {self.path}{hint}")
        if self.type == "tiktoken" and not (p.is_file() and p.suffix == ".json"):
            raise TokenizerError(f"data.tokenizer.path={self.path} must be a .json file for tiktoken")


def spec_from_arg(arg: str, vocab_size: int = 131072, num_special_tokens: int = TokenizerSpec.num_special_tokens,
                  pattern: str = TokenizerSpec.pattern) -> TokenizerSpec:
    """The TokenizerSpec of a command-line ``--tokenizer`` value: ``byte``, ``tekken131k`` (the 131k Tekken BPE
    at TEKKEN_131K_PATH), ``tiktoken:PATH.json`` or ``hf:PATH``."""
    if arg == "byte":
        return TokenizerSpec("byte")
    if arg == "tekken131k":
        arg = f"tiktoken:{TEKKEN_131K_PATH}"
    kind, _, path = arg.partition(":")
    if kind not in ("tiktoken", "hf") or not path:
        raise TokenizerError(f"--tokenizer {arg!r}: use byte, tekken131k, tiktoken:PATH.json or hf:PATH")
    return TokenizerSpec.from_cfg(
        {"type": kind, "path": path, "vocab_size": vocab_size, "num_special_tokens": num_special_tokens, "pattern": pattern}
    )


def build_tokenizer(spec) -> ByteTokenizer | MegatronTextTokenizer:
    """The tokenizer for ``spec`` (a TokenizerSpec, a ``data.tokenizer`` mapping or a type name)."""
    if not isinstance(spec, TokenizerSpec):
        spec = TokenizerSpec.from_cfg(spec)
    if spec.type == "byte":
        return ByteTokenizer()
    spec.check_files()
    from megatron.core.tokenizers import MegatronTokenizer

    try:
        if spec.type == "tiktoken":
            tok = MegatronTokenizer.from_pretrained(
                spec.path, metadata_path={"library": "tiktoken"}, pattern=spec.pattern,
                vocab_size=spec.vocab_size, num_special_tokens=spec.num_special_tokens,
            )
        else:
            # AutoTokenizer takes a folder; a tokenizer.json file is loaded through its folder.
            p = Path(spec.path)
            folder = str(p.parent if p.is_file() else p)
            tok = MegatronTokenizer.from_pretrained(folder, metadata_path={"library": "huggingface"}, use_fast=True)
    except (AssertionError, ValueError, OSError, KeyError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TokenizerError(f"cannot load the {spec.type} tokenizer at {spec.path}: {msg}") from None
    return MegatronTextTokenizer(spec.type, spec.path, tok)


def extract_tekken(dest: str | Path = TEKKEN_131K_PATH, source: str | Path | None = None) -> dict:
    """Write the 131,072-entry Tekken BPE as a Megatron TikTokenizer file (a JSON list of
    ``{rank, token_bytes, token_str}``, the 130,072 BPE ranks that follow the 1,000 special ids).

    ``source``: a Tekken JSON file; default: the one inside the installed ``mistral-common`` distribution
    (located through its metadata, the package is not imported). Returns a summary (path, bytes, entries).
    """
    import importlib.metadata
    import json
    import os

    if source is None:
        try:
            source = importlib.metadata.distribution("mistral-common").locate_file(TEKKEN_SOURCE)
        except importlib.metadata.PackageNotFoundError:
            raise TokenizerError(
                "mistral-common is not installed (pip install mistral-common==1.12.0, or pass the Tekken file)"
            ) from None
    source = Path(source)
    if not source.is_file():
        raise TokenizerError(f"Tekken file not found: {source}")
    try:
        raw = json.loads(source.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{source} is not a Tekken JSON file ({e})") from None
    cfg = raw.get("config", {}) if isinstance(raw, dict) else {}
    if cfg.get("default_vocab_size") != 131072 or cfg.get("default_num_special_tokens") != 1000:
        raise TokenizerError(f"{source} is not a 131,072-entry Tekken file with 1,000 special ids: {cfg}")
    from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import _PATTERN_TIKTOKEN_V2

    if cfg.get("pattern") != _PATTERN_TIKTOKEN_V2:
        raise TokenizerError(f"{source}: its split regex is not Megatron's TikTokenizer v2 pattern")
    inner = cfg["default_vocab_size"] - cfg["default_num_special_tokens"]
    vocab = raw.get("vocab")
    vocab = vocab[:inner] if isinstance(vocab, list) else []
    if len(vocab) != inner or any(not isinstance(v, dict) or v.get("rank") != i for i, v in enumerate(vocab)):
        raise TokenizerError(f"{source}: expected ranks 0..{inner - 1} in order")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(vocab, separators=(",", ":"), ensure_ascii=True), encoding="utf-8")
    os.replace(tmp, dest)
    return {"path": str(dest), "bytes": dest.stat().st_size, "bpe_ranks": inner, "vocab_size": 131072,
            "num_special_tokens": 1000, "source": str(source)}
