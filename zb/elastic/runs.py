"""The runs on a store, for listing them: `zb status` with no namespace and the dashboard's list of runs.

A run announces itself on its store: the head of each node that joins it appends a start line (its
namespace, when, whether it holds the run secret) to keys.RUNS, and the head of a node whose training
reached its end appends a finish line. One key at the store's root, under no namespace, grown with
`append`: torch's TCPStore lists no keys, so a reader finds every run with one `get`.

It is the one record no run seals: a caller without a run's secret lists the run by name (and sees it is
sealed). So it is untrusted input. A reader keeps only lines of the shape below, with every value of its
type and range, reads at most MAX_BYTES of the newest lines and lists at most MAX_RUNS runs; and nothing a
node does ever reads it: it decides nothing for a run, it only names the runs there are.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zb.elastic import keys
from zb.signed_store import SignedRecords, holds_secret

log = logging.getLogger("zb.elastic")

MAX_LINE = 1024          # a longer line is not one of ours
MAX_BYTES = 256 * 1024   # the newest lines read (about 2,500 starts): an older run beyond them is not listed
MAX_RUNS = 64            # runs listed at most, the most recently active first kept
MAX_NAMESPACE = 200      # characters of a namespace listed
LATEST_TIME = 1e11       # a time (unix seconds) past this is not one (the year 5138)


@dataclass(frozen=True)
class ListedRun:
    """One run as the store's lines say it: its namespace ("" for the store's root), when its first node
    started, whether a node said it holds a secret, and when it finished (None unless the newest line of
    the run is a finish: a node that joins after the end starts it again)."""

    namespace: str
    started: float | None
    secret: bool
    finished: float | None
    last: float


def name(namespace: str) -> str:
    """A namespace as the store's keys use it: "alpha/" and "alpha" are one prefix (zb.signed_store.prefixed)."""
    return namespace.rstrip("/")


def start_line(namespace: str, secret: bool, now: float | None = None) -> str:
    return _line({"namespace": name(namespace), "event": "start", "time": _now(now), "secret": secret})


def finish_line(namespace: str, now: float | None = None) -> str:
    return _line({"namespace": name(namespace), "event": "finish", "time": _now(now)})


def _now(now: float | None) -> float:
    return round(time.time() if now is None else now, 3)


def _line(doc: dict[str, Any]) -> str:
    return json.dumps(doc, separators=(",", ":")) + "\n"


def root_of(store: Any) -> Any:
    """The plain client at the store's root under `store` (a node's client: sealed, under its namespace, or
    both): the registry is written there, unsealed, whatever namespace and secret the run has."""
    import torch.distributed as dist

    while True:
        if isinstance(store, SignedRecords):
            store = store.inner
        elif isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        else:
            return store


def announce(store: Any, namespace: str) -> None:
    """This node joined the run in `namespace` (best effort: a store that fails here fails the node's next
    write anyway, and says so there). `store`: a client of the node's, which tells whether it holds the
    secret."""
    from zb.elastic.tcpstore import store_errors

    try:
        root_of(store).append(keys.RUNS, start_line(namespace, holds_secret(store)))
    except store_errors() as e:
        log.debug("could not list this run on its store: %s", str(e).splitlines()[0])


def finish(connect: Callable[[], Any], namespace: str, wait_s: float) -> bool:
    """The run in `namespace` reached its end: said on the store's list, from a thread waited for at most
    `wait_s` s (a silent store never holds the end of a run; the process leaves that thread behind). True
    when it was written."""
    from zb.elastic.tcpstore import store_errors
    from zb.errors import ZbError

    written = threading.Event()

    def write() -> None:
        try:
            root_of(connect()).append(keys.RUNS, finish_line(namespace))
            written.set()
        except store_errors() + (ZbError,) as e:
            log.debug("could not mark this run finished on its store: %s", str(e).splitlines()[0])

    thread = threading.Thread(target=write, name="zb-run-finished", daemon=True)
    thread.start()
    thread.join(wait_s)
    if not written.is_set():
        log.info("the store did not answer within %g s: `zb status` will not list this run as finished", wait_s)
    return written.is_set()


def parse(raw: bytes) -> tuple[list[ListedRun], int]:
    """The runs the registry's lines name, by namespace, and how many more there were than MAX_RUNS."""
    if len(raw) > MAX_BYTES:
        raw = raw[-MAX_BYTES:]
        raw = raw[raw.find(b"\n") + 1:]    # the first line was cut: not one of ours
    entries = [e for e in map(_entry, raw.split(b"\n")) if e is not None]
    entries.sort(key=lambda e: e["time"])   # in time order: the lists of several stores are read as one
    folded: dict[str, dict[str, Any]] = {}
    for entry in entries:
        run = folded.setdefault(entry["namespace"], {"started": None, "secret": False, "finished": None, "last": 0.0})
        when = entry["time"]
        run["last"] = max(run["last"], when)
        if entry["event"] == "start":
            run["started"] = when if run["started"] is None else min(run["started"], when)
            run["secret"] = run["secret"] or entry["secret"]
            run["finished"] = None
        else:
            run["finished"] = when
    kept = sorted(folded.items(), key=lambda item: item[1]["last"], reverse=True)[:MAX_RUNS]
    runs = [ListedRun(namespace, **fields) for namespace, fields in sorted(kept, key=lambda item: item[0])]
    return runs, len(folded) - len(runs)


def _entry(line: bytes) -> dict[str, Any] | None:
    """One line's fields when each has its type and range; None for anything else."""
    if not line.strip() or len(line) > MAX_LINE:
        return None
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    namespace, event, when, secret = doc.get("namespace"), doc.get("event"), doc.get("time"), doc.get("secret", False)
    if not isinstance(namespace, str) or len(namespace) > MAX_NAMESPACE or not namespace.isprintable():
        return None
    if event not in ("start", "finish") or not isinstance(secret, bool):
        return None
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when) or \
            not 0 < when < LATEST_TIME:
        return None
    return {"namespace": name(namespace), "event": event, "time": float(when), "secret": secret}
