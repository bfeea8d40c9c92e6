"""The `zb` command group.

Subcommands live in one small module each and are imported only when invoked, so `zb --help`
stays instant (torch takes seconds to import). Register a command by adding it to COMMANDS;
register only commands that work.
"""

from __future__ import annotations

import importlib
import sys

import click

from zb import __version__
from zb.cli.verbosity import QUIET_HELP, VERBOSE_HELP
from zb.process_exit import leave, leave_if_gloo_used
from zb.stop_signals import exiting, interrupted, raise_on_stop
from zb.torch_log import quiet_torch_log

# name -> "module:attribute"; order is the order shown in `zb --help`.
COMMANDS: dict[str, str] = {
    "train": "zb.cli.train:train",
    "store": "zb.cli.store:store",
    "status": "zb.cli.status:status",
    "ckpt-serve": "zb.cli.ckpt_serve:ckpt_serve",
    "subset-data": "zb.cli.subset_data:subset_data",
    "export": "zb.cli.export:export",
    "generate": "zb.cli.generate:generate",
    "ckpt": "zb.cli.ckpt:ckpt",
    "bench-allreduce": "zb.cli.bench_allreduce:bench_allreduce",
    "iperf-mesh": "zb.cli.iperf_mesh:iperf_mesh",
    "man": "zb.cli.man:man",
}


class LazyGroup(click.Group):
    """A click group that imports a subcommand's module only when that command is used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        from zb.cli.verbosity import add_verbosity_options

        return add_verbosity_options(getattr(importlib.import_module(module_name), attr))


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help=VERBOSE_HELP + " Also after the command: zb train -v.")
@click.option("-q", "--quiet", count=True, help=QUIET_HELP)
@click.version_option(__version__, prog_name="zb")
@click.pass_context
def cli(ctx: click.Context, verbose: int, quiet: int) -> None:
    """zb: train language models across poorly connected machines.

    FSDP2 shards the model over a node's local ranks; DiLoCo syncs nodes every H inner steps
    over an elastic set of nodes coordinated by one global store (`zb store`).
    """
    from zb.log import setup_logging

    ctx.obj = {"verbosity": verbose - quiet}
    setup_logging(verbose - quiet)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: expected failures become one line and an exit code."""
    raise_on_stop()   # SIGINT and SIGTERM alike: one line and 128 + the signal (zb.stop_signals)
    quiet_torch_log()   # before any command imports torch (zb.torch_log: a reverse DNS lookup per log line)
    try:
        _dispatch(argv)
    except SystemExit as e:
        _leave(e.code)
        raise
    _leave(0)


def _leave(code) -> None:
    exiting()   # a signal from now on: one line and out (zb.stop_signals)
    if interrupted() is not None:
        leave(code)   # stopped by a signal: a thread still at work (a pool's) must not hold the exit
    leave_if_gloo_used(code)   # training and benchmark ranks exit without finalization (zb.process_exit)


def _dispatch(argv: list[str] | None) -> None:
    from zb.cli.terminal import abort
    from zb.errors import ZbError

    try:
        cli.main(args=argv, prog_name="zb", standalone_mode=False)
    except click.exceptions.Abort as e:
        _interrupted(e.__cause__)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except ZbError as e:
        abort(str(e), e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except KeyboardInterrupt as e:
        _interrupted(e)


def _interrupted(cause: BaseException | None) -> None:
    """The one line of a stop signal (click turns Ctrl-C into Abort, the signal's exception its cause)."""
    from zb.cli.terminal import abort
    from zb.stop_signals import Interrupted

    if isinstance(cause, Interrupted):
        abort(cause.message(), cause.exit_code)
    abort("interrupted", 130)
