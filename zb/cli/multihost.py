"""The options of commands that run as several ranks, spawned locally or joined across hosts
(`zb bench-allreduce`, `zb iperf-mesh`): --world-size, --store, --rank."""

from __future__ import annotations

import click

from zb.cli.types import TEXT


def multi_host_options(world_help: str, min_world: int = 1):
    """Decorator adding --world-size (help: `world_help`; at least `min_world`), --store and --rank, in that order."""
    def decorate(command):
        command = click.option("--rank", type=click.IntRange(min=0), default=None,
                               help="This process's rank (with --store).")(command)
        command = click.option("--store", type=TEXT, default=None, metavar="HOST:PORT",
                               help="Join a multi-host run through this TCPStore (rank 0 hosts it); needs --rank.")(command)
        return click.option("--world-size", "-w", type=click.IntRange(min=min_world), default=2, show_default=True,
                            help=world_help)(command)
    return decorate
