"""The sidecar's door (issue 40): a connection takes one of `zb ckpt-serve`'s transfer slots only once its request
head has shown the token, so idle, junk and trickling connections cannot starve the run's own joiners. Real sockets
against a sidecar in a thread of this process."""

from __future__ import annotations

import http.client
import select
import socket
import threading
import time

import pytest
from ckpt_peers import TOKEN, http_get, write_sample

from zb.ckpt.sidecar import server as serve
from zb.ckpt.sidecar.gate import MAX_HEAD
from zb.testing.procs import wait_until


@pytest.fixture
def sidecar(tmp_path, monkeypatch):
    """sidecar(max_connections, head_timeout) -> (host, port) of a sidecar over one committed snapshot."""
    handles = []

    def start(max_connections: int, head_timeout: float):
        monkeypatch.setattr(serve, "HEAD_TIMEOUT_S", head_timeout)   # read when the server is made
        root = tmp_path / f"r{len(handles)}"
        root.mkdir()
        write_sample(root)
        handle = serve.serve_in_thread(root, TOKEN, "127.0.0.1", 0, max_connections=max_connections)
        handles.append(handle)
        host, port = handle.address.rsplit(":", 1)
        return handle, (host, int(port))

    yield start
    for h in handles:
        h.close()


def _closed_by_server(s: socket.socket) -> bool:
    """True once the server closed `s` without an answer (a readable socket that reads as the end)."""
    if not select.select([s], [], [], 0)[0]:
        return False
    try:
        return s.recv(1) == b""
    except OSError:
        return True


def test_idle_connections_hold_no_slot_and_the_oldest_make_room(sidecar):
    """300 connections that send nothing (issue 40: 200 got legitimate requests 503 for 30 s). The head deadline is
    60 s here and the request's own timeout 10 s, so a request that succeeds did not wait for the idle ones to be
    dropped: they were still held. Past MAX_WAITING the longest waiting is closed to make room."""
    handle, address = sidecar(max_connections=64, head_timeout=60.0)
    idle = [socket.create_connection(address, timeout=10) for _ in range(300)]
    try:
        response, _ = http_get(handle, "/manifest")   # 10 s timeout, well inside the 60 s head deadline
        assert response.status == 200, response.status
        assert serve.MAX_WAITING < 300
        evicted = 300 - serve.MAX_WAITING
        wait_until(lambda: all(_closed_by_server(s) for s in idle[:evicted]), 30, "the oldest idle ones closed")
        assert not any(_closed_by_server(s) for s in idle[evicted + 5:]), "a newer idle connection was dropped"
    finally:
        for s in idle:
            s.close()


def _slowloris(address, stop: threading.Event, closed: list[float]) -> None:
    """One byte a second of a head that never ends; records when the server closed it."""
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(b"GET /manifest HTTP/1.1\r\nX-Slow: ")
        while not stop.is_set():
            try:
                s.sendall(b"x")
                if select.select([s], [], [], 1.0)[0] and s.recv(100) == b"":
                    break
            except OSError:
                break
        closed.append(time.monotonic())


def _get_closing(address) -> bytes:
    """GET /manifest with the token and `Connection: close`, read to the end: the server gave the slot back
    before it closed, so the next request finds it free."""
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(f"GET /manifest HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n".encode())
        answer = b""
        while data := s.recv(65536):
            answer += data
        return answer


def test_junk_and_a_slowloris_hold_no_slot(sidecar):
    """With one slot: bytes that are not HTTP, an oversized head and a client trickling a byte a second are all
    waiting or gone, never in the slot, so a request with the token is served (not 503); the slowloris and the
    oversized head are closed without an answer."""
    handle, address = sidecar(max_connections=1, head_timeout=3.0)
    tls = socket.create_connection(address, timeout=10)
    tls.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\xab" * 200)   # a TLS hello, never a head end
    huge = socket.create_connection(address, timeout=10)
    huge.sendall(b"GET /manifest HTTP/1.1\r\nX-Pad: " + b"a" * (MAX_HEAD + 1000))
    stop, closed = threading.Event(), []
    slow = threading.Thread(target=_slowloris, args=(address, stop, closed), daemon=True)
    slow.start()
    try:
        time.sleep(0.5)   # all three accepted before the request (accepted in order anyway)
        for _ in range(3):   # one at a time: each ends before the next begins, so one slot is enough
            answer = _get_closing(address)
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        assert huge.recv(100) == b"", "an oversized head got an answer"
        slow.join(30)
        assert closed, "the slowloris was never closed"
        assert tls.recv(100) == b"", "the TLS hello got an answer"   # closed at its head deadline
    finally:
        stop.set()
        tls.close()
        huge.close()


def test_a_wrong_token_is_answered_401_and_closed_at_the_door(sidecar):
    handle, address = sidecar(max_connections=1, head_timeout=3.0)
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(b"GET /manifest HTTP/1.1\r\nAuthorization: Bearer nope\r\n\r\n")
        answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 401 ") and b"WWW-Authenticate: Bearer" in answer, answer
        assert s.recv(100) == b""
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(b"HEAD /manifest HTTP/1.1\r\n\r\n")
        answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 401 ") and answer.endswith(b"\r\n\r\n"), answer   # HEAD: no body
    assert http_get(handle, "/manifest")[0].status == 200


def test_requests_with_the_token_beyond_the_cap_get_503(sidecar):
    """The cap counts connections that showed the token: three kept alive hold the three slots."""
    assert (serve.MAX_CONNECTIONS, serve.MAX_WAITING, serve.HEAD_TIMEOUT_S) == (64, 256, 5.0)   # as the help says
    handle, address = sidecar(max_connections=3, head_timeout=3.0)
    held = [http.client.HTTPConnection(*address, timeout=10) for _ in range(3)]
    try:
        for conn in held:
            conn.request("GET", "/manifest", headers={"Authorization": f"Bearer {TOKEN}"})
            response = conn.getresponse()
            response.read()
            assert response.status == 200   # kept alive: its thread waits for the next request, in its slot
        response, _ = http_get(handle, "/manifest")
        assert response.status == 503 and response.getheader("Retry-After") == "1"
        for conn in held:
            conn.close()
        wait_until(lambda: http_get(handle, "/manifest")[0].status == 200, 30, "a slot after the kept-alive left")
    finally:
        for conn in held:
            conn.close()
