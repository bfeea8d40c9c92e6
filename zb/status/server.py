"""The live dashboard: one thread samples the run from the store, an HTTP server hands out the result.

Read-only: GET / is the page (zb.status.page), GET /api/status the newest document; nothing else is
served and nothing is written to the store. On a store with several runs (zb.status.listing) the document
is the list of runs, and `?namespace=NAME` on either path is that run's page and document (the page asks
for its document with its own query). Browsers never reach the store: however many tabs poll,
the store sees one sampler. The server binds exactly the address it is given, as `zb store` does.
With several stores (elastic.addr's failover list) the sampler reads the one zb.status.reader.open_reader
picks, and picks again at the refresh after that store stops answering or holds no run.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

from zb.dial import unresolvable
from zb.elastic.tcpstore import store_errors
from zb.errors import EnvironmentFailure
from zb.status.history import RunHistory
from zb.status.listing import StoreView
from zb.status.page import render
from zb.status.reader import NoRun, RunReader

log = logging.getLogger("zb.status")

# No script, style or connection from anywhere but the page itself: the page must work offline.
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def listen(bind: str, port: int, option: str = "--http-port") -> socket.socket:
    """A socket listening on exactly bind:port, or one clear line (port in use: exit 1)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise unresolvable("--bind", bind, e) from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(64)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise EnvironmentFailure(f"{option} {port}: port already in use on {bind}; choose another") from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise EnvironmentFailure(f"{option} {port}: no permission to bind it (ports below 1024 need root)") \
                from None
        raise EnvironmentFailure(f"cannot serve the dashboard on {bind}:{port}: {e.strerror or e}") from None
    return sock


class Dashboard:
    """Samples every `interval` s (the first sample before start returns) and serves until close().
    `open_reader`: what reads the store, one run (a RunReader) or what the store holds (a StoreView)."""

    def __init__(self, sock: socket.socket, open_reader: Callable[[], RunReader | StoreView], interval: float,
                 where: str) -> None:
        self.sock, self.interval, self.where = sock, interval, where
        self._open_reader = open_reader
        self._reader: RunReader | StoreView | None = None
        self.history = RunHistory()
        self.histories: dict[str, RunHistory] = {}        # each run's of a list, by namespace
        self.runs: dict[str, dict[str, Any]] = {}          # each run's newest document of a list, by namespace
        self.latest: dict[str, Any] = {"source": where, "nodes": [], "run": {}, "history": {}, "membership": [],
                                       "error": "no sample yet"}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._server = _server(sock, self)
        self._threads: list[threading.Thread] = []
        self.samples = 0

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        shown = "127.0.0.1" if host == "0.0.0.0" else f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/"

    def start(self) -> Dashboard:
        self.sample()
        self._threads = [threading.Thread(target=self._sample_loop, name="zb-dashboard-sampler", daemon=True),
                         threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                          name="zb-dashboard-http", daemon=True)]
        for thread in self._threads:
            thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        for thread in self._threads:
            thread.join(5)

    def document(self, namespace: str | None = None) -> dict[str, Any]:
        """The newest document: the list's or the one run's; with `namespace`, that run's (of a list)."""
        with self._lock:
            if namespace is None or (self.latest.get("namespace") == namespace and "runs" not in self.latest):
                return self.latest
            if namespace in self.runs:
                return self.runs[namespace]
            shown = f"'{namespace[:200]}'" if namespace else "in the store's root namespace"
            return {"source": self.where, "namespace": namespace, "nodes": [], "run": {}, "history": {},
                    "membership": [], "error": f"no run {shown} on {self.where} (yet)", "time": self.latest.get("time")}

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        """One refresh; a store that went away is shown on the page and tried again next time."""
        error = None
        try:
            if self._reader is None:
                self._reader = self._open_reader()
            doc = self._merged(self._reader)
        except NoRun as e:
            if self._reader is not None and self._reader.several:
                self._reader = None  # of several stores, the run may be on another by the next refresh: pick again
            doc, error = None, str(e)
        except store_errors() + (EnvironmentFailure,) as e:
            self._reader = None      # a restarted store needs a new client (of several: the store is picked again)
            doc, error = None, f"store {self.where} unreachable ({str(e).splitlines()[0][:160]}); retrying"
        if doc is None:
            with self._lock:
                doc = dict(self.latest, error=error)
        self.samples += 1
        with self._lock:
            self.latest = doc

    def _merged(self, reader: RunReader | StoreView) -> dict[str, Any]:
        """One read, each run's curves merged with what this dashboard kept of them."""
        doc = reader.read(with_history=True)
        if "runs" not in doc:
            return self.history.merge(doc)
        assert isinstance(reader, StoreView)   # only the view of a store reads lists
        runs = {name: self.histories.setdefault(name, RunHistory()).merge(run) for name, run in reader.run_docs.items()}
        with self._lock:
            self.runs = runs
        return doc


def _server(sock: socket.socket, dashboard: Dashboard) -> ThreadingHTTPServer:
    class Handler(_Handler):
        board = dashboard

    server = ThreadingHTTPServer(sock.getsockname()[:2], Handler, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    server.daemon_threads = True
    return server


class _Handler(BaseHTTPRequestHandler):
    board: Dashboard
    server_version = "zb-dashboard"

    def do_GET(self) -> None:
        self._respond(send_body=True)

    def do_HEAD(self) -> None:
        self._respond(send_body=False)

    def _respond(self, send_body: bool) -> None:
        path, _, query = self.path.partition("?")
        if path in ("/", "/index.html"):
            body, kind = render().encode(), "text/html; charset=utf-8"
        elif path == "/api/status":
            namespace = parse_qs(query, keep_blank_values=True).get("namespace", [None])[0]
            body = json.dumps(self.board.document(namespace), separators=(",", ":")).encode()
            kind = "application/json"
        else:
            body, kind = b"not found: the dashboard serves / and /api/status\n", "text/plain; charset=utf-8"
            self.send_response(404)
            return self._finish(body, kind, send_body)
        self.send_response(200)
        self._finish(body, kind, send_body)

    def _finish(self, body: bytes, kind: str, send_body: bool) -> None:
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", CSP)
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        log.debug("dashboard: " + format, *args)
