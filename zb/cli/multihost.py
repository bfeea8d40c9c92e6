"""The options of commands that run as several ranks, spawned locally or joined across hosts
(`zb bench-allreduce`, `zb iperf-mesh`): --world-size, --store, --rank, --secret-file."""

from __future__ import annotations

import click

from zb.cli.types import TEXT


def multi_host_options(world_help: str, min_world: int = 1):
    """Decorator adding --world-size (help: `world_help`; at least `min_world`), --store, --rank and --secret-file,
    in that order."""
    def decorate(command):
        command = click.option("--secret-file", type=TEXT, default=None, envvar="ZB_ELASTIC_SECRET_FILE",
                               show_envvar=True, help="With --store: a run secret every rank holds (as `zb store "
                               "--new-secret` makes one); the store's records are sealed with it.")(command)
        command = click.option("--rank", type=click.IntRange(min=0), default=None,
                               help="This process's rank (with --store).")(command)
        command = click.option("--store", type=TEXT, default=None, metavar="HOST:PORT",
                               help="Join a multi-host run through this TCPStore (rank 0 hosts it); needs --rank.")(command)
        return click.option("--world-size", "-w", type=click.IntRange(min=min_world), default=2, show_default=True,
                            help=world_help)(command)
    return decorate


def store_secret(store: str | None, secret_file: str | None) -> bytes | None:
    """--secret-file's secret for a multi-host run (--store). Given on the command line without --store it is
    refused (the local ranks meet on a loopback store of their own); from ZB_ELASTIC_SECRET_FILE, a run's
    secret in the environment, it is not needed there."""
    from click.core import ParameterSource

    from zb.errors import InvalidInput
    from zb.secret import read_secret

    if store is None:
        if secret_file and click.get_current_context().get_parameter_source("secret_file") is ParameterSource.COMMANDLINE:
            raise InvalidInput("--secret-file goes with --store: the local ranks meet on a loopback store of their own")
        return None
    return read_secret(secret_file) if secret_file else None
