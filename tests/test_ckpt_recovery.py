"""The live-recovery client (zb.ckpt.recovery): split across peers, fallback when a peer dies
mid-transfer or serves bad bytes, restart when a snapshot is pruned, deadlines, progress."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time

import pytest
import torch
from ckpt_peers import TOKEN, check_fetched, write_sample

from zb.ckpt.format.catalog import prune, read_manifest
from zb.ckpt.format.snapshot import load_snapshot, write_snapshot
from zb.ckpt.recovery.fetch import fetch_snapshot
from zb.ckpt.sidecar import server as serve
from zb.errors import EnvironmentFailure, InvalidInput
from zb.testing.procs import free_port


def test_fetch_splits_across_two_peers(peer, tmp_path):
    _, a = peer("a")
    _, b = peer("b")
    a.server.RequestHandlerClass = _SlowHandler  # so b gets chunks however late its threads start
    result = fetch_snapshot([a.address, b.address], TOKEN, tmp_path / "dest", chunk_bytes=64 << 10, progress=False)
    check_fetched(result)
    assert result.step == 10 and sorted(result.peers) == sorted([a.address, b.address])
    assert result.bytes == read_manifest(result.path).total_bytes
    assert set(result.record().fields()) >= {"outer_step", "peers", "bytes", "seconds"}


def test_fetch_only_the_requested_files(peer, tmp_path):
    _, a = peer("a")
    files = ["model.safetensors", "outer.safetensors"]
    result = fetch_snapshot([a.address], TOKEN, tmp_path / "dest", files=files, progress=False)
    assert sorted(read_manifest(result.path).files) == files
    assert not (result.path / "inner.safetensors").exists()
    check_fetched(result, files)


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
    check_fetched(result)
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
    check_fetched(result)
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
                    write_sample(root, step=20)
                    prune(root, keep=1)
            super()._send_file(name, file_name, body)

    a.server.RequestHandlerClass = PruningHandler
    result = fetch_snapshot([a.address], TOKEN, tmp_path / "dest", progress=False)
    assert result.step == 20
    check_fetched(result)
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
    writer = threading.Timer(0.5, lambda: write_sample(root, step=20))
    writer.start()
    try:
        result = fetch_snapshot([a.address], TOKEN, tmp_path / "dest", expect_step=20, wait_s=10, progress=False)
    finally:
        writer.join()
    assert result.step == 20


def test_prefix_hasher_matches_sha256_whatever_the_completion_order(tmp_path):
    import hashlib
    import random

    from zb.ckpt.recovery.prefix_hash import PrefixHasher

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


def test_client_reconnects_after_the_server_dropped_an_idle_connection(peer):
    from zb.ckpt.recovery.peer import PeerClient

    _, h = peer(timeout=0.3)
    client = PeerClient(h.address, TOKEN, timeout=5)
    try:
        assert client.manifest()[1].step == 10
        time.sleep(0.8)  # the server closes the idle keep-alive connection meanwhile
        assert client.manifest()[1].step == 10
    finally:
        client.close()


def test_tail_chunks_are_split_between_idle_connections():
    from zb.ckpt.recovery.ranged import MIN_SPLIT, Board, FilePlan

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


def test_progress_bar_and_log_lines(peer, tmp_path, caplog, monkeypatch):
    from zb.ckpt.recovery import progress

    _, a = peer("a")
    fetch_snapshot([a.address], TOKEN, tmp_path / "bar", progress=True)  # rich bar on stderr
    monkeypatch.setattr(progress, "_LOG_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="zb.ckpt.fetch"):
        fetch_snapshot([a.address], TOKEN, tmp_path / "plain", progress=False)
    assert "live recovery: " in caplog.text and "MB/s" in caplog.text


def test_fetch_deadline_bounds_a_slow_download(tmp_path):
    write_snapshot(tmp_path / "slow", {"model.safetensors": {"w": torch.randn(2 << 20)}}, {}, 1)
    handle = serve.serve_in_thread(tmp_path / "slow", TOKEN, "127.0.0.1", 0)
    handle.server.RequestHandlerClass = _SlowHandler  # ~2 s for the file
    try:
        # The file takes ~2 s: only a deadline of 0.5 s that is honoured makes this fail.
        with pytest.raises(EnvironmentFailure, match="missed its deadline"):
            fetch_snapshot([handle.address], TOKEN, tmp_path / "dest", deadline_s=0.5, progress=False)
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
    check_fetched(result)
    manifest = read_manifest(result.path)
    assert result.bytes == manifest.total_bytes - manifest.files["outer.safetensors"].size
