"""`zb status`: the run as a table, live (--watch), as JSON, as a dashboard in the browser (--serve),
or, for a finished run, as a static HTML report from its metrics files (--from)."""

from __future__ import annotations

import os

import click

from zb.cli.types import TEXT, FiniteFloatRange
from zb.torch_log import quiet_torch_log

EPILOG = """Examples: zb status --store 10.0.0.1:29600 (one table); zb status --watch (refreshing; the store
from GLOBAL_ADDR/GLOBAL_PORT); zb status --serve --http-port 8600 (a dashboard at http://127.0.0.1:8600/);
zb status --from logs/sim/run1 --out run1.html (a report). A run with several stores (elastic.addr
10.0.0.1:29600,10.0.0.2:29600, in failover order): --store takes the same list and reads the store the run
is on (the latest holding the run, else the first that answers), and a line under the table names it, the
failovers so far and the stores that do not answer. States: training, joining (admitted or
waiting to be, receiving the run's state), recovering (fetching a live-recovery snapshot), leaving (said
goodbye), left, refused (the run turned it away: its settings differ from the run's), silent (no
heartbeat for two intervals), dead (none for the heartbeat timeout, or dropped by the run, or out of
the run and not beating). Heartbeat ages are measured on this machine's clock: a one-shot status watches
the counters for up to two heartbeat intervals first. Exit codes: 0 shown; 1 the store is unreachable,
holds no run or is not a zb store, or the port is in use; 2 invalid options or unreadable --from files.

Several runs on one store (each node started with its own --elastic.namespace): without --namespace, zb status
lists them, a line each (namespace, nodes alive, step, outer step, loss, tok/s, finished or not), and the
dashboard opens on that list, each run a link to its own page; --namespace NAME shows one run as above. A
run sealed with a secret this command does not hold is listed by name only, marked sealed."""

DEFAULT_HTTP_PORT = 8600


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110}, epilog=EPILOG)
@click.option("--store", type=TEXT, default=None, metavar="HOST:PORT[,HOST:PORT...]",
              help="The run's store (`zb store`), or its stores in failover order, as elastic.addr lists them "
                   "[default: GLOBAL_ADDR:GLOBAL_PORT from the environment].")
@click.option("--watch", is_flag=True, help="Refresh the table every --interval seconds until Ctrl-C.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document on stdout (with --watch, one line per refresh).")
@click.option("--serve", is_flag=True, help="Serve a live dashboard (one self-contained page) over HTTP until Ctrl-C.")
@click.option("--http-port", type=click.IntRange(0, 65535), default=None,
              help=f"Port of the dashboard (with --serve; 0 picks a free one) [default: {DEFAULT_HTTP_PORT}].")
@click.option("--bind", type=TEXT, default="127.0.0.1", show_default=True,
              help="Address the dashboard listens on (with --serve; 0.0.0.0 for every interface).")
@click.option("--interval", type=FiniteFloatRange(min=0.2, max=3600), default=2.0, show_default=True,
              help="Seconds between refreshes (--watch, --serve).")
@click.option("--timeout", type=FiniteFloatRange(min=0, min_open=True, max=3600), default=10.0, show_default=True,
              help="Seconds to wait for the store (with several, for any of them) to answer.")
@click.option("--secret-file", type=TEXT, default=None, envvar="ZB_ELASTIC_SECRET_FILE", show_envvar=True,
              help="The run secret (elastic.secret_file), for a run whose store was started with one.")
@click.option("--namespace", type=TEXT, default=None, envvar="ZB_ELASTIC_NAMESPACE", show_envvar=True,
              help="Show the run in this namespace (its nodes' elastic.namespace; '' for none) [default: every run "
                   "on the store: the list, or the run itself when there is one].")
@click.option("--from", "from_paths", type=TEXT, multiple=True, metavar="PATH",
              help="A finished run's metrics: metrics.jsonl files or directories holding them (repeatable). "
                   "Writes an HTML report instead of reading a store.")
@click.option("--out", type=click.Path(dir_okay=False, writable=True), default=None,
              help="With --from: the report's file [default: report.html].")
@click.option("--force", is_flag=True, help="With --from: overwrite --out if it exists.")
def status(store: str | None, watch: bool, as_json: bool, serve: bool, http_port: int | None, bind: str,
           interval: float, timeout: float, secret_file: str | None, namespace: str | None, from_paths: tuple[str, ...],
           out: str | None, force: bool) -> None:
    """Show a run (of several on a store: the list): every node's id, host, rank, device, state, heartbeat
    age, step, loss, tokens/s and last all-reduce, and the run's mesh version, leader, tokens/s and ETA."""
    _check_combination(store, watch, serve, http_port, from_paths, out, force)
    _check_given(watch, serve, from_paths, as_json, out, force)
    # torch's store client logs C++ stack frames while it retries an address that is not a store (also from
    # a thread still retrying after we gave up): this command only reads, and says what failed in one line.
    quiet_torch_log("FATAL")
    if from_paths:
        return _report(from_paths, out or "report.html", force, as_json)
    addresses = _store_addresses(store)
    where = ",".join(str(a) for a in addresses)
    from zb.secret import read_secret

    secret = read_secret(secret_file) if secret_file else None
    if serve:
        return _serve(addresses, where, bind, DEFAULT_HTTP_PORT if http_port is None else http_port, interval,
                      timeout, as_json, secret, namespace)
    from zb.status.listing import open_view

    view = open_view(addresses, timeout, secret, namespace)
    if watch:
        return _watch(view, addresses, where, interval, timeout, as_json, secret, namespace)
    doc = view.read()
    if view.sample(doc):     # heartbeat ages need the counters seen changing
        doc = view.read()
    _show(doc, as_json)
    _warn(doc)


def _check_combination(store, watch, serve, http_port, from_paths, out, force) -> None:
    from zb.errors import InvalidInput

    if from_paths:
        given = [name for name, on in (("--store", store), ("--watch", watch), ("--serve", serve)) if on]
        if given:
            raise InvalidInput(f"--from reads metrics files; {', '.join(given)} read a live store: give one or the "
                               "other")
    elif out is not None or force:
        raise InvalidInput("--out and --force go with --from (a report of a finished run)")
    if http_port is not None and not serve:
        raise InvalidInput("--http-port goes with --serve (the dashboard); without --serve there is no server")
    if watch and serve:
        raise InvalidInput("--watch and --serve: give one (the dashboard refreshes itself)")


def _check_given(watch: bool, serve: bool, from_paths, as_json: bool, out, force: bool) -> None:
    """Options given explicitly where they can have no effect: refused, not silently ignored."""
    from click.core import ParameterSource

    from zb.errors import InvalidInput

    ctx = click.get_current_context()
    given = {name for name in ("bind", "interval", "timeout")
             if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)}
    for name in ("secret_file", "namespace"):   # not ZB_ELASTIC_SECRET_FILE or ZB_ELASTIC_NAMESPACE: a node's settings
        if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE:
            given.add(name)
    useless = []
    if "bind" in given and not serve:
        useless.append("--bind goes with --serve")
    if "interval" in given and not (watch or serve):
        useless.append("--interval goes with --watch or --serve")
    for name in ("timeout", "secret_file", "namespace"):
        if name in given and from_paths:
            useless.append(f"--{name.replace('_', '-')} has no effect with --from (no store is read)")
    if from_paths and as_json and (out is not None or force):
        useless.append("--out and --force have no effect with --json (the document goes to stdout)")
    if useless:
        raise InvalidInput("; ".join(useless))


def _store_addresses(store: str | None) -> list:
    """--store's stores (each HOST:PORT), else GLOBAL_ADDR's (a port-less entry on GLOBAL_PORT), in failover order."""
    from zb.addresses import parse_stores
    from zb.errors import InvalidInput

    if store is None:
        addr, port = os.environ.get("GLOBAL_ADDR"), os.environ.get("GLOBAL_PORT", "29600")
        if not addr:
            raise InvalidInput("no store given: pass --store HOST:PORT (the address of `zb store`) or set GLOBAL_ADDR")
        if not port.strip().isdigit() or not 1 <= int(port) <= 65535:
            raise InvalidInput(f"GLOBAL_PORT {port!r}: a port is a number from 1 to 65535")
        return parse_stores(addr, int(port), what="GLOBAL_ADDR")
    addresses = parse_stores(store, 0, what="--store")      # port 0: the entry named none (no port can be 0)
    for entry, address in zip(store.split(","), addresses):
        if address.port == 0:
            bracket = " (an IPv6 host in brackets: [HOST]:PORT)" if ":" in address.host else ""
            raise InvalidInput(f"--store {entry.strip()!r}: expected HOST:PORT with a port in 1..65535{bracket}")
    return addresses


def _warn(doc: dict) -> None:
    """The reader's warning (a --secret-file the run does not hold), on stderr beside the table or JSON."""
    if doc.get("warning"):
        from zb.cli.terminal import warn

        warn(doc["warning"])


def _show(doc: dict, as_json: bool) -> None:
    from zb.cli.terminal import print_json

    if as_json:
        print_json(doc)
    else:
        _print_table(doc)


def _view(doc: dict):
    """What a document shows: the list of the store's runs, or one run."""
    return runs_view(doc) if "runs" in doc else status_view(doc)


def _print_table(doc: dict) -> None:
    """On a terminal at its width; into a pipe or file wide enough that no column is cut."""
    from rich.console import Console

    from zb.cli.terminal import stdout

    console = stdout if stdout.is_terminal else Console(width=200, highlight=False, soft_wrap=True)
    console.print(_view(doc))


def stores_line(doc: dict) -> str | None:
    """The line under the table for a run with several stores or a failover: "store B (current; 1 failover so
    far; A does not answer)". None for one store that never failed over (the table alone, as ever)."""
    stores = doc.get("stores") or {}
    listed, failovers = stores.get("list") or [], stores.get("failovers") or 0
    if len(listed) < 2 and not failovers:
        return None
    parts = ["current", f"{failovers} failover{'' if failovers == 1 else 's'} so far" if failovers
             else "no failover so far"]
    silent = [s["address"] for s in listed if not s.get("answers")]
    if silent:
        parts.append(f"{', '.join(silent)} {'does' if len(silent) == 1 else 'do'} not answer")
    return f"store {stores.get('current') or doc.get('source')} ({'; '.join(parts)})"


def clipped_line(doc: dict) -> str | None:
    """The line under the table when diloco.clip scaled down a node's pseudo-gradient at the newest outer step."""
    run = doc.get("run") or {}
    clipped = run.get("clipped") or []
    if not clipped:
        return None
    return f"diloco.clip scaled down {', '.join(clipped)} at outer step {run.get('outer_step')}"


def finished_line(doc: dict) -> str | None:
    """The line under the table once the run's nodes sealed its end (keys.FINISHED): "finished at outer step 12
    (step 120) at 2026-11-28 07:13:19 UTC"."""
    end = (doc.get("run") or {}).get("finished")
    return end["line"] if end else None


def _with_lines(table, lines: list[str | None]):
    from rich.console import Group
    from rich.text import Text

    shown = [line for line in lines if line]
    return Group(table, *(Text(line) for line in shown)) if shown else table


def status_view(doc: dict):
    """The table, and under it the run's end, the stores and diloco.clip lines when there are any."""
    return _with_lines(status_table(doc), [finished_line(doc), stores_line(doc), clipped_line(doc)])


def runs_view(doc: dict):
    """The list of runs, and under it where and when each run that ended did ("NAME finished at ...")."""
    return _with_lines(runs_table(doc), [f"{namespace_name(r['namespace'])} {r['end']['line']}"
                                         for r in doc.get("runs") or [] if r.get("end")])


def _watch(reader, addresses: list, where: str, interval: float, timeout: float, as_json: bool,
           secret: bytes | None, namespace: str | None) -> None:
    """Refresh until Ctrl-C (exit 0); a store that goes away (or, of several, holds no run) is shown and
    reconnected to: with several stores the next refresh picks again, by the rule the first pick used."""
    import time

    from rich.live import Live

    from zb.cli.terminal import interactive, print_json, stderr, stdout
    from zb.elastic.tcpstore import store_errors
    from zb.errors import EnvironmentFailure
    from zb.status.listing import open_view

    live = Live(console=stdout, auto_refresh=False) if interactive() and not as_json else None
    warned = None
    try:
        if live:
            live.start()
        while True:
            try:
                if reader is None:
                    reader = open_view(addresses, timeout, secret, namespace)
                doc = reader.read()
                if as_json:
                    print_json(doc)
                elif live:
                    live.update(_view(doc), refresh=True)
                else:
                    _print_table(doc)
                if doc.get("warning") != warned:   # once, not at every refresh
                    warned = doc.get("warning")
                    _warn(doc)
            except store_errors() + (EnvironmentFailure,) as e:
                reader = None
                stores = "stores" if len(addresses) > 1 else "store"
                stderr.print(f"{stores} {where}: {str(e).splitlines()[0][:200]}; retrying in {interval:g} s",
                             markup=False)
            time.sleep(interval)
    except KeyboardInterrupt as e:   # Ctrl-C or SIGTERM (zb.stop_signals.Interrupted) is how a watch ends: exit 0
        stopped_by = getattr(e, "name", "SIGINT")
    finally:
        if live:
            live.stop()
    stderr.print(f"zb status: stopped ({stopped_by})", markup=False)


def _serve(addresses: list, where: str, bind: str, http_port: int, interval: float, timeout: float,
           as_json: bool, secret: bytes | None, namespace: str | None) -> None:
    from zb.cli.terminal import print_json, stderr
    from zb.status.listing import open_view
    from zb.status.server import Dashboard, listen
    from zb.stop_signals import StopSignals

    sock = listen(bind, http_port)     # before the store: a taken port fails at once
    board = Dashboard(sock, lambda: open_view(addresses, timeout, secret, namespace), interval, where).start()
    try:
        with StopSignals() as stop:
            if as_json:
                print_json({"url": board.url, "store": where, "bind": bind, "port": sock.getsockname()[1]})
            stderr.print(f"zb status: dashboard of the run(s) on {where} at {board.url} (read-only; Ctrl-C to stop)",
                         markup=False)
            first = board.document()
            if first.get("error"):
                stderr.print(f"warning: {first['error']}", markup=False)
            _warn(first)
            stopped_by = stop.wait()
    finally:
        board.close()
    stderr.print(f"zb status: dashboard stopped ({stopped_by})", markup=False)


def _report(paths: tuple[str, ...], out: str, force: bool, as_json: bool) -> None:
    from pathlib import Path

    from zb.cli.terminal import print_json, stderr
    from zb.errors import EnvironmentFailure, InvalidInput
    from zb.status.page import render
    from zb.status.report import build_report

    target = Path(out)
    if not as_json:      # refused before the files are read
        if not target.parent.is_dir():
            raise InvalidInput(f"--out {out}: directory {target.parent} does not exist")
        if target.exists() and not force:
            raise InvalidInput(f"--out {out} exists; pass --force to overwrite it, or choose another file")
    doc = build_report(paths)
    if as_json:
        print_json(doc)
        return
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        tmp.write_text(render(doc), encoding="utf-8")
        tmp.replace(target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise EnvironmentFailure(f"cannot write the report to {out}: {e.strerror or e}") from None
    skipped = f"; {doc['skipped_lines']} unreadable line(s) skipped" if doc.get("skipped_lines") else ""
    stderr.print(f"report of {len(doc['nodes'])} node(s) written to {target}{skipped}", markup=False)


def _cell(value, digits: int | None = None) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and digits is not None:
        return f"{value:.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.1f}" if isinstance(value, float) else str(value)


def _duration(seconds) -> str:
    if seconds is None:
        return "—"
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}h {m:02d}m" if h else f"{m}m {s % 60:02d}s" if m else f"{s}s"


def _bytes(count) -> str:
    """A byte count in decimal units: 512 B, 1.2 kB, 3.4 MB, 5.6 GB."""
    if not isinstance(count, (int, float)) or isinstance(count, bool):
        return "—"
    if count < 1000:
        return f"{int(count)} B"
    for unit in ("kB", "MB", "GB"):
        count /= 1000
        if count < 999.95 or unit == "GB":
            break
    return f"{count:,.1f} {unit}"


def _sync(node: dict) -> str:
    """The node's pseudo-gradient compression and the bytes it sent at its last outer step ("int4 1.2 MB")."""
    compression, sent = node.get("compression"), node.get("wire_bytes")
    if compression is None and sent is None:
        return "—"
    return f"{compression or '—'} {_bytes(sent)}"


STATE_STYLE = {"training": "green", "joining": "cyan", "recovering": "cyan", "leaving": "yellow", "silent": "yellow",
               "dead": "red", "refused": "red", "left": "dim", "ended": "dim"}


def _heartbeat(node: dict) -> str:
    if node.get("heartbeat_age_s") is not None:
        return f"{node['heartbeat_age_s']:.1f} s"
    watched = node.get("heartbeat_watched_s")
    return f"> {watched:.1f} s" if watched else "—"


def status_table(doc: dict):
    """The rich table of a status document (nodes, with the run in the title)."""
    from rich.markup import escape
    from rich.table import Table

    run = doc.get("run") or {}
    step = _cell(run.get("step"))
    if run.get("total_steps"):
        step += f"/{_cell(run['total_steps'])}"
    mesh = f"v{run['mesh_version']}" if run.get("mesh_version") is not None else "—"
    named = f" {doc['namespace']}" if doc.get("namespace") else ""     # one run of several on the store
    title = (f"run{named} on {doc.get('source')}: mesh {mesh}, {run.get('world_size') or 0} node(s), leader "
             f"{run.get('leader') or '—'}, step {step}, outer step {_cell(run.get('outer_step'))}, "
             f"{_cell(run.get('tokens_per_s'))} tok/s, ETA {_duration(run.get('eta_s'))}")
    table = Table(title=escape(title), title_justify="left")
    for name in ("node", "host", "rank", "device", "state", "heartbeat", "step", "outer", "loss", "tok/s",
                 "all-reduce s", "Mbit/s", "sync"):
        table.add_column(name, justify="left" if name in ("node", "host", "state") else "right")
    for n in doc.get("nodes", []):
        device = f"{n['device']}×{n.get('local_world_size') or 1}" if n.get("device") else "—"
        style = STATE_STYLE.get(n["state"], "")
        table.add_row(escape(n["uid"]), escape(n.get("host") or "—"), _cell(n.get("global_rank")), device,
                      f"[{style}]{n['state']}[/]" if style else n["state"], _heartbeat(n), _cell(n.get("step")),
                      _cell(n.get("outer_step")), _cell(n.get("loss"), 4), _cell(n.get("tokens_per_s")),
                      _cell(n.get("allreduce_s"), 2), _cell(n.get("wire_mbps")), escape(_sync(n)))
    return table


RUN_STATE_STYLE = {"running": "green", "starting": "cyan", "finished": "dim", "stopped": "yellow", "sealed": "magenta"}
MAX_NODES_SHOWN = 6   # node ids named in a run's row; more are counted


def namespace_name(namespace: str) -> str:
    """A namespace as the list shows it: the store's root (no elastic.namespace) is "(default)"."""
    return namespace or "(default)"


def _node_ids(row: dict) -> str:
    uids = [n["uid"] for n in row.get("nodes") or []]
    shown = ", ".join(uids[:MAX_NODES_SHOWN])
    return f"{shown} and {len(uids) - MAX_NODES_SHOWN} more" if len(uids) > MAX_NODES_SHOWN else shown or "—"


def runs_table(doc: dict):
    """The rich table of the list of a store's runs: a row per run."""
    from rich.markup import escape
    from rich.table import Table

    runs = doc.get("runs") or []
    omitted = f" (and {doc['omitted']} more not listed)" if doc.get("omitted") else ""
    table = Table(title=escape(f"{len(runs)} runs on {doc.get('source')}{omitted}: zb status --namespace NAME shows "
                               "one"), title_justify="left")
    for name in ("run", "nodes alive", "nodes", "step", "outer step", "loss", "tok/s", "state"):
        table.add_column(name, justify="left" if name in ("run", "nodes", "state") else "right")
    for r in runs:
        step = _cell(r.get("step"))
        if r.get("total_steps"):
            step += f"/{_cell(r['total_steps'])}"
        style = RUN_STATE_STYLE.get(r["state"], "")
        table.add_row(escape(namespace_name(r["namespace"])), "—" if r["sealed"] else _cell(r.get("nodes_alive")),
                      escape(_node_ids(r)), step, _cell(r.get("outer_step")), _cell(r.get("loss"), 4),
                      _cell(r.get("tokens_per_s")), f"[{style}]{r['state']}[/]" if style else escape(r["state"]))
    return table
