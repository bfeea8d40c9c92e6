"""One link measurement over raw TCP sockets: round-trip time, then bandwidth timed by the receiver.

Used by zb/net/iperf.py (`zb iperf-mesh`, before a run) and zb/elastic/linkprobe.py (a run's nodes
measuring their links in the background, elastic.measure_links). Per ordered pair (sender ->
receiver), tagged (iperf-mesh: with the phase number) so a late connection from an earlier
measurement is never mistaken for the current one:

1. control connection, header {kind: control}: the receiver sends `pings` single bytes and times
   each echo from the sender (the median is the link's RTT);
2. `streams` data connections, header {kind: data}: the sender writes a preallocated buffer for
   `duration` seconds, then closes; the receiver counts bytes between the first and the last byte
   it gets. Sender-side numbers are never used: send() returns once the kernel has buffered the
   bytes, so a sender's rate overstates the link by whatever the socket buffers hold.
"""

from __future__ import annotations

import json
import queue
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from zb.dial import unresolvable
from zb.errors import EnvironmentFailure

MAGIC = b"ZBIP"
HEADER = struct.Struct("!4sI")  # magic, length of the JSON that follows
MAX_HEADER = 4096
SEND_CHUNK = 64 * 1024  # small enough that a slow link overshoots --duration by little
RECV_CHUNK = 256 * 1024


class LinkError(Exception):
    """This measurement failed (peer unreachable, silent or gone); the mesh goes on without it."""


@dataclass
class Measurement:
    """What the receiver saw on one ordered link; error is None when it worked."""

    src: int | str       # iperf-mesh ranks, or node ids (zb.elastic.linkprobe)
    dst: int | str
    mbps: float | None = None
    bytes: int = 0
    seconds: float = 0.0
    rtt_ms: float | None = None
    error: str | None = None

    def to_json(self) -> dict:
        return {"src": self.src, "dst": self.dst, "mbps": self.mbps, "bytes": self.bytes,
                "seconds": self.seconds, "rtt_ms": self.rtt_ms, "error": self.error}


def _send_header(sock: socket.socket, fields: dict) -> None:
    payload = json.dumps(fields).encode()
    sock.sendall(HEADER.pack(MAGIC, len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise LinkError("connection closed by the peer")
        data += chunk
    return data


def _read_header(sock: socket.socket) -> dict:
    magic, length = HEADER.unpack(_recv_exact(sock, HEADER.size))
    if magic != MAGIC or length > MAX_HEADER:
        raise LinkError("not an iperf-mesh connection")
    return json.loads(_recv_exact(sock, length))


class LinkServer:
    """The listening socket of one rank; an accept thread queues each connection with its header."""

    def __init__(self, bind: str, port: int = 0) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # Reruns right after a previous run must not trip over its TIME_WAIT sockets; a live
        # listener on the port still makes bind() fail, which is what --port users need to hear.
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((bind, port))
        except socket.gaierror as e:
            self._sock.close()
            raise unresolvable("--bind", bind, e) from None
        except OSError as e:
            self._sock.close()
            hint = "pick another --port, or leave --port out for a free one" if port else "check --bind"
            raise EnvironmentFailure(f"cannot listen on {bind}:{port} ({e.strerror or e}); {hint}") from e
        self._sock.listen(64)
        self._sock.settimeout(0.2)  # the accept loop wakes up to notice close()
        self.port: int = self._sock.getsockname()[1]
        self._inbox: queue.Queue[tuple[dict, socket.socket]] = queue.Queue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="iperf-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._admit, args=(conn,), daemon=True).start()

    def _admit(self, conn: socket.socket) -> None:
        """Read the header off the accept thread, so one slow client cannot stall the others."""
        try:
            conn.settimeout(10.0)
            self._inbox.put((_read_header(conn), conn))
        except (OSError, LinkError, ValueError):
            conn.close()

    def take(self, tag: int, src: int | str, kind: str, wait_s: float, sender_error: Callable[[], str | None]) -> socket.socket:
        """The next `kind` connection from `src` in phase `tag`; LinkError when the sender reports a
        failure (sender_error) or nothing comes within wait_s."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                header, conn = self._inbox.get(timeout=0.1)
            except queue.Empty:
                failure = sender_error()
                if failure:
                    raise LinkError(failure) from None
                if time.monotonic() > deadline:
                    raise LinkError(f"no {kind} connection from rank {src} within {wait_s:g} s") from None
                continue
            if (header.get("tag"), header.get("src"), header.get("kind")) == (tag, src, kind):
                return conn
            conn.close()  # a straggler from an earlier phase, or not ours

    def take_any(self, wait_s: float) -> tuple[dict, socket.socket] | None:
        """The next control connection from any sender, with its header; None if none comes within wait_s.
        Data connections waiting here belong to a measurement already given up on: closed."""
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                header, conn = self._inbox.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            if header.get("kind") == "control" and isinstance(header.get("tag"), int) and "src" in header:
                return header, conn
            conn.close()
        return None

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        self._thread.join(timeout=2)
        while not self._inbox.empty():
            self._inbox.get_nowait()[1].close()


def _connect(addr: str, port: int, connect_timeout_s: float, io_timeout_s: float) -> socket.socket:
    try:
        sock = socket.create_connection((addr, port), timeout=connect_timeout_s)
    except TimeoutError:
        raise LinkError(f"connect to {addr}:{port} timed out after {connect_timeout_s:g} s") from None
    except OSError as e:
        raise LinkError(f"connect to {addr}:{port} failed: {e.strerror or e}") from None
    sock.settimeout(io_timeout_s)
    return sock


def send(addr: str, port: int, src: int | str, dst: int | str, tag: int, *, streams: int, pings: int, duration_s: float,
         connect_timeout_s: float, io_timeout_s: float) -> None:
    """The sender's side of one measurement; LinkError (with a one-line reason) on failure."""
    socks: list[socket.socket] = []
    try:
        control = _connect(addr, port, connect_timeout_s, io_timeout_s)
        socks.append(control)
        control.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # pings must not wait for Nagle
        _send_header(control, {"kind": "control", "src": src, "dst": dst, "tag": tag})
        for _ in range(pings):
            control.sendall(_recv_exact(control, 1))
        data = []
        for index in range(streams):
            sock = _connect(addr, port, connect_timeout_s, io_timeout_s)
            socks.append(sock)
            _send_header(sock, {"kind": "data", "src": src, "dst": dst, "tag": tag, "index": index})
            data.append(sock)
        _stream(data, duration_s)
        _recv_exact(control, 1)  # the receiver's "done": it has counted everything
    except OSError as e:
        raise LinkError(f"sending to {addr}:{port} failed: {e.strerror or e}") from None
    finally:
        for sock in socks:
            sock.close()


def _stream(socks: list[socket.socket], duration_s: float) -> None:
    """Write for duration_s on every socket at once (one thread each; sendall drops the GIL)."""
    payload = memoryview(bytearray(SEND_CHUNK))
    end = time.perf_counter() + duration_s

    def pump(sock: socket.socket, _: int) -> None:
        while time.perf_counter() < end:
            sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)  # EOF: the receiver stops its clock at the last byte

    _on_every_socket(pump, socks)


def receive(server: LinkServer, src: int | str, dst: int | str, tag: int, *, streams: int, pings: int, wait_s: float,
            io_timeout_s: float, sender_error: Callable[[], str | None],
            control: socket.socket | None = None) -> Measurement:
    """The receiver's side of one measurement: it times everything. `control`: the sender's control
    connection when the caller has already taken it (LinkServer.take_any)."""
    result = Measurement(src, dst)
    socks: list[socket.socket] = []
    try:
        control = control or server.take(tag, src, "control", wait_s, sender_error)
        socks.append(control)
        control.settimeout(io_timeout_s)
        control.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        result.rtt_ms = _ping(control, pings)
        for _ in range(streams):
            sock = server.take(tag, src, "data", wait_s, sender_error)
            sock.settimeout(io_timeout_s)
            socks.append(sock)
        result.bytes, result.seconds = _drain(socks[1:])
        control.sendall(b"d")
        if result.seconds <= 0:
            raise LinkError(f"too few bytes to time ({result.bytes}); use a longer --duration")
        result.mbps = result.bytes * 8 / result.seconds / 1e6
    except (LinkError, OSError) as e:
        # The sender's own reason (refused, timed out) says more than the silence seen here.
        mine = str(e) if isinstance(e, LinkError) else f"receiving failed: {e.strerror or e}"
        result.error, result.mbps = sender_error() or mine, None
    finally:
        for sock in socks:
            sock.close()
    return result


def _ping(control: socket.socket, pings: int) -> float:
    """Median round trip of single bytes, in ms."""
    rtts = []
    for _ in range(pings):
        t0 = time.perf_counter()
        control.sendall(b"p")
        _recv_exact(control, 1)
        rtts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(rtts)


def _drain(socks: list[socket.socket]) -> tuple[int, float]:
    """Read every stream to EOF; returns (bytes after each stream's first read, seconds from the first
    read to the last on any stream)."""
    counts = [0] * len(socks)
    firsts: list[float] = []
    lasts: list[float] = []

    def sink(sock: socket.socket, i: int) -> None:
        buf = memoryview(bytearray(RECV_CHUNK))
        first = last = None
        while True:
            n = sock.recv_into(buf)
            now = time.perf_counter()
            if n == 0:
                break
            if first is None:
                first = now  # the clock starts here: this read's bytes arrived before it
            else:
                counts[i] += n
            last = now
        if first is not None:
            assert last is not None  # set by the same read that set first
            firsts.append(first)
            lasts.append(last)

    _on_every_socket(sink, socks)
    if not firsts:
        return 0, 0.0
    return sum(counts), max(lasts) - min(firsts)


def _on_every_socket(work, socks: list[socket.socket]) -> None:
    """work(sock, index) on every socket at once, one thread each (socket calls drop the GIL); the
    first OSError any of them hit is raised once all are done."""
    errors: list[OSError] = []

    def guarded(sock: socket.socket, i: int) -> None:
        try:
            work(sock, i)
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(s, i), daemon=True) for i, s in enumerate(socks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
