"""Tokenizer files for an exported Hugging Face folder.

``data.tokenizer=byte`` (token id = byte value, ``<eod>`` = 256, ``<pad>`` = 257) is written as a
``tokenizers`` byte-level BPE without merges: a ``ByteLevel`` pre-tokenizer (no regex split, no prefix
space) maps every byte to one symbol, and the vocabulary gives symbol ``bytes_to_unicode()[b]`` the id
``b``; so ``AutoTokenizer`` encodes any text to exactly the ids this project trains on.

A tokenizer object that carries its own Hugging Face files provides ``save_hf_tokenizer(folder)``
(returning the file names it wrote); its files are then used as they are.
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
        import shutil

        dest = folder / "megatron_tiktoken.json"
        shutil.copyfile(spec.path, dest)
        return [dest.name], (f"the tiktoken BPE is copied as {dest.name} (Megatron TikTokenizer format, "
                             f"{spec.num_special_tokens} special ids first); AutoTokenizer cannot read it")
    return [], f"tokenizer type {spec.type!r} has no Hugging Face form"
