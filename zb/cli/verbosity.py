"""-v/-q after the subcommand as well as before it: `zb train -v` and `zb -v train` mean the same.

The group's own options count first; each subcommand gets the same two options, whose values add to
them and set the log level again before the command runs."""

from __future__ import annotations

import click

VERBOSE_HELP = "Debug log lines (per-step timings, settings and their sources)."
QUIET_HELP = "Less log output (warnings and errors only)."


def _apply(ctx: click.Context, param: click.Parameter, value: int) -> int:
    if value:
        from zb.log import setup_logging

        root = ctx.find_root()
        root.obj = root.obj or {}
        root.obj["verbosity"] = root.obj.get("verbosity", 0) + (value if param.name == "verbose" else -value)
        setup_logging(root.obj["verbosity"])
    return value


def add_verbosity_options(command: click.Command) -> click.Command:
    """Give `command` (and a group's subcommands) -v/--verbose and -q/--quiet, once."""
    names = {opt for p in command.params for opt in getattr(p, "opts", ())}
    if "-v" not in names:
        command.params += [
            click.Option(["-v", "--verbose"], count=True, expose_value=False, callback=_apply, help=VERBOSE_HELP),
            click.Option(["-q", "--quiet"], count=True, expose_value=False, callback=_apply, help=QUIET_HELP),
        ]
    for sub in getattr(command, "commands", {}).values():
        add_verbosity_options(sub)
    return command
