"""Tokenizer files for an exported Hugging Face folder.

``data.tokenizer=byte`` (token id = byte value, ``<eod>`` = 256, ``<pad>`` = 257) is written as a
``tokenizers`` byte-level BPE without merges: a ``ByteLevel`` pre-tokenizer (no regex split, no prefix
space) maps every byte to one symbol, and the vocabulary gives symbol ``bytes_to_unicode()[b]`` the id
``b``; so ``AutoTokenizer`` encodes any text to exactly the ids this project trains on.

``data.tokenizer.type=tiktoken`` (megatron-core's ``TikTokenTokenizer``: ``num_special_tokens`` special
ids first, then the BPE ranks shifted by that number, split by the v1/v2 regex) is written as the
equivalent ``tokenizers`` BPE, built the way transformers' ``TikTokenConverter`` builds one (merges
recovered from the ranks, ``ignore_merges``, regex split + byte-level), with the special tokens at their
megatron ids. ``data.tokenizer.type=hf`` folders are re-saved by ``AutoTokenizer``.
"""

from __future__ import annotations

from pathlib import Path


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the one ``tokenizers``' ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def write_byte_tokenizer(folder: str | Path, eod_id: int, pad_id: int) -> list[str]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = {"<eod>": eod_id, "<pad>": pad_id}
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in sorted(specials, key=specials.get)])
    for t, want in specials.items():
        if tok.token_to_id(t) != want:
            raise RuntimeError(f"byte tokenizer: {t} got id {tok.token_to_id(t)}, expected {want}")
    folder = Path(folder)
    tok.save(str(folder / "tokenizer.json"))
    import json

    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<eod>",
        "pad_token": "<pad>",
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000,
    }, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<eod>", "pad_token": "<pad>"}, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def token_ids(tokenizer) -> dict:
    """config.json token ids from the run's tokenizer (``eod`` is the end-of-sequence id)."""
    return {"bos_token_id": getattr(tokenizer, "bos", None), "eos_token_id": getattr(tokenizer, "eod", None),
            "pad_token_id": getattr(tokenizer, "pad", None)}


def write_tokenizer_files(spec, tokenizer, folder: str | Path) -> tuple[list[str], str | None]:
    """Write the run's tokenizer (``spec``: nano_hybrid.data.TokenizerSpec) into ``folder`` in its
    Hugging Face form. Returns (file names, a note on what could not be written or None)."""
    folder = Path(folder)
    if spec.type == "byte":
        return write_byte_tokenizer(folder, int(tokenizer.eod), int(tokenizer.pad)), None
    if spec.type == "hf":
        from transformers import AutoTokenizer

        p = Path(spec.path)
        before = set(folder.iterdir())
        AutoTokenizer.from_pretrained(str(p.parent if p.is_file() else p)).save_pretrained(str(folder))
        return sorted(f.name for f in set(folder.iterdir()) - before), None
    if spec.type == "tiktoken":
        return write_tiktoken_tokenizer(folder, spec.path, int(spec.vocab_size), int(spec.num_special_tokens),
                                        str(spec.pattern), int(tokenizer.eod), tokenizer.pad, tokenizer.bos), None
    return [], f"tokenizer type {spec.type!r} has no Hugging Face form"


def write_tiktoken_tokenizer(folder: str | Path, path: str, vocab_size: int, num_special: int, pattern: str,
                             eod_id: int, pad_id: int | None, bos_id: int | None) -> list[str]:
    """Megatron's TikTokenizer file as a Hugging Face ``tokenizer.json`` with the same ids."""
    import json

    from megatron.core.tokenizers.text.libraries import tiktoken_tokenizer as mt
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    regex = {"v1": mt._PATTERN_TIKTOKEN_V1, "v2": mt._PATTERN_TIKTOKEN_V2}[pattern]
    ranks = mt.reload_mergeable_ranks(path, max_vocab=vocab_size - num_special, num_special_tokens=num_special)
    enc = _bytes_to_unicode()

    def sym(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    specials = mt.SPECIAL_TOKENS + [mt.SPECIAL_TOKEN_TEMPLATE.format(id=i) for i in range(len(mt.SPECIAL_TOKENS), num_special)]
    vocab = {t: i for i, t in enumerate(specials)}
    merges = []
    for token, rank in ranks.items():  # as transformers' TikTokenConverter.extract_vocab_merges_from_model
        vocab[sym(token)] = rank
        if len(token) == 1:
            continue
        local = [(token[:k], token[k:], rank) for k in range(1, len(token)) if token[:k] in ranks and token[k:] in ranks]
        local.sort(key=lambda x: (ranks[x[0]], ranks[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda x: x[2])
    if len(vocab) != vocab_size:
        raise ValueError(f"{path}: {len(vocab)} distinct tokens, expected {vocab_size}")
    tok = Tokenizer(models.BPE(vocab, [(sym(a), sym(b)) for a, b, _ in merges], fuse_unk=False, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    for i in (0, eod_id, num_special - 1):
        if tok.token_to_id(specials[i]) != i:
            raise RuntimeError(f"tiktoken conversion: {specials[i]} got id {tok.token_to_id(specials[i])}, expected {i}")
    folder = Path(folder)
    tok.save(str(folder / "tokenizer.json"))
    conf = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": specials[eod_id],
        "pad_token": specials[pad_id] if pad_id is not None else None,
        "bos_token": specials[bos_id] if bos_id is not None else None,
        "unk_token": specials[0],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n")
    smap = {k: v for k, v in conf.items() if k.endswith("_token") and v is not None}
    (folder / "special_tokens_map.json").write_text(json.dumps(smap, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
