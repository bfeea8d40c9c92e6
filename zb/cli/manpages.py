"""Man pages generated from the click definitions, so they cannot drift from --help.

They live in the checkout's man/ and ship inside the wheel (zb/man/, package data), where `zb man` finds
them, and in <prefix>/share/man/man1, where `man` does (pyproject.toml's data-files). Regenerate:
`python -m zb.cli.manpages`; tests/test_manpages.py fails when man/ is stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from zb import __version__
from zb.resources import resource_dir

MAN_DIR = resource_dir("man", "zb.1")


def _escape(text: str) -> str:
    lines = [line.replace("\\", "\\e").replace("-", "\\-") for line in text.splitlines()]
    # A roff line starting with . or ' is a request: protect it.
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line for line in lines)


def _entries(params: list[click.Parameter], ctx: click.Context) -> list[str]:
    out = []
    for param in params:
        record = param.get_help_record(ctx)
        if record is None or isinstance(param, click.Argument):
            continue
        names, help_text = record
        out += [".TP", f"\\fB{_escape(names)}\\fR", _escape(help_text or "")]
    return out


def _option_entries(cmd: click.Command, ctx: click.Context) -> list[str]:
    """Every option; a command that groups its options (zb train: by config section) gets a heading per group."""
    groups = cmd.option_groups(ctx) if hasattr(cmd, "option_groups") else [(None, cmd.get_params(ctx))]
    out = []
    for heading, params in groups:
        out += ([f".SS {_escape(heading)}"] if heading else []) + _entries(params, ctx)
    return out


def render(cmd: click.Command, name: str, parent: click.Context | None = None) -> str:
    """The roff source of one command's man page."""
    ctx = click.Context(cmd, info_name=name, parent=parent, **cmd.context_settings)
    title = name.replace(" ", "-").upper()
    usage = " ".join(cmd.collect_usage_pieces(ctx))
    short = cmd.get_short_help_str(limit=200)
    lines = [f'.TH {title} 1 "" "zb {__version__}" "zb manual"', ".SH NAME", f"{_escape(name)} \\- {_escape(short)}",
             ".SH SYNOPSIS", f"\\fB{_escape(name)}\\fR {_escape(usage)}", ".SH DESCRIPTION",
             _escape(cmd.help or "")]
    lines += [".SH OPTIONS"] + _option_entries(cmd, ctx)
    if cmd.epilog:
        lines += [".SH NOTES", _escape(cmd.epilog)]
    if isinstance(cmd, click.Group):
        lines += [".SH COMMANDS"]
        for sub in cmd.list_commands(ctx):
            sub_cmd = cmd.get_command(ctx, sub)
            assert sub_cmd is not None  # list_commands named it
            lines += [".TP", f"\\fB{sub}\\fR", _escape(sub_cmd.get_short_help_str(limit=200)),
                      f"See \\fB{_escape(name.replace(' ', '-'))}\\-{sub}\\fR(1)."]
    return "\n".join(lines) + "\n"


def all_pages() -> dict[str, str]:
    """{file name: roff text} for `zb` and every registered subcommand."""
    from zb.cli import cli

    root_ctx = click.Context(cli, info_name="zb", **cli.context_settings)
    pages = {"zb.1": render(cli, "zb")}
    for sub in cli.list_commands(root_ctx):
        cmd = cli.get_command(root_ctx, sub)
        assert cmd is not None  # list_commands named it
        pages[f"zb-{sub}.1"] = render(cmd, f"zb {sub}", parent=root_ctx)
        if isinstance(cmd, click.Group):  # a group's subcommands get pages too: zb-ckpt-ls.1 (zb man ckpt-ls)
            ctx = click.Context(cmd, info_name=sub, parent=root_ctx, **cmd.context_settings)
            for name in cmd.list_commands(ctx):
                leaf = cmd.get_command(ctx, name)
                assert leaf is not None  # list_commands named it
                pages[f"zb-{sub}-{name}.1"] = render(leaf, f"zb {sub} {name}", parent=ctx)
    return pages


def write_pages(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for fname, text in all_pages().items():
        path = directory / fname
        path.write_text(text)
        written.append(path)
    for stale in set(directory.glob("zb*.1")) - set(written):
        stale.unlink()
    return written


if __name__ == "__main__":
    for p in write_pages(Path(sys.argv[1]) if len(sys.argv) > 1 else MAN_DIR):
        print(p)
