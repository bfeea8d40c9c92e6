"""`zb ckpt-serve`: serve this node's committed snapshots to joiners over HTTP (read-only, token-gated)."""

from __future__ import annotations

import click

from zb.cli.types import TEXT, FiniteFloatRange, NodeId

EPILOG = """Endpoints: GET /manifest, GET /manifest?step=N, GET|HEAD /files/<snapshot>/<file> (Range supported).
Every request needs 'Authorization: Bearer <token>'. Token: derived from the run secret (--secret-file, as
the run's nodes derive theirs), else --token-file F or env ZB_CKPT_TOKEN (never the store). Make one:
python -c 'import secrets; print(secrets.token_hex(32))'.
Runs until SIGINT or SIGTERM. Exit 2: bad --dir, token or host name; exit 1: port in use, store unreachable."""


@click.command("ckpt-serve", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
               epilog=EPILOG)
@click.option("--dir", "root", required=True, type=click.Path(file_okay=False, path_type=str),
              help="Snapshot root: the newest committed snapshot under it is served. A training node with "
                   "ckpt.live_recovery keeps its own in <ckpt.ram_dir>/live/<node id> (default /dev/shm/zb/live/<node "
                   "id>), one directory r<local rank> per local rank, and serves them itself; given a node's directory, "
                   "its rank directory is served.")
@click.option("--host", type=TEXT, default="127.0.0.1", show_default=True,
              help="Address to listen on: loopback by default, as `zb store`; 0.0.0.0 or an address of this machine "
                   "serves joiners on other machines.")
@click.option("--port", type=click.IntRange(0, 65535), default=0, envvar="ZERO_BAND_LIVE_RECO_PORT",
              help="Port to listen on; 0 picks a free one. [env: ZERO_BAND_LIVE_RECO_PORT]")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="File holding the shared secret (else env ZB_CKPT_TOKEN).")
@click.option("--secret-file", type=TEXT, default=None, envvar="ZB_ELASTIC_SECRET_FILE", show_envvar=True,
              help="The run secret (elastic.secret_file): the token derives from it, and --publish seals the "
                   "address record with it.")
@click.option("--publish", "store_addr", type=TEXT, metavar="HOST:PORT", default=None,
              help="Global store (`zb store`) to write this sidecar's address into, under ckpt_serve/<node id>/r<local "
                   "rank> (the rank of the r<N> directory served, else 0), where joiners look for it.")
@click.option("--node-id", "uid", envvar="GLOBAL_UNIQUE_ID", default=None, type=NodeId(),
              help="Node id for --publish. [env: GLOBAL_UNIQUE_ID]")
@click.option("--advertise", type=TEXT, envvar="ZERO_BAND_LIVE_RECO_ADDR", default=None,
              help="Address peers should use (default: --host, or the interface toward the store). "
                   "[env: ZERO_BAND_LIVE_RECO_ADDR]")
@click.option("--client-timeout", type=FiniteFloatRange(min=0.1), default=30.0, show_default=True,
              help="Seconds a client may stall before its connection is dropped.")
@click.option("--max-connections", type=click.IntRange(min=1, max=4096), default=64, show_default=True,
              help="Connections served at once (a thread each), counting only those whose request showed the token; "
                   "past it one gets HTTP 503 and Retry-After. Connections yet to show it wait apart: at most 256, "
                   "each at most 5 s (or --client-timeout) for its request head.")
@click.option("--connect-timeout", type=FiniteFloatRange(min=0), default=10.0, show_default=True,
              help="Seconds to keep trying to reach the store of --publish.")
@click.option("--json", "as_json", is_flag=True, help="Print {address, dir} as one JSON line on stdout once listening.")
def ckpt_serve(root: str, host: str, port: int, token_file: str | None, secret_file: str | None,
               store_addr: str | None, uid: str | None, advertise: str | None, client_timeout: float,
               max_connections: int, connect_timeout: float, as_json: bool) -> None:
    """Serve committed snapshots to joining nodes (live recovery) until SIGINT/SIGTERM."""
    from zb.ckpt.sidecar.process import open_sidecar, run_until_signal
    from zb.cli.terminal import print_json, stderr
    from zb.secret import read_secret

    secret = read_secret(secret_file) if secret_file else None
    sidecar = open_sidecar(root, host, port, token_file, store_addr, uid, advertise, client_timeout,
                           connect_timeout, max_connections, secret)
    if as_json:
        print_json({"address": sidecar.address, "dir": str(sidecar.server.root), "published": sidecar.key})
    stderr.print(f"zb ckpt-serve: serving {sidecar.server.root} on {sidecar.address}"
                 + (f" (published as {sidecar.key})" if sidecar.key else ""), markup=False)
    run_until_signal(sidecar)
