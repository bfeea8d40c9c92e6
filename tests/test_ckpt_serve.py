"""The checkpoint sidecar (auth, paths, ranges, commit rules) and the live-recovery client (split,
fallback when a peer dies mid-transfer or serves bad bytes, restart when a snapshot is pruned)."""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import free_port, subprocess_env
from zb.ckpt import serve
from zb.ckpt.fetch import fetch_snapshot
from zb.ckpt.manifest import MARKER
from zb.ckpt.snapshot import expect_of, load_snapshot, prune, read_manifest, write_snapshot
from zb.errors import EnvironmentFailure, InvalidInput

TOKEN = "t0ken-for-tests-0123456789"


def _tensors(seed: int = 0, n: int = 1 << 18) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {"model.safetensors": {"w": torch.randn(n, generator=g), "b": torch.randn(17, generator=g)},
            "outer.safetensors": {"w": torch.randn(n // 2, generator=g)},
            "inner.safetensors": {"m": torch.randn(1000, generator=g)}}


def _snapshot(root: Path, step: int = 10, seed: int = 0, node: str = "a") -> Path:
    return write_snapshot(root, _tensors(seed), {"node": node}, step, outer_step=step // 10, fingerprint="fp")


@pytest.fixture
def peer(tmp_path):
    """A sidecar in a thread over a snapshot root; yields (root, handle); closes it after the test."""
    handles = []

    def start(name: str = "a", snapshot: bool = True, timeout: float = 30.0):
        root = tmp_path / name
        root.mkdir()
        if snapshot:
            _snapshot(root, node=name)
        handle = serve.serve_in_thread(root, TOKEN, "127.0.0.1", 0, client_timeout=timeout)
        handles.append(handle)
        return root, handle

    yield start
    for h in handles:
        h.close()


def _get(handle, target: str, token: str | None = TOKEN, method: str = "GET", headers: dict | None = None):
    host, port = handle.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    auth = {"Authorization": f"Bearer {token}"} if token is not None else {}
    conn.request(method, target, headers={**auth, **(headers or {})})
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response, body


def _raw(handle, request: bytes) -> bytes:
    host, port = handle.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        return s.recv(65536)


def test_token_is_required(peer):
    _, h = peer()
    assert _get(h, "/manifest", token=None)[0].status == 401
    assert _get(h, "/manifest", token="wrong")[0].status == 401
    assert _get(h, "/manifest", token=TOKEN + "x")[0].status == 401
    assert _get(h, "/manifest", token=None, headers={"Authorization": f"Basic {TOKEN}"})[0].status == 401
    response, body = _get(h, "/manifest")
    assert response.status == 200 and json.loads(body)["step"] == 10


@pytest.mark.parametrize("target", [
    "/files/../../etc/passwd", "/files/%2e%2e/%2e%2e/etc/passwd", "/files/%2E%2E/x.safetensors",
    "/files/step-000000010/..%2f..%2fetc%2fpasswd", "/files/%252e%252e/model.safetensors",
    "/files/step-000000010/%2e%2e%2fCOMMITTED", "/files//etc/passwd", "/files/step-000000010/",
    "/files/step-000000010/manifest.json", "/files/step-000000010/COMMITTED", "/files/.tmp-x/model.safetensors",
    "/files/step-000000010/model.safetensors/..", "/files/step-000000010/%00.safetensors",
    "//etc/passwd", "/../manifest", "/files/step-000000010/model.safetensors%00",
])
def test_traversal_attempts_are_refused(peer, target):
    _, h = peer()
    response, body = _get(h, target)
    assert response.status in (400, 404) and b"root:" not in body


@pytest.mark.parametrize("request_line", [
    b"GET /files/step-000000010/model.safetensors\x00/../../etc/passwd HTTP/1.1",
    b"GET http://evil/files/step-000000010/model.safetensors HTTP/1.1",
    b"GET /files/step-000000010\\..\\..\\etc\\passwd HTTP/1.1",
])
def test_raw_malformed_targets_are_refused(peer, request_line):
    _, h = peer()
    answer = _raw(h, request_line + f"\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n".encode())
    assert answer.split(b" ")[1] in (b"400", b"404")


def test_symlinks_cannot_escape(peer, tmp_path):
    root, h = peer()
    snap = root / "step-000000010"
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"S" * (snap / "inner.safetensors").stat().st_size)
    (snap / "inner.safetensors").unlink()
    (snap / "inner.safetensors").symlink_to(outside)  # same size as the manifest says
    assert _get(h, "/files/step-000000010/inner.safetensors")[0].status == 404
    other = tmp_path / "elsewhere"
    other.mkdir()
    os.symlink(_snapshot(other, step=99), root / "step-000000099")  # a committed snapshot, outside
    assert _get(h, "/files/step-000000099/model.safetensors")[0].status == 404
    response, body = _get(h, "/manifest")  # neither the tampered nor the outside snapshot is offered
    assert response.status == 404 and b"step" not in body


def test_ranges(peer):
    root, h = peer()
    data = (root / "step-000000010" / "model.safetensors").read_bytes()
    target, size = "/files/step-000000010/model.safetensors", len(data)
    response, body = _get(h, target)
    assert response.status == 200 and body == data
    assert response.getheader("ETag") == f'"{read_manifest(root / "step-000000010").files["model.safetensors"].sha256}"'
    for spec, expected, first, last in [("bytes=10-19", data[10:20], 10, 19), ("bytes=-5", data[-5:], size - 5, size - 1),
                                        (f"bytes={size - 3}-", data[-3:], size - 3, size - 1),
                                        (f"bytes=100-{size + 50}", data[100:], 100, size - 1)]:
        response, body = _get(h, target, headers={"Range": spec})
        assert response.status == 206 and body == expected, spec
        assert response.getheader("Content-Range") == f"bytes {first}-{last}/{size}"
    for spec in ("bytes=5-2", f"bytes={size}-", "bytes=abc", "bytes=0-1,3-4", "bytes=-0", "items=0-1"):
        response, _ = _get(h, target, headers={"Range": spec})
        assert response.status == 416 and response.getheader("Content-Range") == f"bytes */{size}", spec
    response, body = _get(h, target, method="HEAD")
    assert response.status == 200 and body == b"" and int(response.getheader("Content-Length")) == size


def test_resume_a_download_with_range(peer):
    root, h = peer()
    data = (root / "step-000000010" / "model.safetensors").read_bytes()
    first, _ = _get(h, "/files/step-000000010/model.safetensors", headers={"Range": "bytes=0-999"})
    _, head = _get(h, "/files/step-000000010/model.safetensors", headers={"Range": "bytes=0-999"})
    _, rest = _get(h, "/files/step-000000010/model.safetensors", headers={"Range": "bytes=1000-"})
    assert first.status == 206 and head + rest == data


def test_refuses_until_first_commit_and_serves_only_committed(peer):
    root, h = peer(snapshot=False)
    response, _ = _get(h, "/manifest")
    assert response.status == 503 and response.getheader("Retry-After") == "1"
    (root / ".tmp-step-000000005").mkdir()
    assert _get(h, "/manifest")[0].status == 503
    path = _snapshot(root, step=20)
    (path / MARKER).rename(root / "marker")  # uncommitted again
    assert _get(h, "/manifest")[0].status == 503
    assert _get(h, "/files/step-000000020/model.safetensors")[0].status == 404
    (root / "marker").rename(path / MARKER)
    assert json.loads(_get(h, "/manifest")[1])["step"] == 20
    _snapshot(root, step=30)
    assert json.loads(_get(h, "/manifest")[1])["step"] == 30
    assert json.loads(_get(h, "/manifest?step=20")[1])["step"] == 20
    assert _get(h, "/manifest?step=25")[0].status == 404
    assert _get(h, "/manifest?step=x")[0].status == 400


def test_stalled_client_is_dropped(peer):
    _, h = peer(timeout=0.5)
    host, port = h.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /manifest HTTP/1.1\r\n")  # never finishes its headers
        start = time.monotonic()
        assert s.recv(100) == b""
        assert time.monotonic() - start < 5


def _check_fetched(result, files=None):
    expected = _tensors()
    expect = {f: expect_of(expected)[f] for f in (files or expected)}
    tensors, meta = load_snapshot(result.path, expect)
    assert meta["node"] in ("a", "b")
    for f in expect:
        for name, t in expected[f].items():
            assert torch.equal(tensors[f][name], t)


def test_fetch_splits_across_two_peers(peer, tmp_path):
    _, a = peer("a")
    _, b = peer("b")
    a.server.RequestHandlerClass = _SlowHandler  # so b gets chunks however late its threads start
    result = fetch_snapshot([a.address, b.address], TOKEN, tmp_path / "dest", chunk_bytes=64 << 10, progress=False)
    _check_fetched(result)
    assert result.step == 10 and sorted(result.peers) == sorted([a.address, b.address])
    assert result.bytes == read_manifest(result.path).total_bytes
    assert set(result.metrics()) >= {"outer_step", "peers", "bytes", "seconds"}


def test_fetch_only_the_requested_files(peer, tmp_path):
    _, a = peer("a")
    files = ["model.safetensors", "outer.safetensors"]
    result = fetch_snapshot([a.address], TOKEN, tmp_path / "dest", files=files, progress=False)
    assert sorted(read_manifest(result.path).files) == files
    assert not (result.path / "inner.safetensors").exists()
    _check_fetched(result, files)


class _DyingHandler(serve._Handler):
    """Sends half of the first file body it serves, then the whole server dies (like a SIGKILL)."""

    def _send_file(self, name, file_name, body):
        real = self.connection

        class HalfSocket:
            def sendfile(self, f, offset, count):
                real.sendfile(f, offset, count // 2)
                raise ConnectionResetError("killed")

        self.server.socket.close()  # no new connections from now on
        self.connection = HalfSocket()
        try:
            super()._send_file(name, file_name, body)
        finally:
            real.close()


def test_fetch_falls_back_when_a_peer_dies_mid_transfer(peer, tmp_path, caplog):
    _, a = peer("a")
    _, b = peer("b")
    b.server.RequestHandlerClass = _DyingHandler
    a.server.RequestHandlerClass = _SlowHandler  # so the dying peer surely gets a chunk
    result = fetch_snapshot([b.address, a.address], TOKEN, tmp_path / "dest", chunk_bytes=256 << 10,
                            progress=False, timeout=5)
    _check_fetched(result)
    assert a.address in result.peers
    assert f"{b.address}: transfer of" in caplog.text and "broke at byte" in caplog.text


def test_fetch_drops_a_peer_serving_bad_bytes(peer, tmp_path, caplog):
    _, a = peer("a")
    root_b, b = peer("b")
    with open(root_b / "step-000000010" / "model.safetensors", "r+b") as f:  # same size, wrong bytes
        f.seek(5000)
        f.write(b"\xff" * 64)
    a.server.RequestHandlerClass = _SlowHandler  # so the bad peer surely serves part of the file
    result = fetch_snapshot([b.address, a.address], TOKEN, tmp_path / "dest", chunk_bytes=64 << 10, progress=False)
    _check_fetched(result)
    assert f"{b.address} served a copy of model.safetensors that does not match" in caplog.text
    with pytest.raises(EnvironmentFailure, match="does not match its sha256"):
        fetch_snapshot([b.address], TOKEN, tmp_path / "dest2", progress=False)


def test_fetch_restarts_when_the_snapshot_is_pruned_mid_download(peer, tmp_path):
    root, a = peer("a")
    replaced = threading.Lock()  # the fetcher opens several connections: only the first replaces

    class PruningHandler(serve._Handler):
        def _send_file(self, name, file_name, body):
            with replaced:
                if (root / name).exists() and read_manifest(root / name).step == 10:
                    _snapshot(root, step=20)
                    prune(root, keep=1)
            super()._send_file(name, file_name, body)

    a.server.RequestHandlerClass = PruningHandler
    result = fetch_snapshot([a.address], TOKEN, tmp_path / "dest", progress=False)
    assert result.step == 20
    _check_fetched(result)
    assert [p.name for p in (tmp_path / "dest").iterdir()] == ["step-000000020"]  # no partial left behind


def test_fetch_failures_name_the_peers(peer, tmp_path):
    _, a = peer("a")
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(EnvironmentFailure, match=f"no peer serves a committed snapshot.*{dead}"):
        fetch_snapshot([dead], TOKEN, tmp_path / "d", timeout=2, progress=False)
    with pytest.raises(EnvironmentFailure, match="token rejected"):
        fetch_snapshot([a.address], "wrong-token-0123456789", tmp_path / "d", progress=False)
    with pytest.raises(InvalidInput, match="another run"):
        fetch_snapshot([a.address], TOKEN, tmp_path / "d", fingerprint="other", progress=False)
    with pytest.raises(EnvironmentFailure, match="step 99"):
        fetch_snapshot([a.address], TOKEN, tmp_path / "d", expect_step=99, wait_s=0.5, progress=False)
    with pytest.raises(InvalidInput, match="host:port"):
        fetch_snapshot(["nonsense"], TOKEN, tmp_path / "d")


def test_fetch_waits_for_the_expected_step(peer, tmp_path):
    root, a = peer("a")
    writer = threading.Timer(0.5, lambda: _snapshot(root, step=20))
    writer.start()
    try:
        result = fetch_snapshot([a.address], TOKEN, tmp_path / "dest", expect_step=20, wait_s=10, progress=False)
    finally:
        writer.join()
    assert result.step == 20


def _start_cli(*args: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "zb", "ckpt-serve", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_cli_serves_publishes_and_stops_on_sigterm(tmp_path):
    from datetime import timedelta

    from torch.distributed import TCPStore

    _snapshot(tmp_path)
    store_port = free_port()
    store = TCPStore("127.0.0.1", store_port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    proc = _start_cli("--dir", str(tmp_path), "--host", "127.0.0.1", "--token-file", str(token_file), "--json",
                      "--publish", f"127.0.0.1:{store_port}", "--node-id", "n1", env=subprocess_env())
    try:
        line = json.loads(proc.stdout.readline())
        assert store.get("ckpt_serve/n1").decode() == line["address"]
        result = fetch_snapshot([line["address"]], TOKEN, tmp_path / "dest", progress=False)
        _check_fetched(result)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert not store.check(["ckpt_serve/n1"])
    finally:
        proc.kill()
        proc.wait()


def test_cli_clear_errors(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = subprocess_env(ZB_CKPT_TOKEN=TOKEN)
        for args, code, message in [
            (["--dir", str(tmp_path), "--host", "127.0.0.1", "--port", str(port)], 1, "in use"),
            (["--dir", str(tmp_path / "missing")], 2, "does not exist"),
            (["--dir", str(tmp_path), "--token-file", str(tmp_path / "nope")], 2, "cannot read the token file"),
            (["--dir", str(tmp_path), "--publish", "127.0.0.1:1"], 2, "needs a node id"),
            (["--dir", str(tmp_path), "--publish", f"127.0.0.1:{free_port()}", "--node-id", "n",
              "--connect-timeout", "0.5"], 1, "cannot reach the global store"),
        ]:
            proc = subprocess.run([sys.executable, "-m", "zb", "ckpt-serve", *args], env=env, capture_output=True,
                                  text=True, timeout=60)
            assert proc.returncode == code, (args, proc.stderr)
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], proc.stderr
        proc = subprocess.run([sys.executable, "-m", "zb", "ckpt-serve", "--dir", str(tmp_path)],
                              env=subprocess_env(), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "ZB_CKPT_TOKEN" in proc.stderr


def test_prefix_hasher_matches_sha256_whatever_the_completion_order(tmp_path):
    import hashlib
    import random

    from zb.ckpt.prefix_hash import PrefixHasher

    data = os.urandom(3_000_001)
    path = tmp_path / "f"
    path.write_bytes(data)
    chunks = [(s, min(s + 100_000, len(data))) for s in range(0, len(data), 100_000)]
    random.Random(0).shuffle(chunks)
    fd = os.open(path, os.O_RDONLY)
    try:
        hasher = PrefixHasher(fd, len(data))
        for start, stop in chunks[:-1]:
            hasher.add(start, stop)
        partial = PrefixHasher(fd, len(data))
        partial.add(0, 100_000)
        assert partial.result() is None  # incomplete: no digest, thread stopped
        hasher.add(*chunks[-1])
        assert hasher.result() == hashlib.sha256(data).hexdigest()
    finally:
        os.close(fd)


def test_pruning_during_a_transfer_does_not_cut_it(tmp_path):
    root = tmp_path / "r"
    path = write_snapshot(root, {"big.safetensors": {"x": torch.randn(4 << 20)}}, {}, 1)
    data = (path / "big.safetensors").read_bytes()
    handle = serve.serve_in_thread(root, TOKEN, "127.0.0.1", 0)
    try:
        host, port = handle.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", f"/files/{path.name}/big.safetensors", headers={"Authorization": f"Bearer {TOKEN}"})
        response = conn.getresponse()
        head = response.read(1 << 20)
        write_snapshot(root, {"big.safetensors": {"x": torch.zeros(4)}}, {}, 2)
        assert [p.name for p in prune(root, keep=1)] == [path.name] and not path.exists()
        assert head + response.read() == data
        conn.close()
        assert _get(handle, f"/files/{path.name}/big.safetensors")[0].status == 404
    finally:
        handle.close()


def test_client_reconnects_after_the_server_dropped_an_idle_connection(peer):
    from zb.ckpt.peer import PeerClient

    _, h = peer(timeout=0.3)
    client = PeerClient(h.address, TOKEN, timeout=5)
    try:
        assert client.manifest()[1].step == 10
        time.sleep(0.8)  # the server closes the idle keep-alive connection meanwhile
        assert client.manifest()[1].step == 10
    finally:
        client.close()


def test_tail_chunks_are_split_between_idle_connections():
    from zb.ckpt.download import MIN_SPLIT, Board, FilePlan

    board = Board({"f.safetensors": FilePlan(10 * MIN_SPLIT, "0" * 64, ["a", "b"])}, chunk_bytes=10 * MIN_SPLIT)
    first = board.take("a")
    first.done = 2 * MIN_SPLIT
    second = board.take("b")  # nothing pending: b takes the second half of what a has left
    assert (first.start, first.stop, second.start, second.stop) == (0, 6 * MIN_SPLIT, 6 * MIN_SPLIT, 10 * MIN_SPLIT)
    board.finish(second, "b")
    first.done = first.stop - MIN_SPLIT  # too little left to split again: b would wait for it
    board.finish(first, "a")
    assert board.take("b") is None and not board.pending and not board.inflight


class _SlowHandler(serve._Handler):
    """Serves file bytes at ~4 MB/s, so a faster peer must take over the tail."""

    def _send_file(self, name, file_name, body):
        real = self.connection

        class Slow:
            def sendfile(self, f, offset, count):
                total = count
                while count > 0:
                    n = real.sendfile(f, offset, min(count, 256 << 10))
                    offset, count = offset + n, count - n
                    time.sleep(0.06)
                return total

        self.connection = Slow()
        try:
            super()._send_file(name, file_name, body)
        finally:
            self.connection = real


def test_fetch_from_a_slow_and_a_fast_peer(tmp_path):
    """One 8 MB chunk, first taken by the slow peer (alone it needs ~2 s): the fast one takes over."""
    tensors = {"model.safetensors": {"w": torch.randn(2 << 20)}}
    handles = []
    for name in ("slow", "fast"):
        write_snapshot(tmp_path / name, tensors, {}, 1)
        handles.append(serve.serve_in_thread(tmp_path / name, TOKEN, "127.0.0.1", 0))
    handles[0].server.RequestHandlerClass = _SlowHandler
    try:
        start = time.monotonic()
        result = fetch_snapshot([h.address for h in handles], TOKEN, tmp_path / "dest", chunk_bytes=8 << 20,
                                progress=False)
        elapsed = time.monotonic() - start
        assert torch.equal(load_snapshot(result.path)[0]["model.safetensors"]["w"], tensors["model.safetensors"]["w"])
        slow, fast = (result.bytes_by_peer.get(h.address, 0) for h in handles)
        assert fast > slow, (slow, fast, elapsed)  # without splitting the slow peer would serve it all
    finally:
        for h in handles:
            h.close()


def test_a_client_resetting_its_connection_is_not_a_traceback(peer, capfd):
    _, h = peer()
    host, port = h.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # close = RST
    s.sendall(b"GET /manifest HTTP/1.1\r\n")
    s.close()
    time.sleep(0.3)
    assert _get(h, "/manifest")[0].status == 200
    assert "Traceback" not in capfd.readouterr().err


def test_progress_bar_and_log_lines(peer, tmp_path, caplog, monkeypatch):
    from zb.ckpt import progress

    _, a = peer("a")
    fetch_snapshot([a.address], TOKEN, tmp_path / "bar", progress=True)  # rich bar on stderr
    monkeypatch.setattr(progress, "_LOG_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="zb.ckpt.fetch"):
        fetch_snapshot([a.address], TOKEN, tmp_path / "plain", progress=False)
    assert "live recovery: " in caplog.text and "MB/s" in caplog.text


@pytest.mark.parametrize("header, size, expected", [
    (None, 10, None), ("bytes=0-0", 10, (0, 1)), ("bytes=2-", 10, (2, 10)), ("bytes=-3", 10, (7, 10)),
    ("bytes=-30", 10, (0, 10)), ("bytes=5-100", 10, (5, 10)), (" bytes=1-2 ", 10, (1, 3)),
    ("bytes=10-", 10, 416), ("bytes=3-2", 10, 416), ("bytes=-", 10, 416), ("bytes=0-1,2-3", 10, 416),
    ("bytes=0-0", 0, 416), ("bits=0-1", 10, 416),
])
def test_parse_range(header, size, expected):
    from zb.ckpt.http_util import HttpError, parse_range

    if expected == 416:
        with pytest.raises(HttpError) as e:
            parse_range(header, size)
        assert e.value.status == 416 and e.value.headers["Content-Range"] == f"bytes */{size}"
    else:
        assert parse_range(header, size) == expected


@pytest.mark.parametrize("target, expected", [
    ("/manifest", ("manifest", "")), ("/manifest?step=3", ("manifest", "step=3")),
    ("/files/step-1/model.safetensors", ("file", "step-1", "model.safetensors")),
    ("/files/step%2D1/model.safetensors", ("file", "step-1", "model.safetensors")),
    ("/files/%2e%2e/model.safetensors", 400), ("/files/a/b/c.safetensors", 404), ("/files/a/..", 400),
    ("/files/a/%c0%ae.safetensors", 400), ("/files/a/x.safetensors%2f", 400), ("http://h/manifest", 400),
    ("/nothing", 404), ("/files/.hidden/x.safetensors", 400),
])
def test_route(target, expected):
    from zb.ckpt.http_util import HttpError, route

    if isinstance(expected, int):
        with pytest.raises(HttpError) as e:
            route(target)
        assert e.value.status == expected
    else:
        assert route(target) == expected


def test_advertised_address_and_store_keys():
    from zb.ckpt.publish import advertised_address, peer_addresses, publish_address

    assert advertised_address("10.1.2.3", 7000) == "10.1.2.3:7000"
    assert advertised_address("0.0.0.0", 7000, advertise="node-a.vpn") == "node-a.vpn:7000"
    assert advertised_address("0.0.0.0", 7000, toward="127.0.0.1") == "127.0.0.1:7000"  # route to the store
    assert advertised_address("::1", 7000) == "[::1]:7000"

    class DictStore(dict):
        def set(self, key, value):
            self[key] = value.encode()

        def check(self, keys):
            return all(k in self for k in keys)

    store = DictStore()
    assert publish_address(store, "n1", "10.0.0.1:7000") == "ckpt_serve/n1"
    assert peer_addresses(store, ["n1", "n2"]) == {"n1": "10.0.0.1:7000"}


def test_fetch_deadline_bounds_a_slow_download(tmp_path):
    write_snapshot(tmp_path / "slow", {"model.safetensors": {"w": torch.randn(2 << 20)}}, {}, 1)
    handle = serve.serve_in_thread(tmp_path / "slow", TOKEN, "127.0.0.1", 0)
    handle.server.RequestHandlerClass = _SlowHandler  # ~2 s for the file
    try:
        start = time.monotonic()
        with pytest.raises(EnvironmentFailure, match="missed its deadline"):
            fetch_snapshot([handle.address], TOKEN, tmp_path / "dest", deadline_s=0.5, progress=False)
        assert time.monotonic() - start < 3
        assert not (tmp_path / "dest" / "step-000000001").exists()
        assert (tmp_path / "dest" / ".tmp-step-000000001").is_dir()  # kept: a retry reuses complete files
    finally:
        handle.close()
    handle = serve.serve_in_thread(tmp_path / "slow", TOKEN, "127.0.0.1", 0)
    try:
        result = fetch_snapshot([handle.address], TOKEN, tmp_path / "dest", progress=False)
        assert [p.name for p in (tmp_path / "dest").iterdir()] == [result.path.name]
    finally:
        handle.close()


def test_fetch_reuses_files_completed_by_an_interrupted_fetch(peer, tmp_path):
    root, a = peer("a")
    partial = tmp_path / "dest" / ".tmp-step-000000010"
    partial.mkdir(parents=True)
    shutil.copy(root / "step-000000010" / "outer.safetensors", partial)
    (partial / "model.safetensors").write_bytes(b"torn")
    result = fetch_snapshot([a.address], TOKEN, tmp_path / "dest", progress=False)
    _check_fetched(result)
    manifest = read_manifest(result.path)
    assert result.bytes == manifest.total_bytes - manifest.files["outer.safetensors"].size
