"""The checkpoint sidecar: read-only HTTP access to the committed snapshots under one directory.

    GET  /manifest            manifest of the newest committed snapshot (503 + Retry-After until one exists)
    GET  /manifest?step=N     manifest of the committed snapshot of step N (404 if not here)
    GET  /files/<name>/<file> a file of committed snapshot <name>; Range (206/416), ETag = its sha256
    HEAD                      the same headers without a body

Every request needs `Authorization: Bearer <token>` (compared in constant time; 401 otherwise),
checked before anything else so an outsider learns nothing. A connection's first head is checked at the door
(zb.ckpt.sidecar.gate) before the connection takes a transfer slot, so connections without the token, idle or
trickling or sending junk, hold none. Paths are never joined blindly: a
request names a snapshot and a file, both must match strict name patterns after percent-decoding
(no `/`, `..`, `%`, NUL), the snapshot must be committed, the file must be listed in its manifest,
and it is opened with O_NOFOLLOW and refused if it has more than one link, so symlinks, hard links and
traversal cannot reach outside the directory.
A file is streamed with sendfile from one open handle, so pruning it mid-transfer does not cut the
download; the next request for a pruned snapshot gets 404 and the client moves on.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import socket
import socketserver
import stat
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from zb.ckpt.format.catalog import check_quick, list_snapshots, read_committed
from zb.ckpt.format.manifest import Manifest
from zb.ckpt.sidecar.gate import Gate, answer_and_close
from zb.ckpt.sidecar.http import HttpError, parse_range, parse_step, route, token_matches
from zb.ckpt.sidecar.live_layout import served_dir
from zb.dial import unresolvable
from zb.errors import EnvironmentFailure, InvalidInput

log = logging.getLogger("zb.ckpt.serve")

RETRY_AFTER_S = 1
# Connections that showed the token served at once (a thread each); past it one gets 503 at once. A joiner
# opens a few per peer (recovery's conns_per_peer), so 64 serves several joiners together.
MAX_CONNECTIONS = 64
# Connections yet to show the token: how many may wait at the door at once (one more closes the longest
# waiting) and for how long (or --client-timeout if shorter). A joiner sends its head with its connect.
MAX_WAITING = 256
HEAD_TIMEOUT_S = 5.0
_BUSY_BODY = b'{"error": "too many connections; retry shortly"}'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: "
         + str(RETRY_AFTER_S).encode() + b"\r\nConnection: close\r\nContent-Length: "
         + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


class _HeadDeadline(io.RawIOBase):
    """The handler's socket for reading, with one deadline for a whole request head, after the bytes the
    door already read (`early`: the first head). The socket's timeout alone bounds each read, so a client
    sending a byte now and then (slowloris) would hold its thread, and a connection slot, forever."""

    def __init__(self, sock: socket.socket, early: bytes) -> None:
        self.sock, self.early, self.deadline = sock, early, float("inf")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.early:
            n = min(len(buffer), len(self.early))
            buffer[:n], self.early = self.early[:n], self.early[n:]
            return n
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the request head took longer than the client timeout")
        self.sock.settimeout(remaining)
        return self.sock.recv_into(buffer)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "zb-ckpt-serve/1"
    sys_version = ""
    server: SnapshotServer

    def __init__(self, request: socket.socket, client_address, server: SnapshotServer, head: bytes = b"") -> None:
        self._early = head   # what the door read: the first request's head, and anything after it
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        # A stalled client cannot hold a thread forever. typeshed declares `timeout` a ClassVar, but
        # StreamRequestHandler.setup() reads it per instance, as set here.
        self.timeout = self.server.client_timeout  # type: ignore[misc]
        super().setup()
        self.rfile.close()  # the plain socket file: reads go through _HeadDeadline instead
        self._head = _HeadDeadline(self.connection, self._early)
        self.rfile = io.BufferedReader(self._head)  # requests have no body: the head is all it reads

    def handle_one_request(self) -> None:
        # The wait for the next request of a kept-alive connection counts too: idle is closed alike.
        self._head.deadline = time.monotonic() + self.server.client_timeout
        super().handle_one_request()

    def do_GET(self) -> None:
        self._dispatch(body=True)

    def do_HEAD(self) -> None:
        self._dispatch(body=False)

    def log_message(self, format: str, *args) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _dispatch(self, body: bool) -> None:
        self.connection.settimeout(self.server.client_timeout)  # per send, not what is left of the head's
        if self.headers.get("Content-Length", "0") != "0" or "Transfer-Encoding" in self.headers:
            self.close_connection = True  # an unread request body would corrupt the next request
        try:
            if not self._authorized():
                raise HttpError(401, "missing or wrong token", {"WWW-Authenticate": 'Bearer realm="zb"'})
            what = route(self.path)
            if what[0] == "manifest":
                self._send_manifest(what[1], body)
            else:
                self._send_file(what[1], what[2], body)
        except HttpError as e:
            self._send_json(e.status, {"error": str(e)}, body, e.headers)
        except (TimeoutError, BrokenPipeError, ConnectionResetError) as e:
            log.debug("client %s went away: %s", self.address_string(), e)
            self.close_connection = True

    def _authorized(self) -> bool:   # the door checked the first head; a kept-alive connection's next ones too
        return token_matches(self.headers.get("Authorization", ""), self.server.token)

    def _send_json(self, status: int, doc: dict, body: bool, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        for key, value in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                           "Cache-Control": "no-store", **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _send_manifest(self, query: str, body: bool) -> None:
        found = self.server.find(query)
        doc = found[1].to_dict()
        doc["name"] = found[0].name  # the name to use in /files URLs
        self._send_json(200, doc, body)

    def _send_file(self, name: str, file_name: str, body: bool) -> None:
        manifest = self.server.committed(name)
        entry = manifest.files.get(file_name)
        if entry is None:
            raise HttpError(404, f"snapshot {name} has no file {file_name}")
        with self.server.open_file(name, file_name, entry.size) as f:
            span = parse_range(self.headers.get("Range"), entry.size)
            start, stop = span or (0, entry.size)
            self.send_response(206 if span else 200)
            headers = {"Content-Type": "application/octet-stream", "Content-Length": str(stop - start),
                       "Accept-Ranges": "bytes", "ETag": f'"{entry.sha256}"'}
            if span:
                headers["Content-Range"] = f"bytes {start}-{stop - 1}/{entry.size}"
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if body and stop > start and self.connection.sendfile(f, start, stop - start) < stop - start:
                self.close_connection = True  # the file shrank under us: the client sees a short body


class SnapshotServer(ThreadingHTTPServer):
    """Serves the committed snapshots under `root` to holders of `token`."""

    daemon_threads = True
    # The kernel's queue of connections not yet accepted (capped by net.core.somaxconn). A burst of connects
    # arrives faster than one thread accepts them; past this queue the kernel drops SYNs, and a joiner caught
    # in a flood would wait a second or more to retry its connect (300 at once took 3 s with 64, 0.06 s with 1024).
    request_queue_size = 1024

    def __init__(self, root: Path, token: str, address: tuple[str, int], client_timeout: float = 30.0,
                 max_connections: int = MAX_CONNECTIONS):
        self.root = Path(root).resolve()
        self.token = token.encode()
        self.client_timeout = client_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self._gate: Gate | None = None   # a failed bind closes the server before the door opens
        super().__init__(address, _Handler)
        self._gate = Gate(self.token, self._admit, min(HEAD_TIMEOUT_S, client_timeout), MAX_WAITING)

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls getfqdn(), which can stall for seconds on DNS: skip it.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def process_request(self, request, client_address) -> None:
        """Runs on the accept thread: to the door, which admits the connection once its head shows the token."""
        assert self._gate is not None   # opened once bound, before anything is accepted
        self._gate.put(request, client_address)

    def _admit(self, request: socket.socket, client_address, head: bytes) -> None:
        """Runs on the door's thread: a thread for the connection if a slot is free, else 503 and close."""
        if not self._slots.acquire(blocking=False):
            log.debug("refusing %s: %s", client_address[0], "all connection slots taken")
            answer_and_close(request, _BUSY)
            return
        try:
            threading.Thread(target=self._serve, args=(request, client_address, head), daemon=True).start()
        except RuntimeError as e:   # no thread to be had: refuse this one, keep the door open for the next
            log.warning("refusing %s: cannot start a thread to serve it (%s)", client_address[0], e)
            self._slots.release()
            answer_and_close(request, _BUSY)

    def _serve(self, request: socket.socket, client_address, head: bytes) -> None:
        """As ThreadingMixIn.process_request_thread, with the head the door read; gives the slot back."""
        handler: Any = self.RequestHandlerClass   # a _Handler (tests put in subclasses), which takes the head
        try:
            handler(request, client_address, self, head)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self._slots.release()   # before the close: a client that saw the end may count on the slot
            self.shutdown_request(request)

    def server_close(self) -> None:
        super().server_close()
        if self._gate is not None:
            self._gate.close()

    def handle_error(self, request, client_address) -> None:
        """A client that resets or stalls its connection is routine (a joiner dropping a split
        range, a peer dying): one debug line, not a traceback. Anything else is a bug."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            log.debug("connection from %s ended: %s", client_address[0], error)
            return
        super().handle_error(request, client_address)

    def find(self, query: str) -> tuple[Path, Manifest]:
        """Newest committed snapshot, or the one of `?step=N`; 503 while nothing is committed."""
        snapshots = list_snapshots(self.root)
        if not snapshots:
            raise HttpError(503, "no committed snapshot yet", {"Retry-After": str(RETRY_AFTER_S)})
        step = parse_step(parse_qs(query).get("step"))
        for path, _ in reversed(snapshots):
            try:
                manifest = check_quick(path)
            except (InvalidInput, OSError) as e:
                log.warning("not serving snapshot %s: %s", path, e)
                continue
            if step is None or manifest.step == step:
                return path, manifest
        raise HttpError(404, f"no committed snapshot of step {step} here" if step is not None else "no valid snapshot")

    def committed(self, name: str) -> Manifest:
        path = self.root / name
        if path.is_symlink() or not path.is_dir():
            raise HttpError(404, f"no snapshot {name}")
        try:
            return read_committed(path)
        except (InvalidInput, OSError):
            raise HttpError(404, f"no committed snapshot {name}") from None

    def open_file(self, name: str, file_name: str, size: int):
        """Open a snapshot file without following symlinks; it must be regular, have one link (a hard link may
        be a file outside the directory, which O_NOFOLLOW cannot tell) and be of manifest size."""
        try:
            fd = os.open(self.root / name / file_name, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            if e.errno == errno.ELOOP:
                log.warning("not serving %s/%s: it is a symlink", name, file_name)
            raise HttpError(404, f"no file {file_name} in snapshot {name}") from None
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
            os.close(fd)
            log.warning("not serving %s/%s: it has %d hard links, and another may be a file outside %s", name,
                        file_name, info.st_nlink, self.root)
            raise HttpError(403, f"{name}/{file_name} has more than one link")
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            os.close(fd)
            raise HttpError(409, f"{name}/{file_name} does not match its manifest")
        return os.fdopen(fd, "rb")


@dataclass
class ServerHandle:
    """A sidecar running in a thread of this process (zb train starts one in-process)."""

    server: SnapshotServer
    thread: threading.Thread

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        assert isinstance(host, str)  # an AF_INET(6) server: its host is a str
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def make_server(root: str | Path, token: str, host: str, port: int, client_timeout: float = 30.0,
                max_connections: int = MAX_CONNECTIONS, host_option: str = "--host") -> SnapshotServer:
    """Bind the sidecar; bad input (`host_option` names where the host came from) is InvalidInput, a
    busy port EnvironmentFailure (one clear line). `root` may be a node's live directory: the rank
    directory under it is served (zb.ckpt.sidecar.live_layout)."""
    root = Path(root)
    if not root.is_dir():
        raise InvalidInput(f"snapshot directory {root} does not exist or is not a directory: a training node with "
                           "ckpt.live_recovery keeps its snapshots in <ckpt.ram_dir>/live/<node id>/r<local rank> "
                           "(default /dev/shm/zb/live/<node id>/r0) while it runs; point --dir at that node "
                           "directory or its rank's, or at any directory of committed snapshots")
    root = served_dir(root)
    if not token:
        raise InvalidInput("the sidecar token is empty: set ZB_CKPT_TOKEN or pass --token-file with a secret")
    try:
        return SnapshotServer(root, token, (host, port), client_timeout, max_connections)
    except socket.gaierror as e:
        raise unresolvable(host_option, host, e) from None
    except OSError as e:
        raise EnvironmentFailure(f"cannot listen on {host}:{port}: {e.strerror or e}; {_bind_hint(e)}") from None


def _bind_hint(e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return "the port is in use: choose another --port or stop the other process"
    if e.errno == errno.EADDRNOTAVAIL:
        return "not an address of this machine: use one of its interface addresses or 0.0.0.0"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "ports below 1024 need root: choose a port >= 1024"
    return "check the host and port"


def serve_in_thread(root: Path, token: str, host: str, port: int = 0, client_timeout: float = 30.0,
                    max_connections: int = MAX_CONNECTIONS, host_option: str = "--host") -> ServerHandle:
    """Start the sidecar in a daemon thread; `.address` is `host:port` (port 0 picks a free one)."""
    server = make_server(root, token, host, port, client_timeout, max_connections, host_option)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                              name="zb-ckpt-serve", daemon=True)
    thread.start()
    log.info("serving snapshots under %s on %s", server.root, ServerHandle(server, thread).address)
    return ServerHandle(server, thread)

