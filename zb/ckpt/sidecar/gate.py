"""The sidecar's door: connections wait here, all in one thread, until their request head shows the token.

A connection takes a transfer slot (a thread of zb.ckpt.sidecar.server) only once its first request head has
arrived whole and carries the token. Until then it costs a descriptor and at most MAX_HEAD bytes, no thread and no
slot, and it waits at most `head_timeout` seconds in all, however it trickles (slowloris). At most `max_waiting`
wait at once: one more closes the one that has waited longest, so a flood pushes out only connections that have
waited longer than a joiner, which sends its head with its connect. A head without the token is answered 401
and closed; bytes that are not a head within MAX_HEAD are closed without an answer.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zb.ckpt.sidecar.http import head_end, head_token, token_matches

log = logging.getLogger("zb.ckpt.serve")

MAX_HEAD = 8192       # a joiner's head is ~200 bytes
_BODY = b'{"error": "missing or wrong token"}'
_UNAUTHORIZED = (b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nWWW-Authenticate: Bearer "
                 b'realm="zb"\r\nConnection: close\r\nContent-Length: ' + str(len(_BODY)).encode() + b"\r\n\r\n")

Admit = Callable[[socket.socket, Any, bytes], None]


def answer_and_close(sock: socket.socket, answer: bytes) -> None:
    """Send a short answer without blocking (a fresh socket's send buffer takes it whole) and close."""
    try:
        sock.setblocking(False)
        sock.send(answer)
        sock.recv(1 << 16)   # drop what the client already sent, so close() sends FIN, not RST
    except OSError:
        pass
    finally:
        sock.close()


@dataclass
class _Waiting:
    address: Any
    deadline: float
    head: bytearray = field(default_factory=bytearray)


class Gate:
    """Holds connections until their head shows `token`, then hands them to `admit(sock, address, head)` (on the
    gate's thread: it must not block) with the bytes read so far, the whole head and anything after it."""

    def __init__(self, token: bytes, admit: Admit, head_timeout: float, max_waiting: int):
        self._token, self._admit = token, admit
        self._head_timeout, self._max_waiting = head_timeout, max_waiting
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._incoming: deque[tuple[socket.socket, Any]] = deque()
        self._waiting: dict[socket.socket, _Waiting] = {}   # in arrival order: the first waited longest
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="zb-ckpt-serve-gate", daemon=True)
        self._thread.start()

    def put(self, sock: socket.socket, address: Any) -> None:
        """A freshly accepted connection (from the accept thread)."""
        self._incoming.append((sock, address))
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass   # the wake-up buffer is full: the gate is awake anyway

    def close(self) -> None:
        self._closing = True
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            while not self._closing:
                for key, _ in self._selector.select(self._timeout()):
                    if key.fileobj is self._wake_r:
                        self._drain_wake()
                    else:
                        self._read(key.fileobj)   # type: ignore[arg-type]  # only sockets are registered
                self._take_incoming()
                self._expire(time.monotonic())
        finally:
            for sock in [*self._waiting, *(s for s, _ in self._incoming)]:
                sock.close()
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _timeout(self) -> float | None:
        oldest = next(iter(self._waiting.values()), None)   # the earliest deadline: all wait equally long
        return None if oldest is None else max(0.0, oldest.deadline - time.monotonic())

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _take_incoming(self) -> None:
        while self._incoming:
            sock, address = self._incoming.popleft()
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ)
            self._waiting[sock] = _Waiting(address, time.monotonic() + self._head_timeout)
            if len(self._waiting) > self._max_waiting:
                oldest = next(iter(self._waiting))
                log.debug("closing %s: %d connections wait for their request head", self._waiting[oldest].address,
                          len(self._waiting))
                self._drop(oldest)

    def _expire(self, now: float) -> None:
        while self._waiting:
            sock, waiting = next(iter(self._waiting.items()))
            if waiting.deadline > now:
                return
            log.debug("closing %s: no whole request head within %g s", waiting.address, self._head_timeout)
            self._drop(sock)

    def _read(self, sock: socket.socket) -> None:
        waiting = self._waiting[sock]
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        waiting.head += data
        end = head_end(waiting.head)
        if not data or (end is None and len(waiting.head) > MAX_HEAD):
            self._drop(sock)
        elif end is not None:
            self._release(sock)
            self._decide(sock, waiting, end)

    def _decide(self, sock: socket.socket, waiting: _Waiting, end: int) -> None:
        head = bytes(waiting.head)
        if token_matches(head_token(head[:end]), self._token):
            sock.setblocking(True)
            self._admit(sock, waiting.address, head)
        else:
            log.debug("refusing %s: missing or wrong token", waiting.address)
            answer_and_close(sock, _UNAUTHORIZED + (b"" if head.startswith(b"HEAD ") else _BODY))

    def _release(self, sock: socket.socket) -> None:
        self._selector.unregister(sock)
        del self._waiting[sock]

    def _drop(self, sock: socket.socket) -> None:
        self._release(sock)
        sock.close()
