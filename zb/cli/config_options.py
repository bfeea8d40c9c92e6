"""Click options generated from the config schema: one `--section.key` option per config key.

Values stay strings here; zb.config converts and validates them so that every error names the key
and its source the same way, whether it came from a file, an env twin or a flag.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from zb import config_prime as prime
from zb.config import KEYS, KeySpec

DEST_SEP = "__"


def _dest(key: str) -> str:
    return key.replace(".", DEST_SEP)


def _help(spec: KeySpec) -> str:
    default = "unset" if spec.default is None else str(spec.default).lower() if spec.type is bool else spec.default
    choices = f" One of: {', '.join(spec.choices)}." if spec.choices else \
        f" Comma separated, of: {', '.join(spec.items)}." if spec.items else ""
    return f"{spec.doc}{choices} [default: {default}; env: {spec.env}]"


def _flag_like(key: str) -> bool:
    """Options that may stand alone meaning true (booleans, and ints that take true/false)."""
    if key in prime.PRIME_KEYS:
        entry = prime.PRIME_KEYS[key]
        if isinstance(entry, prime.NoEffect):
            return isinstance(entry.unless, bool)
        if entry.boolean:
            return True
        key = entry.zb_key
    return KEYS[key].type is bool or "true" in KEYS[key].aliases


# Short spellings shared with the commands that take no config (zb store, zb status, ...).
SHORT_FLAGS = {"elastic.secret_file": "--secret-file"}


def _option(spec: KeySpec) -> Callable:
    names = [f"--{spec.key}"]
    if "_" in spec.key:
        names.append(f"--{spec.key.replace('_', '-')}")
    if spec.key in SHORT_FLAGS:
        names.append(SHORT_FLAGS[spec.key])
    kwargs: dict[str, Any] = {"type": str, "default": None, "help": _help(spec), "metavar": spec.type.__name__.upper()}
    if _flag_like(spec.key):
        # `--train.log_model_hash` alone means true, as in Prime; `--train.log_model_hash false` also works.
        kwargs.update(is_flag=False, flag_value="true", metavar="[BOOL]")
    return click.option(*names, _dest(spec.key), **kwargs)


def _prime_option(key: str) -> Callable:
    """A hidden option for a key only Prime spells this way (`--name_model 150M`, `--optim.optim.lr`):
    Prime's launch lines work; --help lists zb's spelling and docs/prime.md maps the two."""
    kwargs: dict[str, Any] = {"type": str, "default": None, "hidden": True}
    if _flag_like(key):
        kwargs.update(is_flag=False, flag_value="true")
    return click.option(f"--{key}", _dest(key), **kwargs)


def config_options(keys: list[str] | None = None) -> Callable:
    """Decorator adding the options for `keys` (default: every config key)."""
    chosen = [KEYS[k] for k in (keys or KEYS)]

    def decorate(fn: Callable) -> Callable:
        if keys is None:
            for key in prime.PRIME_KEYS:
                fn = _prime_option(key)(fn)
        for spec in reversed(chosen):
            fn = _option(spec)(fn)
        return fn

    return decorate


def pop_config_flags(kwargs: dict[str, Any]) -> dict[str, str]:
    """Remove the config options from click's kwargs; return {key: raw value} for those given."""
    flags = {}
    known = set(KEYS) | set(prime.PRIME_KEYS)
    for name in [n for n in kwargs if n.replace(DEST_SEP, ".") in known]:
        value = kwargs.pop(name)
        if value is not None:
            flags[name.replace(DEST_SEP, ".")] = value
    return flags


def split_config_files(args: tuple[str, ...], flags: dict[str, str]) -> list[str]:
    """`@path` arguments, in order. A bare boolean flag followed by @file swallows the file: give it back."""
    files = []
    for key, value in list(flags.items()):
        if _flag_like(key) and value.startswith("@"):
            flags[key] = "true"
            files.append(value)
    for arg in args:
        if not arg.startswith("@") or len(arg) == 1:
            raise click.UsageError(f"unexpected argument {arg!r}: config files are given as @path, settings as --section.key value")
        files.append(arg[1:])
    return [f[1:] if f.startswith("@") else f for f in files]
