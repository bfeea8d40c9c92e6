"""docs/reference.md generated from the code, so it cannot drift from it: every config key (zb.config's
KEYS, from the schema), every environment variable (the twins and zb.config_schema.ENVIRONMENT), every
metrics event (zb.events), the exit codes (zb.errors.EXIT_CODES) and every command (the click tree).

Regenerate: `python -m zb.cli.reference` (or give another path); tests/test_reference.py fails when
docs/reference.md is stale.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path

import click

from zb import config_prime as prime
from zb import events
from zb.config import CHECKS, KEYS, WITHOUT_EFFECT, KeySpec, toml_value
from zb.config_schema import ENVIRONMENT, Config
from zb.errors import EXIT_CODES

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"
MAN_LINK = "../man/"  # the man pages, relative to docs/

HEADER = ("*Generated from the code by `python -m zb.cli.reference`: do not edit by hand; change the code and "
          "rerun it (tests/test_reference.py fails when this page is stale).*")

# Options every command has (zb.cli.verbosity), listed once rather than on every row.
COMMON_OPTIONS = ("-v", "-q", "--help")


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell (`<log.dir>` must not read as an HTML tag)."""
    return " ".join(text.replace("|", "\\|").replace("<", "&lt;").split())


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def section_docs() -> dict[str, str]:
    """{section path: its doc line} for every section of the config tree, nested ones too (ckpt.remote)."""
    out: dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.metadata.get("section"):
                continue
            path = prefix + f.name
            sub = f.metadata.get("optional")
            doc = f.metadata.get("doc", "")
            if sub is not None:
                doc += f" Off unless a {path}.* key is set (or an empty [{path}] table)."
            out[path] = doc
            walk(sub or hints[f.name], path + ".")

    walk(Config, "")
    return out


def prime_twins() -> dict[str, list[str]]:
    """{zb key: Prime's ZERO_BAND_<KEY> variables that set it}."""
    out: dict[str, list[str]] = {}
    for key in prime.all_keys():
        entry = prime.PRIME_KEYS.get(key)
        if isinstance(entry, prime.NoEffect):
            continue
        target = key if entry is None else entry.zb_key
        out.setdefault(target, []).append(prime.env_name(key))
    return out


def _type(spec: KeySpec) -> str:
    name = f"list of {spec.type.__name__}" if spec.items else spec.type.__name__
    return f"{name} or unset" if spec.optional else name


def _allowed(spec: KeySpec) -> str:
    parts = []
    if spec.check is not None:
        parts.append(CHECKS[spec.check][1])
    if spec.choices:
        parts.append("one of " + ", ".join(_code(c) for c in spec.choices))
    if spec.items:
        parts.append("each of " + ", ".join(_code(c) for c in spec.items))
    if spec.aliases:
        parts.append("aliases: " + ", ".join(f"{_code(str(a))} = {_code(toml_value(v))}" for a, v in spec.aliases.items()))
    return "; ".join(parts)


def config_section() -> list[str]:
    docs = section_docs()
    twins = prime_twins()
    by_section: dict[str, list[KeySpec]] = {}
    for key, spec in KEYS.items():
        by_section.setdefault(key.rsplit(".", 1)[0], []).append(spec)
    lines = ["## Config keys", "",
             "Set as `--section.key value` flags of `zb train`, in TOML files given as `@path`, or through the "
             "key's environment twin; later wins: defaults < files < twins < flags. *Run-defining* keys are "
             "the run's fingerprint: every node of a run must share them, the rest may differ per node. "
             "When both twins of a key are set, the first one listed (zb's) wins.", ""]
    for section, specs in by_section.items():
        lines += [f"### [{section}]", "", _cell(docs.get(section, "")), "",
                  "| key | type | default | allowed | env | run-defining | meaning |", "|---|---|---|---|---|---|---|"]
        for spec in specs:
            env = ", ".join(_code(name) for name in [spec.env, *twins.get(spec.key, [])])
            lines.append(f"| `{spec.key}` | {_type(spec)} | {_code(toml_value(spec.default))} | {_cell(_allowed(spec))} "
                         f"| {env} | {'yes' if spec.run_defining else ''} | {_cell(spec.doc)} |")
        lines.append("")
    return lines


def environment_section() -> list[str]:
    lines = ["## Environment variables", "",
             "Every config key's twins are in the *env* column of [Config keys](#config-keys): `ZB_<SECTION>_<KEY>`, "
             "or Prime's `GLOBAL_*` / `ZERO_BAND_*` name where the key has one, and Prime's `ZERO_BAND_<KEY>` for "
             "the keys Prime had. An unknown `ZB_*` or `ZERO_BAND_*` variable gets a warning naming the closest "
             "known one. The variables that are not config keys:", "",
             "| variable | meaning |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(meaning)} |" for name, meaning in ENVIRONMENT]
    lines += [f"| `{name}` | Prime's; no effect in zb (a warning says so): {_cell(why)}. |" for name, why in WITHOUT_EFFECT.items()]
    no_effect = [prime.env_name(key) for key, entry in prime.PRIME_KEYS.items() if isinstance(entry, prime.NoEffect)]
    lines += ["", "Prime's twins of the Prime keys zb has no counterpart for are read and warned about the same way: "
              + ", ".join(_code(name) for name in no_effect) + ".", ""]
    return lines


def events_section() -> list[str]:
    return ["## Metrics events", "",
            "Each line of `<log.dir>/metrics.jsonl` is one event: `event`, `time` and `node`, then the event's "
            "fields (from zb.events).", "", events.markdown()]


def exit_codes_section() -> list[str]:
    lines = ["## Exit codes", "", "| code | meaning |", "|---|---|"]
    return lines + [f"| {code} | {_cell(meaning)} |" for code, meaning in EXIT_CODES] + [""]


def _options(cmd: click.Command, ctx: click.Context) -> str:
    names = []
    for param in cmd.get_params(ctx):
        if not isinstance(param, click.Option) or param.hidden:
            continue
        name = param.opts[0]
        if name.lstrip("-") in KEYS or set(param.opts) & set(COMMON_OPTIONS):
            continue
        names.append(_code(name))
    if any(isinstance(p, click.Option) and p.opts[0].lstrip("-") in KEYS for p in cmd.get_params(ctx)):
        names.insert(0, "every config key as `--section.key` ([Config keys](#config-keys))")
    return ", ".join(names)


def _command_rows() -> list[tuple[str, click.Command, click.Context]]:
    """(name after zb, command, its context) for every registered command and a group's subcommands."""
    from zb.cli import cli

    root = click.Context(cli, info_name="zb", **cli.context_settings)
    rows: list[tuple[str, click.Command, click.Context]] = [("", cli, root)]
    for sub in cli.list_commands(root):
        cmd = cli.get_command(root, sub)
        assert cmd is not None  # list_commands named it
        ctx = click.Context(cmd, info_name=sub, parent=root, **cmd.context_settings)
        rows.append((sub, cmd, ctx))
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                leaf = cmd.get_command(ctx, name)
                assert leaf is not None  # list_commands named it
                rows.append((f"{sub} {name}", leaf, click.Context(leaf, info_name=name, parent=ctx, **leaf.context_settings)))
    return rows


def commands_section() -> list[str]:
    lines = ["## Commands", "",
             "Each has a man page (`zb man COMMAND`, e.g. `zb man ckpt-ls`) with every option; every command also "
             "takes " + ", ".join(_code(o) for o in COMMON_OPTIONS) + ".", "",
             "| command | what it does | options | man page |", "|---|---|---|---|"]
    for name, cmd, ctx in _command_rows():
        page = f"zb-{name.replace(' ', '-')}.1" if name else "zb.1"
        lines.append(f"| `{f'zb {name}'.strip()}` | {_cell(cmd.get_short_help_str(limit=200))} | {_options(cmd, ctx)} "
                     f"| [{page}]({MAN_LINK}{page}) |")
    return lines + [""]


def render() -> str:
    """The text of docs/reference.md."""
    sections = [("Config keys", config_section), ("Environment variables", environment_section),
                ("Metrics events", events_section), ("Exit codes", exit_codes_section), ("Commands", commands_section)]
    contents = [f"- [{title}](#{title.lower().replace(' ', '-')})" for title, _ in sections]
    lines = [HEADER, "", "# zb reference", "", *contents, ""]
    for _, make in sections:
        lines += make()
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else REFERENCE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render())
    print(path)


if __name__ == "__main__":
    main()
