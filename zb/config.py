"""Load and validate the config tree (zb.config_schema).

Sources, later wins: defaults < TOML files given as @path (left to right) < env twins < flags.
Every key `section.key` has the env twin ZB_<SECTION>_<KEY> unless the schema names another (Prime's
GLOBAL_* and ZERO_BAND_* variables). Errors name the key and where its value came from; unknown keys
in files and flags are errors, unknown ZB_* variables only warnings.

Prime's spelling is read too (zb.config_prime): its keys in files and flags, its ZERO_BAND_<KEY>
twins. A file in Prime's spelling brings Prime's defaults for the keys it leaves unset; Prime keys
zb has no use for are warned about once each.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import re
import sys
import typing
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zb import config_prime as prime
from zb.addresses import bracket_hint, valid_store_list
from zb.config_checks import advisories, problems
from zb.config_schema import ENVIRONMENT, Config
from zb.errors import InvalidInput, ZbError
from zb.model_sizes import model_names

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger("zb.config")

# ZB_* variables that are not config keys but are read elsewhere (kernel path switch, test knobs).
KNOWN_ENV = {name for name, _ in ENVIRONMENT if name.startswith("ZB_")}   # zb's variables that are no config key
# Prime's variables that zb reads nowhere, and what to use instead: said once, never silently ignored.
WITHOUT_EFFECT = {"ZERO_BAND_IPERF_PORT": "zb does not measure links at start; run `zb iperf-mesh` (--port) before a run"}

DEFAULT = "default"
PRIME_DEFAULT = "Prime's default"

# data.tokenizer = auto on real data: the tokenizer Prime used for each model family.
PRIME_TOKENIZERS = {"llama2": "mistralai/Mistral-7B-v0.1", "llama3": "meta-llama/Meta-Llama-3-8B"}

# A node id names directories (checkpoints, RAM staging) and store keys: no separators, no `..`.
NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NODE_ID_RULE = "must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"

MAX_SEQ_LENGTH = 2 ** 20  # see the "seq_length" check

# The value ranges a knob can declare (`knob(check=...)`): a test and the message that says why.
# Written as `not (...)`-safe comparisons: non-finite floats never reach them (see _convert).
CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "positive": (lambda v: v > 0, "must be positive"),
    "non_negative": (lambda v: v >= 0, "must not be negative"),
    "fraction": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "port": (lambda v: 0 < v < 65536, "must be a TCP port (1-65535)"),
    "store_list": (lambda v: valid_store_list(v), "must be host[:port], or several in failover order: "
                   "host[:port],host[:port] (each store once, ports 1-65535)"),
    "interval": (lambda v: v >= -1, "must be a step count, 0 (only at the end) or -1 (never)"),
    "node_id": (lambda v: bool(NODE_ID.fullmatch(v)), NODE_ID_RULE + " (it names directories and store keys)"),
    # Every rank builds RoPE tables of seq_length x head_dim at start and a sequence's activations grow with it:
    # past 2^20 tokens (beyond the longest contexts models are trained at) no machine holds one, and a typo
    # such as 1e9 would die in an allocation (tens of GB for the tables alone) instead of here.
    "seq_length": (lambda v: 0 < v <= MAX_SEQ_LENGTH, f"must be between 1 and {MAX_SEQ_LENGTH} (2^20) tokens"),
}


class ConfigError(InvalidInput):
    """A config value is invalid; the message names the key and its source."""


@dataclass(frozen=True)
class KeySpec:
    key: str            # "optim.lr"
    type: Any           # int, float, str, bool
    optional: bool      # None is allowed
    default: Any
    doc: str
    choices: tuple
    aliases: dict
    env: str            # env twin name
    check: str | None   # a name in CHECKS
    run_defining: bool  # every node of a run must share it (the run fingerprint)
    items: tuple = ()   # a list knob: the words it may hold (stored as "a,b")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return tp, False


def _section_cls(f: dataclasses.Field, tp: Any) -> type | None:
    if not f.metadata.get("section"):
        return None
    return f.metadata.get("optional") or _unwrap_optional(tp)[0]


def _collect(cls: type, prefix: str = "") -> dict[str, KeySpec]:
    specs: dict[str, KeySpec] = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        sub = _section_cls(f, hints[f.name])
        if sub is not None:
            specs.update(_collect(sub, key + "."))
            continue
        tp, optional = _unwrap_optional(hints[f.name])
        env = f.metadata.get("env") or "ZB_" + key.replace(".", "_").upper()
        check = f.metadata.get("check")
        if check is not None and check not in CHECKS:
            raise AssertionError(f"{key}: unknown check {check!r}")
        specs[key] = KeySpec(key, tp, optional, f.default, f.metadata.get("doc", ""), f.metadata.get("choices", ()),
                             f.metadata.get("aliases", {}), env, check, f.metadata.get("run_defining", False),
                             f.metadata.get("items", ()))
    return specs


KEYS: dict[str, KeySpec] = _collect(Config)
SECTIONS: set[str] = {k.rsplit(".", 1)[0] for k in KEYS if "." in k} | {
    ".".join(k.split(".")[:i]) for k in KEYS for i in range(1, k.count(".") + 1)} | prime.PRIME_SECTIONS


def _describe(source: str) -> str:
    return "" if source == DEFAULT else f" (from {source})"


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, list(KEYS) + list(prime.PRIME_KEYS), n=1)
    return f"; did you mean {close[0]}?" if close else "; see `zb train --help` for the keys"


def _suggest_section(name: str) -> str:
    """A section for an unknown one: a table is a section, so a key (optim.lr for [optimizer]) would mislead."""
    close = difflib.get_close_matches(name, sorted(SECTIONS), n=1)
    if close:
        return f"; did you mean [{close[0]}]?"
    tops = sorted({s for s in SECTIONS if "." not in s} - prime.PRIME_SECTIONS)
    return f"; the sections are {', '.join(f'[{s}]' for s in tops)}"


def _convert(spec: KeySpec, value: Any, source: str) -> Any:
    """Turn a TOML value or a string from env/flags into the key's type, or raise naming key and source."""
    where = _describe(source)
    if isinstance(value, str) and spec.optional and value.strip().lower() in ("none", "null"):
        return None
    try:
        if spec.type is bool:
            value = _to_bool(value)
        elif spec.type is int:
            # An int knob with true/false aliases (train.ac_ckpt) also takes a boolean.
            if isinstance(value, bool) and spec.aliases:
                value = int(value)
            elif isinstance(value, str) and value.strip().lower() in spec.aliases:
                value = spec.aliases[value.strip().lower()]
            value = _to_int(value)
        elif spec.type is float:
            # A float knob with a "true" alias (diloco.clip) takes true, alone or as a boolean, for its measured value.
            if (value is True or isinstance(value, str) and value.strip().lower() == "true") and "true" in spec.aliases:
                value = spec.aliases["true"]
            if isinstance(value, bool):
                raise ValueError
            value = float(value)
            if not math.isfinite(value):
                # NaN passes every `<= 0` check and inf every lower bound: refuse both here, for every key.
                raise ConfigError(f"{spec.key} = {toml_value(value)}{where}: must be a finite number")
        elif spec.items:
            value = _to_list(spec, value, where)
        elif spec.type is str and not isinstance(value, str):
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"{spec.key} = {toml_value(value)}{where}: expected {spec.type.__name__}") from None
    if spec.type is str:
        if not is_text(value):
            raise ConfigError(f"{spec.key} = {toml_value(value)}{where}: not UTF-8 text (undecodable bytes); "
                              "give it as UTF-8")
        value = spec.aliases.get(value, spec.aliases.get(value.strip().lower(), value))
        if spec.choices and value not in spec.choices:
            raise ConfigError(f"{spec.key} = {toml_value(value)}{where}: must be one of {', '.join(spec.choices)}")
    if spec.check is not None and value is not None:
        test, rule = CHECKS[spec.check]
        if not test(value):
            hint = bracket_hint(value) if spec.check == "store_list" else ""   # the one mistake the rule cannot name
            raise ConfigError(f"{spec.key} = {toml_value(value)}{where}: {rule}" + (f"; {hint}" if hint else ""))
    return value


def parse_value(key: str, value: Any, source: str) -> Any:
    """One key's value from one source, converted and range-checked as the loader does (for readers
    that run before the config, such as zb.log's early level)."""
    return _convert(KEYS[key], value, source)


def is_text(value: str) -> bool:
    """False for a string holding bytes that were not UTF-8: Python passes undecodable bytes of argv and
    the environment on as lone surrogates, which no file name, host or header can be encoded from."""
    try:
        value.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError


def _to_list(spec: KeySpec, value: Any, where: str) -> str:
    """A list knob's value (a TOML array, or "a,b" from a flag or variable) as "a,b", each word checked."""
    words = value.split(",") if isinstance(value, str) else value
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise ValueError
    out: list[str] = []
    for word in (w.strip().lower() for w in words if w.strip()):
        if word not in spec.items:
            raise ConfigError(f"{spec.key} = {toml_value(value)}{where}: unknown entry {word!r}; each must be one of "
                              f"{', '.join(spec.items)}")
        if word not in out:
            out.append(word)
    if not out:
        raise ConfigError(f"{spec.key} = {toml_value(value)}{where}: give at least one of {', '.join(spec.items)}")
    return ",".join(out)


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        return int(float(text)) if "e" in text.lower() and float(text).is_integer() else int(text)
    raise ValueError


def _flatten_toml(table: Mapping[str, Any], source: str, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in table.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            if key not in SECTIONS:
                raise ConfigError(f"unknown section [{key}] in {source}" + _suggest_section(key))
            flat[key] = {}  # marks the section as present (an empty [diloco] turns DiLoCo on)
            flat.update(_flatten_toml(value, source, key + "."))
        elif key in KEYS or key in prime.PRIME_KEYS:
            flat[key] = value
        else:
            raise ConfigError(f"unknown key {key} in {source}" + _suggest(key))
    return flat


def read_toml(path: str) -> dict[str, Any]:
    """Flat {key: value} of one config file; a missing or malformed file is an InvalidInput."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {path} is a directory; a config file is expected: @FILE.toml"
                          + _tomls_in(p))
    if not p.is_file():
        raise ConfigError(f"config file {path} not found")
    try:
        table = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except RecursionError:  # tomllib recurses once per nested array or inline table
        raise ConfigError(f"config file {path} is not valid TOML: nested too deeply (no config nests more "
                          "than a few levels)") from None
    return _flatten_toml(table, str(path))


def _tomls_in(directory: Path) -> str:
    """The config files a directory holds, for the line that refuses the directory itself."""
    try:
        found = sorted(str(f) for f in directory.glob("*.toml") if f.is_file())
    except OSError:
        return ""
    if not found:
        return ""
    return f" (it holds {', '.join('@' + f for f in found[:3])}{', ...' if len(found) > 3 else ''})"


def env_values(environ: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(key, raw value, variable name) for every env twin that is set, Prime's ZERO_BAND_<KEY> twins
    first so that zb's own twin of the same key wins; keys may be Prime's. Warns on unknown ZB_* and
    ZERO_BAND_* names (Prime's prefix: a Prime user's setting must not vanish without a word)."""
    by_env = {spec.env: spec.key for spec in KEYS.values()}
    found = []
    for name, raw in sorted(environ.items(), key=lambda item: (item[0] not in prime.ENV_TWINS, item[0])):
        if name in by_env:
            found.append((by_env[name], raw, name))
        elif name in prime.ENV_TWINS:
            found.append((prime.ENV_TWINS[name], raw, name))
        elif name in WITHOUT_EFFECT:
            log.warning("%s has no effect in zb: %s", name, WITHOUT_EFFECT[name])
        elif name.startswith(("ZB_", "ZERO_BAND_")) and name not in KNOWN_ENV:
            names = list(by_env) + list(prime.ENV_TWINS) + list(KNOWN_ENV)
            hint = difflib.get_close_matches(name, names, n=1)
            log.warning("ignoring unknown environment variable %s%s", name, f" (did you mean {hint[0]}?)" if hint else "")
    return found


def normalize_key(key: str) -> str:
    """`--optim.warmup-steps` and `optim.warmup_steps` name the same key."""
    return key.lstrip("-").replace("-", "_")


class _Reading:
    """The values read so far, each with its source; Prime's keys translated on the way in, and
    what was translated or found without effect remembered for --print-config and the warnings."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[Any, str]] = {}
        self.present: set[str] = set()
        self.notes: list[str] = []         # "name_model -> model.name (file a.toml)"
        self.no_effect: list[str] = []     # "project (file a.toml) has no effect in zb: ..."

    def put(self, key: str, value: Any, source: str) -> None:
        if key not in prime.PRIME_KEYS:
            self.values[key] = (value, source)
            return
        try:
            meaning = prime.translate(key, value)
        except prime.PrimeValueError as e:
            raise ConfigError(f"{key} = {toml_value(value)}{_describe(source)}: {e}") from None
        if meaning.zb_key is not None:
            self.values[meaning.zb_key] = (meaning.value, f"{source}, Prime's {key}")
            self.notes.append(f"{key} -> {meaning.zb_key} ({source})")
        elif meaning.no_effect is not None:
            self.no_effect.append(f"{key} ({source}) has no effect in zb: {meaning.no_effect}")


def load_config(files: Sequence[str] = (), flags: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> Config:
    """Resolve the config from files, env twins and flags; validate it; record each value's source."""
    environ = os.environ if environ is None else environ
    reading = _Reading()
    prime_files = []
    for path in files:
        flat = read_toml(path)
        if any(prime.is_prime_only(key) for key in flat):
            prime_files.append(path)
        for key, value in flat.items():
            if value == {}:
                if key not in prime.PRIME_SECTIONS:
                    reading.present.add(key)
            else:
                reading.put(key, value, f"file {path}")
    for key, raw, name in env_values(environ):
        reading.put(key, raw, f"env {name}")
    for key, raw in (flags or {}).items():
        key = normalize_key(key)
        if key not in KEYS and key not in prime.PRIME_KEYS:
            raise ConfigError(f"unknown key {key}" + _suggest(key))
        reading.put(key, raw, f"flag --{key}")
    if prime_files:
        _add_prime_defaults(reading)
        reading.notes.insert(0, f"{', '.join(prime_files)}: Prime's spelling; Prime's defaults fill the keys left unset")
    cfg = build(reading.values, reading.present)
    object.__setattr__(cfg, "_notes", reading.notes + reading.no_effect)
    for line in reading.no_effect:
        _warn_once(line)
    return cfg


def _add_prime_defaults(reading: _Reading) -> None:
    values = reading.values
    name = values.get("model.name", (None,))[0]
    if "model.type" not in values and name not in model_names("llama3") and name in model_names("llama2"):
        # Prime's default family has no such size (Prime stopped with a KeyError): the only family
        # that has it is what the file can mean.
        values["model.type"] = ("llama2", f"{PRIME_DEFAULT} for {name} (llama3 has no {name})")
    for key, value in prime.PRIME_DEFAULTS.items():
        if key == "data.dataset_name_or_paths" and "data.fake" in values:
            continue  # Prime's fake data replaces the dataset rather than conflicting with its default
        values.setdefault(key, (value, PRIME_DEFAULT))


_warned: set[str] = set()


def _warn_once(line: str) -> None:
    """Warn on local rank 0 only, once per process: every rank of a node reads the same config."""
    if line in _warned or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    _warned.add(line)
    log.warning("%s", line)


def build(values: Mapping[str, tuple[Any, str]], present: Set[str] = frozenset()) -> Config:
    cfg = Config()
    sources = {key: DEFAULT for key in KEYS}
    for section in present:
        _ensure_section(cfg, section)
    for key, (value, source) in values.items():
        spec = KEYS[key]
        owner = _ensure_section(cfg, key.rsplit(".", 1)[0])
        setattr(owner, key.rsplit(".", 1)[1], _convert(spec, value, source))
        sources[key] = source
    object.__setattr__(cfg, "_sources", sources)
    _resolve_tokenizer(cfg, sources)
    for key, message in problems(cfg):
        fail(cfg, key, message)
    for key, message in advisories(cfg):
        _warn_once(f"{key} = {toml_value(get(cfg, key))}{_describe(source_of(cfg, key))}: {message}")
    return cfg


def auto_tokenizer(model_type: str, fake: bool, dataset: str) -> str:
    """What data.tokenizer = auto means: bytes for the builtin or fake data, else Prime's choice per model.type."""
    return "bytes" if fake or dataset == "builtin" else PRIME_TOKENIZERS.get(model_type, "bytes")


def _resolve_tokenizer(cfg: Config, sources: dict[str, str]) -> None:
    """data.tokenizer = auto becomes a name here, so the fingerprint and --print-config show it."""
    if cfg.data.tokenizer != "auto":
        return
    cfg.data.tokenizer = auto_tokenizer(cfg.model.type, cfg.data.fake, cfg.data.dataset_name_or_paths)
    was = sources["data.tokenizer"]
    sources["data.tokenizer"] = "auto" if was == DEFAULT else f"{was}, auto"


def _ensure_section(cfg: Config, path: str) -> Any:
    """The section object at `path`, creating an optional section (diloco) on first use."""
    obj: Any = cfg
    for name in path.split("."):
        child = getattr(obj, name)
        if child is None:
            opt = next(f for f in dataclasses.fields(obj) if f.name == name).metadata["optional"]
            child = opt()
            setattr(obj, name, child)
        obj = child
    return obj


def source_of(cfg: Config, key: str) -> str:
    return getattr(cfg, "_sources", {}).get(key, DEFAULT)


def toml_value(value: Any) -> str:
    """A value as a config file writes it (true, not True; a string quoted as TOML reads it); None, which
    TOML cannot write, is "unset" (messages say so; --print-config comments the key out instead)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        if not value.isprintable():
            return repr(value)      # escaped: undecodable bytes must not reach a terminal raw
        if "'" not in value:
            return f"'{value}'"     # a literal string: no escapes
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def fail(cfg: Config, key: str, message: str, error: type[ZbError] | None = None) -> typing.NoReturn:
    """Raise a ConfigError (or `error`) for `key` that names its value and where that value came from."""
    raise (error or ConfigError)(f"{key} = {toml_value(get(cfg, key))}{_describe(source_of(cfg, key))}: {message}")


def get(cfg: Config, key: str) -> Any:
    obj: Any = cfg
    for name in key.split("."):
        if obj is None:
            return None
        obj = getattr(obj, name)
    return obj


def non_default_settings(cfg: Config) -> list[tuple[str, Any, str]]:
    """(key, value, source) of every key whose value did not come from zb's defaults."""
    return [(key, get(cfg, key), source_of(cfg, key)) for key in KEYS if source_of(cfg, key) != DEFAULT]


def to_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as nested plain data (what goes into checkpoints and fingerprints)."""
    return dataclasses.asdict(cfg)


def describe(cfg: Config) -> str:
    """The resolved config as TOML, each value annotated with its source (for --print-config)."""
    lines: list[str] = [f"# {note}" for note in getattr(cfg, "_notes", [])]
    current = None
    for key in _table_order():
        spec = KEYS[key]
        section, name = key.rsplit(".", 1)
        top = section.split(".")[0]
        if top in ("diloco", "swarm") and getattr(cfg, top) is None:
            if current != top:
                what = "DiLoCo" if top == "diloco" else "DiLoCo-SWARM (pipeline stages)"
                lines += ["", f"# [{top}] is off: set any {top}.* key to turn {what} on"]
                current = top
            continue
        if section != current:
            lines += ["", f"[{section}]"]
            current = section
        value = get(cfg, key)
        text = f"# {name} = (unset)" if value is None else f"{name} = {toml_value(value)}"
        lines.append(text.ljust(44) + f"  # {source_of(cfg, key)}  ({spec.env})")
    return "\n".join(lines).strip() + "\n"


def _table_order() -> list[str]:
    """Keys grouped so that each TOML table is declared once: a section's own keys, then its
    subsections (ckpt.remote after the rest of ckpt), sections in schema order."""
    first: dict[str, int] = {}
    top: dict[str, int] = {}
    for i, key in enumerate(KEYS):
        first.setdefault(key.rsplit(".", 1)[0], i)
        top.setdefault(key.split(".")[0], i)
    return sorted(KEYS, key=lambda k: (top[k.split(".")[0]], k.count("."), first[k.rsplit(".", 1)[0]]))


