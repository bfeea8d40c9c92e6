"""`zb store`: host the global TCPStore of a run as its own process, until SIGINT/SIGTERM; with
--http-port, also the run's dashboard (as `zb status --serve` does)."""

from __future__ import annotations

import click

from zb.cli.types import TEXT

EPILOG = """With a run secret (--new-secret FILE makes one; copy it to every node and pass it as --secret-file,
elastic.secret_file or ZB_ELASTIC_SECRET_FILE) only nodes holding it join: every record in the store is
sealed with it. Without one, anyone who reaches the port can join the run. The secret does not encrypt:
across the internet, also run nodes and the store on a private network (WireGuard, Tailscale) and bind the
store to that network's address (docs/security.md). The dashboard (--http-port) is read-only and listens
on the same address as the store.

A standby for a run that must outlive its store is one more `zb store` on another machine, named after the
first in every node's GLOBAL_ADDR (host:port,host:port): the run moves there when the first has been
silent for elastic.store_failover_s (30 s)."""


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110}, epilog=EPILOG)
@click.option("--host", type=TEXT, default="127.0.0.1", show_default=True,
              help="Address to bind (0.0.0.0 for every interface). Workers reach it as GLOBAL_ADDR.")
@click.option("--port", type=click.IntRange(1, 65535), default=29600, show_default=True,
              help="TCP port to listen on. Workers reach it as GLOBAL_PORT.")
@click.option("--http-port", type=click.IntRange(0, 65535), default=None,
              help="Also serve the run's live dashboard (read-only) on this port of --host (0: a free one).")
@click.option("--secret-file", type=TEXT, default=None, envvar="ZB_ELASTIC_SECRET_FILE", show_envvar=True,
              help="The run secret: only nodes holding the same file join (see below).")
@click.option("--new-secret", type=TEXT, default=None, metavar="FILE",
              help="Write a new run secret to FILE (never over an existing file) and use it.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document (address, port, env) on stdout once listening.")
def store(host: str, port: int, http_port: int | None, secret_file: str | None, new_secret: str | None,
          as_json: bool) -> None:
    """Host the global store that nodes of a run coordinate through (heartbeats, joins, the world)."""
    from zb.cli.terminal import print_json, stderr, warn
    from zb.elastic.storehost import serve
    from zb.secret import read_secret, write_new_secret

    if secret_file and new_secret:
        raise click.UsageError("--secret-file and --new-secret both name the run secret: give one")
    secret = write_new_secret(new_secret) if new_secret else read_secret(secret_file) if secret_file else None
    secret_path = new_secret or secret_file

    # Bound before the store, so a taken port fails before anything listens.
    http_sock = None
    if http_port is not None:
        from zb.status.server import listen

        http_sock = listen(host, http_port)
    boards = []

    def ready(info: dict) -> None:
        if secret is None and not info["loopback"]:
            warn(f"anyone who reaches {host}:{info['port']} can join the run and write its store: start it with "
                 "--new-secret FILE (or --secret-file) and give the file to every node")
        elif info["public"]:
            warn(f"{host} may be reachable from the internet: the run secret authenticates, it does not encrypt; "
                 "put the run on a private network (WireGuard/Tailscale) and bind to its address")
        if secret_path:
            info["env"]["ZB_ELASTIC_SECRET_FILE"] = secret_path
        if http_sock is not None:
            boards.append(_dashboard(http_sock, info, secret))
            info["dashboard"] = boards[0].url
        if as_json:
            print_json(info)
        stderr.print(f"zb store listening on {info['host']}:{info['port']} (Ctrl-C to stop). Point workers at it:")
        stderr.print("  " + "  ".join(f"{k}={v}" for k, v in info["env"].items()))
        stderr.print(f"  or: zb train --elastic.addr {info['addr']} --elastic.port {info['port']}"
                     + (f" --secret-file {secret_path}" if secret_path else ""))
        stderr.print("  a second run on this store (another model, say): the same plus --elastic.namespace NAME, a name "
                     "per run", markup=False)
        stderr.print(f"  every run on it: zb status --store {info['addr']}:{info['port']}", markup=False)
        if boards:
            stderr.print(f"  dashboard (read-only): {boards[0].url}", markup=False)

    try:
        serve(host, port, ready, secret)
    finally:
        for board in boards:
            board.close()


def _dashboard(sock, info: dict, secret: bytes | None):
    """The dashboard, reading this process's own store through clients of it (with the run's secret, if any:
    the records it reads are sealed): the list of its runs, or its one run (zb.status.listing)."""
    from zb.elastic import keys
    from zb.status.listing import StoreView
    from zb.status.reader import RunReader
    from zb.status.server import Dashboard
    from zb.store_clients import listing_client, reading_client

    dial = "127.0.0.1" if info["host"] in ("0.0.0.0", "") else "::1" if info["host"] == "::" else info["host"]
    where = f"{info['addr']}:{info['port']}"

    def open_run(namespace: str) -> RunReader:
        return RunReader(reading_client(dial, info["port"], 10.0, counters=keys.is_counter, secret=secret), where,
                         secret=secret, namespace=namespace)

    return Dashboard(sock, lambda: StoreView([listing_client(dial, info["port"], 10.0)], open_run, where), 2.0,
                     where).start()
