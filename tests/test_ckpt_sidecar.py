"""The checkpoint sidecar (zb.ckpt.sidecar): auth, paths, ranges, commit rules, the `zb ckpt-serve`
process and where peers find it."""

from __future__ import annotations

import http.client
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from ckpt_peers import TOKEN, check_fetched, http_get, raw_request, write_sample

from zb.ckpt.format.catalog import prune, read_manifest
from zb.ckpt.format.manifest import MARKER
from zb.ckpt.format.snapshot import write_snapshot
from zb.ckpt.recovery.fetch import fetch_snapshot
from zb.ckpt.sidecar import server as serve
from zb.testing.procs import free_port, subprocess_env


def test_token_is_required(peer):
    _, h = peer()
    assert http_get(h, "/manifest", token=None)[0].status == 401
    assert http_get(h, "/manifest", token="wrong")[0].status == 401
    assert http_get(h, "/manifest", token=TOKEN + "x")[0].status == 401
    assert http_get(h, "/manifest", token=None, headers={"Authorization": f"Basic {TOKEN}"})[0].status == 401
    response, body = http_get(h, "/manifest")
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
    response, body = http_get(h, target)
    assert response.status in (400, 404) and b"root:" not in body


@pytest.mark.parametrize("request_line", [
    b"GET /files/step-000000010/model.safetensors\x00/../../etc/passwd HTTP/1.1",
    b"GET http://evil/files/step-000000010/model.safetensors HTTP/1.1",
    b"GET /files/step-000000010\\..\\..\\etc\\passwd HTTP/1.1",
])
def test_raw_malformed_targets_are_refused(peer, request_line):
    _, h = peer()
    answer = raw_request(h, request_line + f"\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n".encode())
    assert answer.split(b" ")[1] in (b"400", b"404")


def test_symlinks_cannot_escape(peer, tmp_path):
    root, h = peer()
    snap = root / "step-000000010"
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"S" * (snap / "inner.safetensors").stat().st_size)
    (snap / "inner.safetensors").unlink()
    (snap / "inner.safetensors").symlink_to(outside)  # same size as the manifest says
    assert http_get(h, "/files/step-000000010/inner.safetensors")[0].status == 404
    other = tmp_path / "elsewhere"
    other.mkdir()
    os.symlink(write_sample(other, step=99), root / "step-000000099")  # a committed snapshot, outside
    assert http_get(h, "/files/step-000000099/model.safetensors")[0].status == 404
    response, body = http_get(h, "/manifest")  # neither the tampered nor the outside snapshot is offered
    assert response.status == 404 and b"step" not in body


def test_hard_links_are_refused_and_logged(peer, tmp_path, caplog):
    """Issue 40: a hard link in --dir was served. A file with more than one link may be a file outside the
    directory (O_NOFOLLOW does not see it): refused with 403 and a warning naming it, as a symlink is refused
    (404, also logged)."""
    root, h = peer()
    snap = root / "step-000000010"
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"S" * (snap / "inner.safetensors").stat().st_size)   # the size the manifest says
    (snap / "inner.safetensors").unlink()
    os.link(outside, snap / "inner.safetensors")
    with caplog.at_level(logging.WARNING, logger="zb.ckpt.serve"):
        response, body = http_get(h, "/files/step-000000010/inner.safetensors")
    assert response.status == 403 and b"SSS" not in body, (response.status, body[:100])
    assert "step-000000010/inner.safetensors" in caplog.text and "2 hard links" in caplog.text, caplog.text
    (snap / "outer.safetensors").unlink()
    (snap / "outer.safetensors").symlink_to(outside)   # a symlink is refused and logged too
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zb.ckpt.serve"):
        assert http_get(h, "/files/step-000000010/outer.safetensors")[0].status == 404
    assert "step-000000010/outer.safetensors" in caplog.text and "symlink" in caplog.text, caplog.text
    assert http_get(h, "/files/step-000000010/model.safetensors")[0].status == 200   # the rest is still served


def test_ranges(peer):
    root, h = peer()
    data = (root / "step-000000010" / "model.safetensors").read_bytes()
    target, size = "/files/step-000000010/model.safetensors", len(data)
    response, body = http_get(h, target)
    assert response.status == 200 and body == data
    assert response.getheader("ETag") == f'"{read_manifest(root / "step-000000010").files["model.safetensors"].sha256}"'
    for spec, expected, first, last in [("bytes=10-19", data[10:20], 10, 19), ("bytes=-5", data[-5:], size - 5, size - 1),
                                        (f"bytes={size - 3}-", data[-3:], size - 3, size - 1),
                                        (f"bytes=100-{size + 50}", data[100:], 100, size - 1)]:
        response, body = http_get(h, target, headers={"Range": spec})
        assert response.status == 206 and body == expected, spec
        assert response.getheader("Content-Range") == f"bytes {first}-{last}/{size}"
    for spec in ("bytes=5-2", f"bytes={size}-", "bytes=abc", "bytes=0-1,3-4", "bytes=-0", "items=0-1"):
        response, _ = http_get(h, target, headers={"Range": spec})
        assert response.status == 416 and response.getheader("Content-Range") == f"bytes */{size}", spec
    response, body = http_get(h, target, method="HEAD")
    assert response.status == 200 and body == b"" and int(response.getheader("Content-Length")) == size


def test_resume_a_download_with_range(peer):
    root, h = peer()
    data = (root / "step-000000010" / "model.safetensors").read_bytes()
    first, _ = http_get(h, "/files/step-000000010/model.safetensors", headers={"Range": "bytes=0-999"})
    _, head = http_get(h, "/files/step-000000010/model.safetensors", headers={"Range": "bytes=0-999"})
    _, rest = http_get(h, "/files/step-000000010/model.safetensors", headers={"Range": "bytes=1000-"})
    assert first.status == 206 and head + rest == data


def test_refuses_until_first_commit_and_serves_only_committed(peer):
    root, h = peer(snapshot=False)
    response, _ = http_get(h, "/manifest")
    assert response.status == 503 and response.getheader("Retry-After") == "1"
    (root / ".tmp-step-000000005").mkdir()
    assert http_get(h, "/manifest")[0].status == 503
    path = write_sample(root, step=20)
    (path / MARKER).rename(root / "marker")  # uncommitted again
    assert http_get(h, "/manifest")[0].status == 503
    assert http_get(h, "/files/step-000000020/model.safetensors")[0].status == 404
    (root / "marker").rename(path / MARKER)
    assert json.loads(http_get(h, "/manifest")[1])["step"] == 20
    write_sample(root, step=30)
    assert json.loads(http_get(h, "/manifest")[1])["step"] == 30
    assert json.loads(http_get(h, "/manifest?step=20")[1])["step"] == 20
    assert http_get(h, "/manifest?step=25")[0].status == 404
    assert http_get(h, "/manifest?step=x")[0].status == 400


def test_stalled_client_is_dropped(peer):
    _, h = peer(timeout=0.5)
    host, port = h.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /manifest HTTP/1.1\r\n")  # never finishes its headers
        # Dropped after the 0.5 s client timeout: a server that kept it would make recv time out (10 s).
        assert s.recv(100) == b""


def test_a_client_trickling_its_request_is_dropped(peer):
    _, h = peer(timeout=1.0)
    host, port = h.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /manifest HTTP/1.1\r\nX-Slow: ")
        # A byte every 0.2 s (slowloris): each read is well within the 1 s client timeout, but the
        # whole head may take only that long. 30 s is many times the bound.
        deadline, closed = time.monotonic() + 30, False
        while not closed and time.monotonic() < deadline:
            try:
                s.sendall(b"x")
                if select.select([s], [], [], 0.2)[0]:
                    closed = s.recv(100) == b""
            except OSError:
                closed = True
        assert closed, "the server kept a connection whose request head never ended"


def _start_cli(*args: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "zb", "ckpt-serve", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_cli_serves_a_nodes_live_directory_where_joiners_look_and_stops_on_sigterm(tmp_path):
    """The guide's command, `zb ckpt-serve --dir <ram_dir>/live/<node id> --publish ... --node-id <node id>`,
    serves what a training node keeps there (its snapshots are one level down, in r<local rank>: it served
    nothing, 503 forever) and publishes where a joiner's rank 0 looks (it published under ckpt_serve/<node
    id>, a key no joiner reads)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from zb.ckpt.sidecar.live_layout import node_dir, rank_dir, sidecar_id
    from zb.ckpt.sidecar.publish import peer_addresses

    write_sample(rank_dir(tmp_path / "ram", "n1", 0))   # where a node's local rank 0 keeps them (zb.diloco.live)
    store_port = free_port()
    store = TCPStore("127.0.0.1", store_port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    store.set("ckpt_serve/n1/r0", "10.9.9.9:7000")   # the live node's own sidecar, published under the same name
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    proc = _start_cli("--dir", str(node_dir(tmp_path / "ram", "n1")), "--host", "127.0.0.1", "--token-file",
                      str(token_file), "--json", "--publish", f"127.0.0.1:{store_port}", "--node-id", "n1",
                      env=subprocess_env())
    try:
        line = json.loads(proc.stdout.readline())
        assert line["dir"] == str(rank_dir(tmp_path / "ram", "n1", 0).resolve())
        # What a joiner's local rank 0 reads (zb.diloco.live.recover).
        assert peer_addresses(store, [sidecar_id("n1", 0)]) == {"n1/r0": line["address"]}
        result = fetch_snapshot([line["address"]], TOKEN, tmp_path / "dest", progress=False)
        check_fetched(result)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert store.get("ckpt_serve/n1/r0") == b"10.9.9.9:7000", "the node's own sidecar is findable again"
    finally:
        proc.kill()
        proc.wait()


def test_a_live_directory_of_several_ranks_is_refused_and_a_rank_directory_publishes_its_rank(tmp_path, monkeypatch):
    """One sidecar serves one rank's snapshots: a node directory holding r0 and r1 is refused in one line
    naming the way out; --dir .../r1 publishes under <node id>/r1, the key a joiner's rank 1 reads."""
    import zb.ckpt.sidecar.process as process
    from zb.ckpt.sidecar.live_layout import node_dir, rank_dir

    for rank in (0, 1):
        write_sample(rank_dir(tmp_path, "n1", rank))
    proc = subprocess.run([sys.executable, "-m", "zb", "ckpt-serve", "--dir", str(node_dir(tmp_path, "n1"))],
                          env=subprocess_env(ZB_CKPT_TOKEN=TOKEN), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds the live snapshots of 2 local ranks (r0, r1)" in lines[0], proc.stderr
    assert f"--dir {rank_dir(tmp_path, 'n1', 0)} and so on" in lines[0]

    monkeypatch.setenv("ZB_CKPT_TOKEN", TOKEN)

    published = {}
    monkeypatch.setattr(process, "_connect_store", lambda addr, timeout, secret: object())
    monkeypatch.setattr(process, "peer_addresses", lambda store, nodes: {})
    monkeypatch.setattr(process, "publish_address", lambda store, node, address: published.setdefault(node, address))
    sidecar = process.open_sidecar(str(rank_dir(tmp_path, "n1", 1)), "127.0.0.1", 0, None, "127.0.0.1:5000", "n1",
                                   None, 5.0)
    sidecar.server.server_close()
    assert list(published) == ["n1/r1"] and sidecar.server.root == rank_dir(tmp_path, "n1", 1).resolve()


def test_cli_clear_errors(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = subprocess_env(ZB_CKPT_TOKEN=TOKEN)
        for args, code, message in [
            (["--dir", str(tmp_path), "--host", "127.0.0.1", "--port", str(port)], 1, "in use"),
            (["--dir", str(tmp_path / "missing")], 2, "does not exist or is not a directory: a training node with "
                                                       "ckpt.live_recovery keeps its snapshots in <ckpt.ram_dir>/live/"
                                                       "<node id>/r<local rank>"),
            (["--dir", str(tmp_path), "--host", "no-such-host.invalid"], 2, "--host 'no-such-host.invalid' is not"),
            (["--dir", str(tmp_path), "--publish", "no-such-host.invalid:5000", "--node-id", "n",
              "--connect-timeout", "30"], 2, "'no-such-host.invalid' is not"),
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
    proc = subprocess.run([sys.executable, "-m", "zb", "ckpt-serve", "--help"], env=subprocess_env(),
                          capture_output=True, text=True, timeout=60)
    assert "--max-connections" in proc.stdout and "503" in proc.stdout


def test_cli_listens_on_loopback_by_default_and_warns_when_publishing_it_afar(tmp_path, caplog, monkeypatch):
    """Like `zb store` and the dashboard, the sidecar listens on loopback unless told (issue 30, defect 7:
    it listened on 0.0.0.0); a loopback address published to a store elsewhere is warned about."""
    import logging

    from zb.ckpt.sidecar.process import open_sidecar

    proc = subprocess.run([sys.executable, "-m", "zb", "ckpt-serve", "--help"], env=subprocess_env(),
                          capture_output=True, text=True, timeout=60)
    assert "[default: 127.0.0.1]" in proc.stdout
    monkeypatch.setenv("ZB_CKPT_TOKEN", TOKEN)
    import zb.ckpt.sidecar.process as process

    monkeypatch.setattr(process, "_connect_store", lambda addr, timeout, secret: object())   # a store elsewhere, reached
    monkeypatch.setattr(process, "peer_addresses", lambda store, nodes: {})
    monkeypatch.setattr(process, "publish_address", lambda store, node, address: f"ckpt_serve/{node}")
    for host, warned in (("127.0.0.1", True), ("0.0.0.0", False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="zb.ckpt.serve"):
            sidecar = open_sidecar(str(tmp_path), host, 0, None, "10.255.255.1:5000", "n1", None, 5.0)
        sidecar.server.server_close()
        assert ("joiners there cannot reach this sidecar; pass --host 0.0.0.0" in caplog.text) == warned, host


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
        assert http_get(handle, f"/files/{path.name}/big.safetensors")[0].status == 404
    finally:
        handle.close()


def test_a_client_resetting_its_connection_is_not_a_traceback(peer, capfd):
    _, h = peer()
    host, port = h.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # close = RST
    s.sendall(b"GET /manifest HTTP/1.1\r\n")
    s.close()
    time.sleep(0.3)
    assert http_get(h, "/manifest")[0].status == 200
    assert "Traceback" not in capfd.readouterr().err


def test_hostile_numbers_get_an_answer_not_a_traceback(peer, capfd):
    _, h = peer()
    target, long = "/files/step-000000010/model.safetensors", "9" * 10_000
    for spec in (f"bytes=0-{long}", f"bytes={long}-", f"bytes=-{long}"):
        assert http_get(h, target, headers={"Range": spec})[0].status == 416, spec[:20]
    answer = raw_request(h, f"GET {target} HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\nRange: bytes=\u0663-\u0664\r\n"
                            "Connection: close\r\n\r\n".encode())
    assert answer.split(b" ")[1] == b"416", answer[:100]
    for step in ("%D9%A3", "%C2%B2", long):  # Arabic-Indic three, superscript two, 10,000 digits
        assert http_get(h, f"/manifest?step={step}")[0].status == 400, step[:20]
    assert http_get(h, "/manifest")[0].status == 200
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("header, size, expected", [
    (None, 10, None), ("bytes=0-0", 10, (0, 1)), ("bytes=2-", 10, (2, 10)), ("bytes=-3", 10, (7, 10)),
    ("bytes=-30", 10, (0, 10)), ("bytes=5-100", 10, (5, 10)), (" bytes=1-2 ", 10, (1, 3)),
    ("bytes=10-", 10, 416), ("bytes=3-2", 10, 416), ("bytes=-", 10, 416), ("bytes=0-1,2-3", 10, 416),
    ("bytes=0-0", 0, 416), ("bits=0-1", 10, 416),
    # Only ASCII digits, at most 19 of them (int() takes Arabic-Indic digits and chokes past 4300 digits).
    ("bytes=\u0663-\u0664", 10, 416), ("bytes=0-" + "9" * 10_000, 10, 416), ("bytes=" + "9" * 10_000 + "-", 10, 416),
    ("bytes=-" + "9" * 10_000, 10, 416), ("bytes=0-" + "9" * 19, 10, (0, 10)),
])
def test_parse_range(header, size, expected):
    from zb.ckpt.sidecar.http import HttpError, parse_range

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
    from zb.ckpt.sidecar.http import HttpError, route

    if isinstance(expected, int):
        with pytest.raises(HttpError) as e:
            route(target)
        assert e.value.status == expected
    else:
        assert route(target) == expected


def test_advertised_address_and_store_keys():
    from zb.ckpt.sidecar.publish import advertised_address, peer_addresses, publish_address, unpublish_address

    assert advertised_address("10.1.2.3", 7000) == "10.1.2.3:7000"
    assert advertised_address("0.0.0.0", 7000, advertise="node-a.vpn") == "node-a.vpn:7000"
    assert advertised_address("0.0.0.0", 7000, toward="127.0.0.1") == "127.0.0.1:7000"  # route to the store
    assert advertised_address("::1", 7000) == "[::1]:7000"

    class DictStore(dict):
        def set(self, key, value):
            self[key] = value.encode()

        def get(self, key):
            return self[key]

        def check(self, keys):
            return all(k in self for k in keys)

        def delete_key(self, key):
            return self.pop(key, None) is not None

    store = DictStore()
    assert publish_address(store, "n1", "10.0.0.1:7000") == "ckpt_serve/n1"
    assert peer_addresses(store, ["n1", "n2"]) == {"n1": "10.0.0.1:7000"}
    # Taking ours away: the address it replaced comes back; one published since ours stays; else it goes.
    unpublish_address(store, "n1", "10.0.0.1:7000", replaced="10.0.0.2:7000")
    assert peer_addresses(store, ["n1"]) == {"n1": "10.0.0.2:7000"}
    unpublish_address(store, "n1", "10.0.0.1:7000")
    assert peer_addresses(store, ["n1"]) == {"n1": "10.0.0.2:7000"}
    unpublish_address(store, "n1", "10.0.0.2:7000")
    assert peer_addresses(store, ["n1"]) == {}


def test_a_run_secret_gives_the_token_and_the_others_have_no_effect(caplog):
    import logging

    from zb.ckpt.sidecar.token import read_token
    from zb.secret import sidecar_token

    secret = b"0123456789abcdef0123456789abcdef"
    assert read_token(environ={}, secret=secret) == sidecar_token(secret)
    with caplog.at_level(logging.WARNING, logger="zb.ckpt"):
        assert read_token(environ={"ZB_CKPT_TOKEN": "x" * 32}, secret=secret) == sidecar_token(secret)
    assert "ZB_CKPT_TOKEN has no effect" in caplog.text
    assert read_token(environ={"ZB_CKPT_TOKEN": "x" * 32}) == "x" * 32
