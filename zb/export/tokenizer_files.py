"""The tokenizer files of an export, so that `AutoTokenizer.from_pretrained(OUT)` gives the ids the
model was trained on.

- `bytes` (zb's built-in: UTF-8 bytes 0-255, BOS 256, EOS 257, PAD 258) is written out as a
  `tokenizers` byte-level BPE without merges whose ids are exactly the bytes, plus the three specials.
- a tokenizer.json (or a directory holding one): copied, with tokenizer_config.json and
  special_tokens_map.json when they lie beside it.
- a hub name: copied from the local Hugging Face cache (never downloaded: `zb export` works offline).
  When the cache does not hold it, the export has no tokenizer files and says so (exit 0) unless the
  tokenizer was asked for with --tokenizer (exit 2).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from zb.errors import InvalidInput

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BYTE_SPECIALS = ("<s>", "</s>", "<pad>")  # ids 256, 257, 258 of zb's byte tokenizer


@dataclass(frozen=True)
class TokenizerExport:
    written: list[str]             # file names written into the export
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    note: str                      # what happened, for the summary (e.g. why nothing was written)


def byte_to_unicode() -> dict[int, str]:
    """The byte-level alphabet of byte-level BPE (GPT-2's): each byte as a printable character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_byte_tokenizer(out: Path, max_length: int) -> TokenizerExport:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(BYTE_SPECIALS))
    # Written by Python, not tok.save(): the Rust library's error for a full disk is a bare Exception.
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    bos, eos, pad = BYTE_SPECIALS
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": pad,
        "model_max_length": max_length, "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos,
                                                             "pad_token": pad}, indent=2) + "\n")
    return TokenizerExport(list(FILES), 256, 257, 258, "zb's byte tokenizer, as a byte-level BPE without merges")


def _source_dir(name: str) -> Path | None:
    """Where the files of tokenizer `name` lie locally (a path, or the hub cache), or None."""
    path = Path(name)
    if path.is_file():
        return path.parent if path.name == "tokenizer.json" else None
    if path.is_dir():
        return path if (path / "tokenizer.json").is_file() else None
    from huggingface_hub import try_to_load_from_cache

    from zb.data.hub import REPO_ID, cache_root

    if not REPO_ID.match(name):
        return None
    cached = try_to_load_from_cache(name, "tokenizer.json", cache_dir=cache_root())
    return Path(cached).parent if isinstance(cached, str) else None


def export_tokenizer(name: str, out: Path, *, max_length: int, explicit: bool) -> TokenizerExport:
    """Write the tokenizer files for `name` (data.tokenizer, or --tokenizer when `explicit`) into `out`."""
    if name == "none":
        return TokenizerExport([], None, None, None, "no tokenizer files (--tokenizer none)")
    if name == "bytes":
        return write_byte_tokenizer(out, max_length)
    source = _source_dir(name)
    if source is None:
        if explicit:
            raise InvalidInput(f"--tokenizer {name!r}: no tokenizer.json there or in the local Hugging Face cache; "
                               "give a tokenizer.json, a directory holding one, or none")
        return TokenizerExport([], None, None, None,
                               f"no tokenizer files: the run's tokenizer {name!r} is neither a local path nor in the "
                               "local Hugging Face cache; fetch it (huggingface-cli download " + name +
                               " tokenizer.json tokenizer_config.json) and export again with --tokenizer DIR")
    written = []
    for file_name in FILES:
        if (source / file_name).is_file():
            shutil.copyfile(source / file_name, out / file_name)
            written.append(file_name)
    from zb.data.tokenizers import build_tokenizer

    tok = build_tokenizer(str(out))  # reads what was copied: BOS/EOS as zb trained with them
    return TokenizerExport(written, tok.bos_id, tok.eos_id, None, f"copied from {source}")
