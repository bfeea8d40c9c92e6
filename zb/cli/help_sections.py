"""`zb train --help [SECTION]`: a short help by default, one config section or every option on request.

The ~130 config options would make `--help` some 600 lines. By default it shows the command's own
options and one line per config section; `--help diloco` shows that section in full (flag, type,
default, help text, env twin), `--help all` every section under its heading. The man page groups
the options the same way (zb.cli.manpages reads `option_groups`).
"""

from __future__ import annotations

import dataclasses
import difflib

import click

from zb.cli.config_options import DEST_SEP
from zb.config import KEYS
from zb.config_schema import Config

ALL = "all"
_VIEW = "zb.help_view"   # ctx.meta key: "" (the short help), a section name, or ALL

# A few keys per section that most runs set, shown in the short help; other sections show their first ones.
COMMON_KEYS: dict[str, tuple[str, ...]] = {
    "model": ("name", "type", "attn_impl"),
    "train": ("micro_bs", "device", "ac_ckpt", "torch_compile"),
    "optim": ("lr", "batch_size", "total_steps", "warmup_steps"),
    "data": ("seq_length", "dataset_name_or_paths", "tokenizer", "fake"),
    "eval": ("interval", "batches"),
    "log": ("dir", "progress", "backends", "wandb_project"),
    "elastic": ("addr", "port", "unique_id", "world_size"),
    "ckpt": ("interval", "path", "resume", "topk"),
    "diloco": ("inner_steps", "outer_lr", "compression", "round_seconds"),
    "swarm": ("stages", "stage", "split", "host"),
}

HELP_OPTION_HELP = (f"Show this help and exit. With SECTION (e.g. diloco): that config section's options in full; "
                    f"with {ALL}: every option.")


def section_keys() -> dict[str, list[str]]:
    """{section: its keys, in schema order}, sections in schema order; `ckpt.remote.*` belongs to ckpt."""
    out: dict[str, list[str]] = {}
    for key in KEYS:
        out.setdefault(key.split(".", 1)[0], []).append(key)
    return out


def section_doc(name: str) -> str:
    return next(f.metadata.get("doc", "") for f in dataclasses.fields(Config) if f.name == name)


def _common(name: str, keys: list[str]) -> str:
    """A few of the section's keys, most used first; `...` when it has more."""
    short = [k.split(".", 1)[1] for k in keys]
    common = [k for k in COMMON_KEYS.get(name, ()) if k in short] or short[:3]
    return ", ".join(common) + (", ..." if len(common) < len(short) else "")


def _pick_view(value: str) -> str:
    """The view `--help VALUE` asks for; an unknown section is one line and exit 2."""
    if value == "" or value.startswith("@"):   # `zb train --help @my.toml`: the file is not a section
        return ""
    names = list(section_keys()) + [ALL]
    if value.lower() in names:
        return value.lower()
    from zb.errors import InvalidInput

    close = difflib.get_close_matches(value.lower(), names, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise InvalidInput(f"unknown help section {value!r}{hint}; sections: {', '.join(names)}")


def _show_help(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is None or ctx.resilient_parsing:
        return
    ctx.meta[_VIEW] = _pick_view(value)
    click.echo(ctx.get_help(), color=ctx.color)
    ctx.exit()


class SectionedCommand(click.Command):
    """A command whose schema options are grouped by config section in --help and in the man page."""

    _zb_help_option: click.Option | None = None

    def get_help_option(self, ctx: click.Context) -> click.Option | None:
        names = self.get_help_option_names(ctx)
        if not names or not self.add_help_option:
            return None
        if self._zb_help_option is None:   # one object: click orders eager callbacks by identity
            self._zb_help_option = click.Option(
                [*names, "zb_help"], type=str, default=None, is_flag=False, flag_value="", metavar="[SECTION]",
                expose_value=False, is_eager=True, callback=_show_help, help=HELP_OPTION_HELP)
        return self._zb_help_option

    def grouped(self, ctx: click.Context) -> tuple[list[click.Parameter], dict[str, list[click.Parameter]]]:
        """(the command's own options, {section: its options in schema order}), hidden ones left out."""
        shown: list[click.Parameter] = [p for p in self.get_params(ctx)
                                        if isinstance(p, click.Option) and p.get_help_record(ctx) is not None]
        by_key = {(p.name or "").replace(DEST_SEP, "."): p for p in shown}
        own = [p for p in shown if (p.name or "").replace(DEST_SEP, ".") not in KEYS]
        sections = {name: [by_key[k] for k in keys if k in by_key] for name, keys in section_keys().items()}
        return own, {name: params for name, params in sections.items() if params}

    def option_groups(self, ctx: click.Context) -> list[tuple[str | None, list[click.Parameter]]]:
        """[(None, the command's own options), (a section's heading, its options), ...]: for the man page."""
        own, sections = self.grouped(ctx)
        return [(None, own)] + [(_heading(name, params), params) for name, params in sections.items()]

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        view = ctx.meta.get(_VIEW, "")
        self.format_usage(ctx, formatter)
        own, sections = self.grouped(ctx)
        if view not in ("", ALL):
            _write_section(ctx, formatter, view, sections[view])
            return
        self.format_help_text(ctx, formatter)
        with formatter.section("Options"):
            formatter.write_dl(_help_records(ctx, own))
        if view == ALL:
            for name, params in sections.items():
                _write_section(ctx, formatter, name, params)
        else:
            self._format_overview(ctx, formatter)
        self.format_epilog(ctx, formatter)

    def _format_overview(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """One line per section; the epilog, next, says how to see them in full."""
        formatter.write_paragraph()
        formatter.write_text(f"Config sections ({len(KEYS)} options: --section.key VALUE, [section] in a @file, "
                             f"or the env twin):")
        rows = [(name, f"{len(keys):>2}: {_common(name, keys)}") for name, keys in section_keys().items()]
        with formatter.indentation():
            formatter.write_dl(rows)


def _heading(name: str, params: list[click.Parameter]) -> str:
    return f"{name} ({len(params)} options): {section_doc(name)}"


def _write_section(ctx: click.Context, formatter: click.HelpFormatter, name: str,
                   params: list[click.Parameter]) -> None:
    formatter.write_paragraph()
    formatter.write_text(_heading(name, params))
    with formatter.indentation():
        formatter.write_dl(_help_records(ctx, params))


def _help_records(ctx: click.Context, params: list[click.Parameter]) -> list[tuple[str, str]]:
    """The help rows of `params` (grouped keeps only the options that have one)."""
    return [record for p in params if (record := p.get_help_record(ctx)) is not None]
