"""What `zb status` shows of a store: one run, or the list of every run on it.

With a namespace (`--namespace`, ZB_ELASTIC_NAMESPACE) the view is that run, as zb.status.reader reads it.
Without one, the store's list of runs (zb.elastic.runs: each run's nodes announce it there) says what
there is: no run or one, and the view is that run (the store's root when the list names none: a run of an
older zb is listed nowhere), as `zb status` always showed it; two or more, and it is the list, a row per
run read by a RunReader of its own (nodes alive, step, outer step, loss, tokens/s, finished or not, and the
run's end as its nodes sealed it, keys.FINISHED). The list decides nothing but what is shown, and a run the
caller cannot open (sealed with a secret it does not hold) is a row with its name alone, marked sealed.

Read-only as every reader: the list is read through zb.store_clients.listing_client, which never writes,
and each run through its own reader. One refresh of the list costs two store operations per store (a
check and a get of the list) and one RunReader refresh per run (scripts/bench_status.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from zb.addresses import StoreAddress
from zb.elastic import keys
from zb.elastic.runs import ListedRun, parse
from zb.elastic.tcpstore import store_errors
from zb.errors import EnvironmentFailure, InvalidInput, ZbError
from zb.status.reader import NoRun, RunReader, open_reader, read_present, sample_window

ALIVE = ("training", "joining", "recovering", "silent", "leaving")   # the states of a node still in the run
_EMPTY = {"nodes_alive": 0, "nodes": [], "world_size": None, "mesh_version": None, "step": None, "outer_step": None,
          "total_steps": None, "loss": None, "tokens_per_s": None, "end": None}


class StoreView:
    """One run (`namespace` given), or what the store's list of runs says there is. `registry`: plain clients of
    the store's root (zb.store_clients.listing_client), one per store of a failover list that answered;
    `open_run(namespace)`: a RunReader of that run (InvalidInput when its secret is not the caller's)."""

    def __init__(self, registry: list[Any], open_run: Callable[[str], RunReader], where: str, *,
                 namespace: str | None = None, several: bool = False) -> None:
        self.registry, self.open_run, self.where, self.namespace = registry, open_run, where, namespace
        self.several = several                    # a failover list: a reader that finds no run picks again
        self.readers: dict[str, RunReader] = {}   # kept across refreshes: each watches its run's heartbeats
        self.sealed: set[str] = set()              # runs this caller cannot open (the secret does not change)
        self.run_docs: dict[str, dict[str, Any]] = {}   # the newest document of each run shown (the run pages)

    def listed(self) -> tuple[list[ListedRun], int]:
        """The runs on the store's list (of every store that answers), and how many more it names than it lists."""
        raws, failed = [], None
        for client in self.registry:
            try:
                raws.append(read_present(client, [keys.RUNS])[0])
            except store_errors() as e:
                failed = e
        if failed is not None and not raws:
            raise failed
        return parse(b"\n".join(raws))

    def read(self, with_history: bool = False) -> dict[str, Any]:
        """One run's document (zb.status.reader), or the list's: source, time, runs (a row each), omitted, warning."""
        if self.namespace is not None:
            return self._run(self.namespace, with_history)
        listed, omitted = self.listed()
        if len(listed) <= 1:
            return self._run(listed[0].namespace if listed else "", with_history)
        rows, docs = [], {}
        for run in listed:
            row, doc = self._row(run, with_history)
            rows.append(row)
            if doc is not None:
                docs[run.namespace] = doc
        self.run_docs = docs
        return {"source": self.where, "time": round(time.time(), 3), "runs": rows, "omitted": omitted,
                "warning": _warning(rows, docs)}

    def _run(self, namespace: str, with_history: bool) -> dict[str, Any]:
        doc = self._reader(namespace).read(with_history=with_history)
        self.run_docs = {namespace: doc}
        return doc

    def _reader(self, namespace: str) -> RunReader:
        if namespace not in self.readers:
            self.readers[namespace] = self.open_run(namespace)
        return self.readers[namespace]

    def _row(self, run: ListedRun, with_history: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
        row: dict[str, Any] = {"namespace": run.namespace, "started": run.started, "finished": run.finished is not None,
                               "finished_time": run.finished, "secret": run.secret, "sealed": False, "error": None}
        if run.namespace in self.sealed:
            return dict(row, sealed=True, state="sealed", **_EMPTY), None
        try:
            doc = self._reader(run.namespace).read(with_history=with_history)
        except InvalidInput:     # sealed with a secret this caller does not hold: its name is all it shows
            self.sealed.add(run.namespace)
            return dict(row, sealed=True, state="sealed", **_EMPTY), None
        except NoRun as e:       # listed before its first node published anything
            return dict(row, error=str(e), state="finished" if row["finished"] else "starting", **_EMPTY), None
        figures = _figures(doc)
        # Finished: on the store's list, or in the run's own sealed record (a finish line the store did not take).
        row["finished"] = row["finished"] or figures["end"] is not None
        state = "finished" if row["finished"] else "running" if figures["nodes_alive"] else "stopped"
        return dict(row, state=state, **figures), doc

    def sample(self, doc: dict[str, Any], poll: float = 0.1) -> bool:
        """Watch the heartbeats of every node `doc` shows alive, of every run at once, for up to two heartbeat
        intervals (zb.status.reader.sample_window); whether there was any to watch (then read again)."""
        docs = {n: d for n, d in self.run_docs.items() if n in self.readers}
        watching = {n: [u["uid"] for u in d["nodes"] if u["state"] not in ("left", "dead", "refused")]
                    for n, d in docs.items()}
        watching = {n: uids for n, uids in watching.items() if uids}
        if not watching:
            return False
        deadline = time.monotonic() + max(sample_window(docs[n]) for n in watching)
        while watching and time.monotonic() < deadline:
            watching = {n: waiting for n, uids in watching.items() if (waiting := self.readers[n].watch_beats(uids))}
            if watching:
                time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
        return True


def _figures(doc: dict[str, Any]) -> dict[str, Any]:
    """A run's row from its document: its nodes (id and state), how many are alive, and the run's figures; the
    loss is the mean of the newest losses of the nodes alive (of every node once none is)."""
    nodes, run = doc["nodes"], doc["run"]
    alive = [n for n in nodes if n["state"] in ALIVE]
    losses = [n["loss"] for n in (alive or nodes) if isinstance(n.get("loss"), (int, float))]
    return {"nodes_alive": len(alive), "nodes": [{"uid": n["uid"], "state": n["state"]} for n in nodes],
            "world_size": run.get("world_size"), "mesh_version": run.get("mesh_version"), "step": run.get("step"),
            "outer_step": run.get("outer_step"), "total_steps": run.get("total_steps"),
            "loss": round(sum(losses) / len(losses), 4) if losses else None, "tokens_per_s": run.get("tokens_per_s"),
            "end": run.get("finished")}


def _warning(rows: list[dict[str, Any]], docs: dict[str, dict[str, Any]]) -> str | None:
    """The line beside the list: runs this caller cannot open, or (from the runs' own documents) a --secret-file
    that has no effect."""
    sealed = [r["namespace"] or "(default)" for r in rows if r["sealed"]]
    if sealed:
        return (f"{len(sealed)} run(s) sealed with a secret this command does not hold ({', '.join(sealed)}): pass "
                "--secret-file FILE (ZB_ELASTIC_SECRET_FILE) with the run's secret to show them")
    return next((d["warning"] for d in docs.values() if d.get("warning")), None)


def open_view(addresses: list[StoreAddress], timeout: float, secret: bytes | None = None,
              namespace: str | None = None) -> StoreView:
    """The view `zb status` shows of the store(s) at `addresses` (elastic.addr's list, in failover order): the run
    in `namespace`, opened at once (as zb.status.reader.open_reader opens it: its errors are this call's), or,
    with none, the store's list of runs, read through a listing client of every store that answers (one
    EnvironmentFailure line when none does within `timeout`)."""
    where = ",".join(str(a) for a in addresses)

    def open_run(name: str) -> RunReader:
        return open_reader(addresses, timeout, secret, name)

    view = StoreView([] if namespace is not None else _registry(addresses, timeout), open_run, where,
                     namespace=namespace, several=len(addresses) > 1)
    if namespace is not None:
        view.readers[namespace] = open_run(namespace)
    return view


def _registry(addresses: list[StoreAddress], timeout: float) -> list[Any]:
    """A listing client of each store that answers: one store waits `timeout` for it (as the run's reader would);
    of several, each is given a short wait, again until one answers or `timeout` passes."""
    from zb.store_clients import listing_client

    if len(addresses) == 1:
        return [listing_client(addresses[0].host, addresses[0].port, timeout)]
    deadline = time.monotonic() + timeout
    while True:
        clients = []
        for address in addresses:
            try:
                clients.append(listing_client(address.host, address.port,
                                              max(0.1, min(2.0, deadline - time.monotonic()))))
            except store_errors() + (ZbError,):    # of a list, one that does not answer (or resolve) is not fatal
                continue
        if clients:
            return clients
        if time.monotonic() >= deadline:
            raise EnvironmentFailure(f"stores {','.join(str(a) for a in addresses)} unreachable after {timeout:g} s "
                                     "(none of them answers); is `zb store` running there? check --store")
