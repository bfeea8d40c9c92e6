"""Tokenizers: the built-in byte-level one, or a Hugging Face `tokenizers` tokenizer by path or hub name.

Every tokenizer has `.name`, `.vocab_size`, `.bos_id`, `.eos_id`, `.encode(text) -> list[int]` (no
specials added) and `.decode(ids) -> str`. Documents are joined with `eos_id` when packed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from zb.errors import InvalidInput

# Special-token spellings of common tokenizers, tried in order when no tokenizer_config.json names them.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]", "<|endoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "[SEP]", "<|endoftext|>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes 0-255, then BOS 256, EOS 257, PAD 258: no files, no training, exact round trip."""

    name = "bytes"
    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer`; BOS/EOS come from tokenizer_config.json when present, else known names."""

    def __init__(self, name: str, tok, config: dict | None = None):
        self.name, self._tok = name, tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        bos_id = self._special(config, "bos_token", _BOS_NAMES)
        eos_id = self._special(config, "eos_token", _EOS_NAMES)
        if eos_id is None:
            raise InvalidInput(f"data.tokenizer = {name!r}: no end-of-text token found (looked for "
                               f"{', '.join(_EOS_NAMES)}); documents cannot be separated")
        self.eos_id: int = eos_id
        self.bos_id: int = bos_id if bos_id is not None else eos_id

    def _special(self, config: dict | None, key: str, names: tuple[str, ...]) -> int | None:
        value = (config or {}).get(key)
        if isinstance(value, dict):
            value = value.get("content")
        for candidate in ([value] if value else []) + list(names):
            token_id = self._tok.token_to_id(candidate)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def build_tokenizer(name: str, *, retries: int = 3) -> Tokenizer:
    """"bytes", a tokenizer.json file, a directory holding one, or a hub model name (fetched once, cached)."""
    if name == "bytes":
        return ByteTokenizer()
    from tokenizers import Tokenizer as RawTokenizer  # here, not at the top: bytes runs need no import
    path = Path(name)
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise InvalidInput(f"data.tokenizer = {name!r}: the directory has no tokenizer.json")
    if path.is_file():
        return _from_file(name, path, RawTokenizer)
    return _from_hub(name, RawTokenizer, retries)


def _from_file(name: str, path: Path, raw_cls) -> HFTokenizer:
    try:
        tok = raw_cls.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise InvalidInput(f"data.tokenizer = {name!r}: {path} is not a valid tokenizer.json ({e})") from None
    config_path = path.with_name("tokenizer_config.json")
    config = json.loads(config_path.read_text()) if config_path.is_file() else None
    return HFTokenizer(name, tok, config)


def _from_hub(name: str, raw_cls, retries: int) -> HFTokenizer:
    """tokenizer.json (and tokenizer_config.json if any) of a hub model repo, through the hub cache."""
    from zb.data.hub import REPO_ID, cache_root, hub_download, hub_endpoint
    from zb.errors import EnvironmentFailure, ZbError

    if not REPO_ID.match(name):
        raise InvalidInput(f"data.tokenizer = {name!r}: no such file or directory, and not a hub name (owner/name)")
    fetch: dict[str, Any] = dict(repo_type="model", revision=None, cache_dir=cache_root(), retries=retries)
    try:
        path = hub_download(name, "tokenizer.json", **fetch)
    except EnvironmentFailure as e:   # the hub or the cache, not the name: exit 1
        raise EnvironmentFailure(f"data.tokenizer = {name!r}: not a local path and it could not be fetched from "
                                 f"{hub_endpoint()} ({e}); give a path to a tokenizer.json or use data.tokenizer = "
                                 "bytes") from None
    except ZbError as e:
        raise InvalidInput(f"data.tokenizer = {name!r}: not a local path and it could not be fetched from "
                           f"{hub_endpoint()} ({e}); give a path to a tokenizer.json or use data.tokenizer = bytes"
                           ) from None
    try:
        hub_download(name, "tokenizer_config.json", **fetch)  # lands beside tokenizer.json, where _from_file looks
    except ZbError:
        pass  # optional: BOS/EOS are then found by their usual names
    return _from_file(name, path, raw_cls)
