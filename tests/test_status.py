"""zb status without a training run: the status record, its publisher, the reader's judgement of each
node's state, the dashboard's HTTP server, the report from metrics files, and the command's refusals.
Nodes are simulated by writing the store keys they write (tests/test_status_live.py runs real ones)."""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from zb.elastic import keys
from zb.elastic.store_state import encode_line
from zb.elastic.tcpstore import host
from zb.elastic.world import World
from zb.errors import EnvironmentFailure, InvalidInput
from zb.status.history import RunHistory
from zb.status.page import render
from zb.status.publisher import StatusPublisher, StatusSink
from zb.status.reader import NoRun, RunReader, read_present
from zb.status.record import HISTORY_POINTS, NodeStatus, decode_history, decode_record, encode
from zb.status.report import build_report
from zb.status.server import Dashboard, listen
from zb.testing.fake_dom import FAKE_DOM
from zb.testing.procs import free_port, wait_until, zb_process

SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture
def store():
    hosted = host("127.0.0.1", 0)
    yield hosted


def _status(uid: str = "a", **kw) -> NodeStatus:
    return NodeStatus(uid, state=kw.pop("state", "joining"), total_steps=kw.pop("total_steps", 100),
                      heartbeat_interval=kw.pop("heartbeat_interval", 0.05),
                      heartbeat_timeout=kw.pop("heartbeat_timeout", 0.5))


def _step(step: int, t: float, loss: float = 2.0, tps: float = 1000.0) -> dict:
    return {"event": "step", "time": t, "step": step, "outer_step": step // 5, "loss": loss, "tokens": step * 128,
            "tokens_per_s": tps, "run_tokens": step * 256}


# -- the record ------------------------------------------------------------------------------------
def test_record_follows_the_events_and_stays_bounded():
    s = _status()
    s.observe({"event": "run_start", "time": 1.0, "host": "h1", "pid": 7, "device": "cpu", "local_world_size": 2})
    assert s.observe({"event": "membership", "time": 1.5, "mesh_version": 1, "global_world_size": 2, "leader": "b",
                      "joined": [], "left": [], "died": [], "global_rank": 1}), "a membership change publishes at once"
    for i in range(1, 3 * HISTORY_POINTS):
        assert not s.observe(_step(i, 2.0 + i * 0.5)), "a step waits for the next interval"
    assert s.observe({"event": "outer_step", "time": 900.0, "outer_step": 3, "step": 15, "mesh_version": 1,
                      "global_world_size": 2, "num_peers": 2, "allreduce_s": 0.25, "wire_bytes": 10, "wire_mbps": 3.2})
    last = 3 * HISTORY_POINTS
    s.observe({"event": "step", "time": 2.0 + last * 0.5, "step": last, "loss": float("nan")})
    record, history, version = s.snapshot()
    assert record["host"] == "h1" and record["device"] == "cpu" and record["local_world_size"] == 2
    assert record["state"] == "training" and record["leader"] == "b" and record["global_rank"] == 1
    assert record["allreduce_s"] == 0.25 and record["wire_mbps"] == 3.2 and record["step"] == 3 * HISTORY_POINTS
    assert record["steps_per_s"] == pytest.approx(2.0, rel=0.01)
    assert len(history["steps"]) == HISTORY_POINTS and version > 0
    raw = encode(record)
    assert len(raw) < 1024, "the record the table reads stays small"
    back = decode_record(raw)
    assert back["uid"] == "a" and back["loss"] == 2.0, "a NaN loss is not a value: the last finite one stays"
    hist = decode_history(encode(history))
    assert hist["steps"][-1][1] == 3 * HISTORY_POINTS and hist["steps"][-1][2] is None and len(hist["membership"]) == 1
    s.observe(_step(40, 1000.0))           # a joiner took over the run's position: no negative rate
    s.observe(_step(41, 1001.0))
    assert s.snapshot()[0]["steps_per_s"] == 1.0


def test_a_joiner_is_joining_until_its_outer_step():
    s = _status("j")
    s.observe({"event": "membership", "time": 1, "mesh_version": 2, "global_world_size": 3, "leader": "a",
               "joined": ["j"], "left": [], "died": [], "global_rank": 2})
    assert s.snapshot()[0]["state"] == "joining"
    s.observe({"event": "outer_step", "time": 2, "outer_step": 4, "step": 20, "mesh_version": 2,
               "global_world_size": 3, "num_peers": 2, "allreduce_s": 0.1, "wire_bytes": 1, "wire_mbps": 1.0})
    assert s.snapshot()[0]["state"] == "training"
    live = _status("r", state="recovering")
    live.observe({"event": "recovery", "time": 1, "outer_step": 3, "peers": ["a"], "bytes": 1, "seconds": 0.1})
    assert live.snapshot()[0]["state"] == "joining"


def test_record_carries_the_compression_and_the_bytes_of_the_last_sync():
    from zb.cli.status import status_table

    s = _status()
    s.observe({"event": "run_start", "time": 1.0, "host": "h1", "pid": 7, "device": "cpu", "local_world_size": 1,
               "settings": {"diloco.compression": "int4", "diloco.inner_steps": 5}})
    assert s.snapshot()[0]["compression"] == "int4" and "wire_bytes" not in s.snapshot()[0], "no sync yet"
    for outer, sent in ((1, 9_000_000), (2, 1_234_567)):
        s.observe({"event": "outer_step", "time": 2.0 + outer, "outer_step": outer, "step": 5 * outer,
                   "mesh_version": 1, "global_world_size": 2, "num_peers": 2, "allreduce_s": 0.5,
                   "wire_bytes": sent, "wire_mbps": 19.8})
    back = decode_record(encode(s.snapshot()[0]))
    assert back["compression"] == "int4" and back["wire_bytes"] == 1_234_567, "the last outer step's bytes"
    row = {"uid": "a", "state": "training", **back}
    assert _table_text({"source": "test", "run": {}, "nodes": [row]}, status_table)["a"][-1] == "int4 1.2 MB"
    # diloco.compression is in the settings only when not at its default: DiLoCo then runs uncompressed.
    for settings in ({}, {"diloco.inner_steps": 5}, {"diloco.compression": "none"}):
        plain = _status()
        plain.observe({"event": "run_start", "time": 1.0, "host": "h", "pid": 1, "device": "cpu",
                       "local_world_size": 1, "settings": settings})
        assert plain.snapshot()[0]["compression"] == "none", settings
    unknown = _status()
    unknown.observe({"event": "run_start", "time": 1.0, "host": "h", "pid": 1, "device": "cpu", "local_world_size": 1})
    assert "compression" not in unknown.snapshot()[0], "no settings: not known, not guessed"


def _table_text(doc: dict, status_table) -> dict[str, list[str]]:
    """The rendered `zb status` table: {header or uid: the row's cells}."""
    import io

    from rich.console import Console

    console = Console(file=io.StringIO(), width=250, color_system=None)
    console.print(status_table(doc))
    lines = [line for line in console.file.getvalue().splitlines() if line.startswith(("┃", "│"))]
    rows = [[cell.strip() for cell in line.strip("┃│").split("┃" if line.startswith("┃") else "│")] for line in lines]
    return {"header" if i == 0 else row[0]: row for i, row in enumerate(rows)}


@pytest.mark.parametrize("raw", [b"", b"x" * 70000, b"[1,2]", b"not json", b'{"format": 99, "uid": "a"}',
                                 b'{"format": 1}', b'{"format": 1, "uid": 5}'])
def test_what_is_not_a_record_is_refused(raw):
    assert decode_record(raw) is None


def test_peer_values_are_kept_to_their_shape():
    rec = decode_record(b'{"format": 1, "uid": "a", "state": "rm -rf", "step": "7", "loss": NaN, "host": "' +
                        b"h" * 500 + b'", "pid": true, "compression": 4, "wire_bytes": "1 MB", "extra": [1]}')
    assert rec == {"format": 1, "uid": "a", "state": "training", "host": "h" * 200}
    hist = decode_history(b'{"uid": "a", "steps": [[1, 2, 3, 4], [1, "x", 3, 4], [1, 2]], "membership": [{"x": 1}]}')
    assert hist["steps"] == [[1, 2, 3, 4]] and hist["membership"] == []


# -- the publisher -------------------------------------------------------------------------------
class _Inner:
    def __init__(self):
        self.events, self.closed, self.path = [], False, None

    def log(self, event, **fields):
        self.events.append(event)
        return {"event": event, **fields}

    def close(self):
        self.closed = True


def _connect_to(store_obj):
    from zb.elastic.keys import is_counter
    from zb.store_clients import run_client

    return lambda: run_client("127.0.0.1", store_obj.port, 30.0, 30.0, counters=is_counter)


def test_publisher_writes_the_record_and_says_goodbye(store):
    inner = _Inner()
    publisher = StatusPublisher(_status("n1"), _connect_to(store), interval=30.0)
    publisher.start()
    sink = StatusSink(inner, publisher)
    sink.log("run_start", host="h", pid=1, local_world_size=1, device="cpu")
    wait_until(lambda: store.check([keys.status("n1")]), 10, "the first record (published at once on run_start)")
    sink.log("step", **{k: v for k, v in _step(1, time.time()).items() if k not in ("event", "time")})
    sink.log("outer_step", outer_step=1, step=5, mesh_version=1, global_world_size=1, num_peers=1, allreduce_s=0.1,
             wire_bytes=5, wire_mbps=1.0)
    wait_until(lambda: decode_record(store.get(keys.status("n1"))).get("outer_step") == 1, 10,
               "the record after an outer step (published at once, not after the 30 s interval)")
    assert decode_history(store.get(keys.status_history("n1")))["outer"][0][1] == 1
    assert sink.path is None and inner.events == ["run_start", "step", "outer_step"]
    sink.close()
    assert inner.closed and not publisher.is_alive()
    assert decode_record(store.get(keys.status("n1")))["state"] == "left"
    assert store.get(keys.STATUS_INDEX) == b"n1\n"


def test_a_node_that_fails_before_its_run_owns_the_sink_still_says_goodbye(store):
    import subprocess
    import sys

    from zb.testing.procs import REPO, subprocess_env

    code = f"""
from zb.config import load_config
from zb.metrics import MetricsSink
from zb.status.publisher import publish_status
cfg = load_config(flags={{"diloco.inner_steps": 5, "elastic.addr": "127.0.0.1", "elastic.port": {store.port},
                          "elastic.unique_id": "early"}}, environ={{}})
sink = publish_status(MetricsSink(None, "early"), cfg, is_head=True)
raise SystemExit("failed while building the model")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=subprocess_env(), cwd=REPO)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert decode_record(store.get(keys.status("early")))["state"] == "left"


def test_a_store_that_never_answers_never_blocks_the_loop():
    """The store accepts connections and never replies (torch's client then waits without end): logging
    goes on, and closing the sink is bounded."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    from zb.elastic.keys import is_counter
    from zb.store_clients import run_client

    inner = _Inner()
    publisher = StatusPublisher(_status("n2"),
                                lambda: run_client("127.0.0.1", silent.getsockname()[1], 0.5, 0.5, counters=is_counter),
                                interval=0.05)
    publisher.start()
    sink = StatusSink(inner, publisher)
    for i in range(200):
        sink.log("outer_step", outer_step=i, step=i, mesh_version=1, global_world_size=1, num_peers=1,
                 allreduce_s=0.1, wire_bytes=1, wire_mbps=1.0)
    assert len(inner.events) == 200
    sink.close()
    assert inner.closed and publisher.published == 0
    silent.close()


def test_an_address_that_does_not_resolve_ends_no_thread_with_a_traceback(monkeypatch):
    """An unresolvable elastic.addr: the node itself fails with one clean line; the status thread only
    notes it (before the fix it died with a traceback printed ahead of that line, issue 30 defect 5)."""
    import threading

    from zb.elastic.keys import is_counter
    from zb.store_clients import run_client

    escaped = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))
    publisher = StatusPublisher(_status("n4"),
                                lambda: run_client("no-such-host.invalid", 29600, 0.5, 0.5, counters=is_counter),
                                interval=0.05)
    publisher.start()
    wait_until(lambda: publisher._outage_since is not None, 30, "the failed publication")
    assert publisher.is_alive() and escaped == []
    publisher.close()


def test_an_unreachable_store_is_logged_once_and_retried(caplog, store):
    from zb.elastic.keys import is_counter
    from zb.store_clients import run_client

    port = [store.port]
    publisher = StatusPublisher(_status("n3"), lambda: run_client("127.0.0.1", port[0], 0.1, 1.0, counters=is_counter),
                                interval=0.05)
    caplog.set_level(logging.INFO, logger="zb.status")
    publisher.start()
    wait_until(lambda: store.check([keys.status("n3")]), 30, "the first record")
    port[0] = free_port()                # the store went away (a new client fails at once, as after a restart)
    publisher._store = None
    wait_until(lambda: "could not publish" in caplog.text, 30, "the failure logged")
    time.sleep(0.3)
    port[0] = store.port                 # the store is back
    store.delete_key(keys.status("n3"))
    wait_until(lambda: store.check([keys.status("n3")]), 30, "a record once the store answers")
    publisher.close()
    mine = [r for r in caplog.records if r.thread == publisher.ident]
    failures = [r for r in mine if "could not publish" in r.getMessage()]
    assert len(failures) == 1 and failures[0].levelno == logging.WARNING, "one warning per outage, not per attempt"
    assert any("publishing to the store again" in r.getMessage() for r in mine)


# -- the reader ----------------------------------------------------------------------------------
def _node(store, uid: str, /, **fields) -> None:
    rec = {"format": 1, "uid": uid, "state": "training", "host": "h-" + uid, "device": "cpu", "local_world_size": 1,
           "heartbeat_interval": 0.05, "heartbeat_timeout": 0.6, "total_steps": 100, "time": time.time(), **fields}
    store.append(keys.STATUS_INDEX, uid + "\n")
    store.set(keys.status(uid), encode(rec))


def _beat(store, *uids: str) -> None:
    for uid in uids:
        store.add(keys.heartbeat(uid), 1)


def _world(store, nodes, **kw) -> World:
    world = World(version=kw.pop("version", 3), resolution=5, nodes=list(nodes), tokens={u: "t-" + u for u in nodes}, **kw)
    store.set(keys.WORLD, world.encode())
    return world


def test_reader_judges_every_state(store):
    _world(store, ["lead", "b", "bye", "quiet"], died=["gone"], joined=["b"])
    _node(store, "lead", step=50, outer_step=10, tokens_per_s=1000.0, steps_per_s=2.0, loss=2.5)
    _node(store, "b", state="joining", step=0, tokens_per_s=None)
    _node(store, "bye", step=50, tokens_per_s=900.0)
    _node(store, "quiet", step=50, tokens_per_s=800.0, heartbeat_interval=0.05)
    _node(store, "gone", step=20)
    _node(store, "done", state="left", step=100)
    _node(store, "fetching", state="recovering", step=0)
    store.append(keys.JOINS, encode_line({"uid": "new", "token": "x"}))
    store.append(keys.GONE, "bye t-bye\n")
    reader = RunReader(store, "test")
    _beat(store, "lead", "b", "bye", "quiet", "new", "fetching")
    doc = reader.read()
    time.sleep(0.2)                      # more than two of quiet's heartbeat intervals
    _beat(store, "lead", "b", "bye", "new", "fetching")
    doc = reader.read()
    states = {n["uid"]: n["state"] for n in doc["nodes"]}
    assert states == {"lead": "training", "b": "joining", "bye": "leaving", "quiet": "silent", "gone": "dead",
                      "done": "left", "fetching": "recovering", "new": "joining"}
    assert [n["uid"] for n in doc["nodes"]][:4] == ["lead", "b", "bye", "quiet"], "members first, in rank order"
    ranks = {n["uid"]: n["global_rank"] for n in doc["nodes"]}
    assert ranks["lead"] == 0 and ranks["quiet"] == 3 and ranks["new"] is None
    lead = doc["nodes"][0]
    assert lead["heartbeat_age_s"] is not None and lead["heartbeat_age_s"] < lead["heartbeat_watched_s"]
    run = doc["run"]
    assert run["mesh_version"] == 3 and run["leader"] == "lead" and run["world_size"] == 4
    assert run["tokens_per_s"] == 1000.0, "run tokens/s counts nodes that are training"
    assert run["eta_s"] == pytest.approx((100 - 50) / 2.0)
    time.sleep(0.7)                      # past quiet's heartbeat timeout
    _beat(store, "lead")
    assert {n["uid"]: n["state"] for n in reader.read()["nodes"]}["quiet"] == "dead"


def test_one_shot_sampling_sees_the_counters_move(store):
    _world(store, ["a"])
    _node(store, "a", step=1)
    _beat(store, "a")
    stop = threading.Event()

    def beat():
        while not stop.wait(0.05):
            _beat(store, "a")

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        reader = RunReader(store, "test")
        assert reader.read()["nodes"][0]["heartbeat_age_s"] is None, "one look cannot know an age"
        reader.sample(["a"], window=5.0)
        assert reader.read()["nodes"][0]["heartbeat_age_s"] is not None
    finally:
        stop.set()
        thread.join()


def test_read_present_finds_missing_keys_without_blocking(store):
    store.set("k1", "1")
    store.set("k3", "3")
    assert read_present(store, ["k1", "k2", "k3", "k4"]) == [b"1", b"", b"3", b""]
    assert read_present(store, []) == []


def test_no_run_and_foreign_stores_are_one_line(store):
    with pytest.raises(NoRun, match="no run on the store at test yet"):
        RunReader(store, "test").read()
    store.set("torchelastic/rdzv", "x")
    with pytest.raises(NoRun, match=r"holds 1 key\(s\) but no zb run"):
        RunReader(store, "test").read()
    store.set(keys.WORLD, b'{"who": "someone else"}')
    with pytest.raises(NoRun, match="not a zb world record"):
        RunReader(store, "test").read()


def test_a_store_made_for_a_run_with_a_secret_is_one_no_node_joined_yet(store):
    """Issue 37: `zb store --new-secret`'s marker alone read as 'another program's store?'."""
    from zb.signed_store import declare, for_reading

    declare(store, SECRET, "test")
    for secret in (SECRET, b"another secret of enough length!"):
        reader = RunReader(for_reading(store, SECRET, "test", keys.is_counter), "test", secret=secret)
        with pytest.raises(NoRun, match="no run on the store at test yet: no node has joined it"):
            reader.read()


def test_a_secret_the_run_does_not_hold_is_said_and_nothing_is_written(store):
    """Issue 37: a reader with a secret never writes the run marker; it shows the run, saying the secret has no
    effect, until nodes holding it mark the run (a dashboard started before them), then opens their records."""
    from zb.signed_store import MARKER, authenticated, for_reading

    _world(store, ["a"])
    _node(store, "a", step=7)
    reader = RunReader(for_reading(store, SECRET, "test", keys.is_counter), "test", secret=SECRET)
    doc = reader.read()
    assert doc["nodes"][0]["step"] == 7 and "holds no secret" in doc["warning"] and not store.check([MARKER])
    assert RunReader(store, "test").read()["warning"] is None
    fresh = host("127.0.0.1", 0)
    later = RunReader(for_reading(fresh, SECRET, "test", keys.is_counter), "test", secret=SECRET)
    sealed = authenticated(fresh, SECRET, "test", keys.is_counter)   # a node holding the secret starts
    _world(sealed, ["b"])
    _node(sealed, "b", step=3)
    doc = later.read()
    assert doc["nodes"][0]["step"] == 3 and doc["warning"] is None


def test_starting_nodes_show_before_any_world(store):
    _node(store, "early", state="joining")
    _beat(store, "early")
    doc = RunReader(store, "test").read()
    assert doc["nodes"][0]["state"] == "joining" and doc["run"]["mesh_version"] is None


def test_the_table_shows_each_nodes_compression_and_bytes_per_sync(store):
    from zb.cli.status import status_table

    _world(store, ["q", "f", "new"])
    _node(store, "q", compression="int4", wire_bytes=1_234_567, wire_mbps=8.0)
    _node(store, "f", compression="none", wire_bytes=987)
    _node(store, "new", compression="int2")          # no outer step yet
    _node(store, "old")                              # a record of a zb that did not publish the compression
    _beat(store, "q", "f", "new", "old")
    doc = RunReader(store, "test").read()
    nodes = {n["uid"]: n for n in doc["nodes"]}
    assert nodes["q"]["compression"] == "int4" and nodes["q"]["wire_bytes"] == 1_234_567, "raw fields in --json"
    assert nodes["old"]["compression"] is None and nodes["old"]["wire_bytes"] is None
    table = _table_text(doc, status_table)
    assert table["header"][-2:] == ["Mbit/s", "sync"]
    assert {uid: table[uid][-1] for uid in nodes} == {"q": "int4 1.2 MB", "f": "none 987 B", "new": "int2 —",
                                                       "old": "—"}
    from zb.cli.status import _bytes

    assert [_bytes(n) for n in (0, 999, 1000, 999_950, 45_600_000, 7_890_000_000)] == \
        ["0 B", "999 B", "1.0 kB", "1.0 MB", "45.6 MB", "7.9 GB"]


# -- the dashboard --------------------------------------------------------------------------------
def _get(url: str) -> tuple[int, bytes, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def test_dashboard_serves_the_page_and_the_document(store):
    _world(store, ["a", "b"])
    for uid in ("a", "b"):
        _node(store, uid, step=10)
        store.set(keys.status_history(uid), encode({"uid": uid, "steps": [[1.0, 1, 3.0, 10.0], [2.0, 2, 2.5, 11.0]],
                                                    "outer": [], "eval": [], "membership": []}))
    _beat(store, "a", "b")
    board = Dashboard(listen("127.0.0.1", 0), lambda: RunReader(store, "test"), 0.2, "test").start()
    try:
        status, body, headers = _get(board.url)
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        page = body.decode()
        # Nothing fetched from elsewhere (the SVG namespace is a name, never fetched): it works offline.
        assert "<script src" not in page and "http" not in page.replace('"http://www.w3.org/2000/svg"', "")
        assert "connect-src 'self'" in headers["Content-Security-Policy"]
        status, body, _ = _get(board.url + "api/status")
        doc = json.loads(body)
        assert status == 200 and [n["uid"] for n in doc["nodes"]] == ["a", "b"]
        assert doc["history"]["a"]["steps"][1] == [2.0, 2, 2.5, 11.0]
        assert doc["membership"][0]["mesh_version"] == 3, "the world the dashboard saw is on the timeline"
        assert _get(board.url + "etc/passwd")[0] == 404
        request = urllib.request.Request(board.url + "api/status", data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=10)
        assert e.value.code == 501, "read-only"
    finally:
        board.close()




def test_dashboard_table_shows_the_sync_column_as_the_cli_does(tmp_path):
    import shutil
    import subprocess

    from zb.cli.status import _sync

    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("no node.js to run the page's script")
    html = render()
    script = html.split("<!--ZB_DATA-->")[1].split("<script>")[1].split("</script>")[0]
    show = 'console.log(JSON.stringify(byId["nodes"].children[0].children.map(r => r.children.map(c => c.textContent))));'
    (tmp_path / "page.js").write_text(FAKE_DOM + script + show)
    sent = {"q": ("int4", 1_234_567), "f": ("none", 987), "new": ("int2", None), "old": (None, None),
            "big": ("int8", 7_890_000_000), "edge": ("none", 999_950), "zero": ("int2", 0)}
    nodes = [{"uid": uid, "state": "training", "compression": c, "wire_bytes": b} for uid, (c, b) in sent.items()]
    doc = {"source": "test", "time": 1.0, "run": {}, "nodes": nodes, "report": True}
    out = subprocess.run([node, str(tmp_path / "page.js"), json.dumps(doc)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    header, *rows = json.loads(out.stdout)
    assert header[-2:] == ["Mbit/s", "sync"] and all(len(r) == len(header) for r in rows)
    shown = {r[0]: r[-1] for r in rows}
    assert shown == {n["uid"]: _sync(n) for n in nodes}, "the dashboard writes what `zb status` writes"
    assert shown["q"] == "int4 1.2 MB" and shown["big"] == "int8 7.9 GB" and shown["old"] == "—"


def test_dashboard_says_where_and_when_a_sealed_run_finished(tmp_path):
    import shutil
    import subprocess

    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("no node.js to run the page's script")
    script = render().split("<!--ZB_DATA-->")[1].split("<script>")[1].split("</script>")[0]
    show = 'console.log(JSON.stringify(byId["summary"].children.map(c => c.textContent)));'
    (tmp_path / "page.js").write_text(FAKE_DOM + script + show)
    end = {"mesh_version": 4, "outer_step": 12, "step": 1200, "time": 1_700_000_000.0, "line": "finished at ..."}
    for run, finished in (({}, False), ({"finished": end}, True)):
        doc = {"source": "test", "time": 1.0, "run": run, "nodes": []}
        out = subprocess.run([node, str(tmp_path / "page.js"), json.dumps(doc)], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        parts = [p for p in json.loads(out.stdout) if p.strip()]
        said = [p for p in parts if p.startswith("finished at ")]
        assert len(said) == finished and all(p.startswith("finished at outer step 12 (step 1,200) at ") for p in said)


def test_dashboard_shows_an_unreachable_store_and_keeps_the_last_data(store):
    _world(store, ["a"])
    _node(store, "a", step=3)
    readers = [RunReader(store, "test")]

    def open_reader():
        if not readers:
            raise EnvironmentFailure("store gone")
        return readers.pop()

    board = Dashboard(listen("127.0.0.1", 0), open_reader, 30.0, "test")
    board.sample()
    assert board.document()["nodes"][0]["uid"] == "a"
    board._reader = None
    board.sample()
    doc = board.document()
    assert "unreachable" in doc["error"] and doc["nodes"][0]["uid"] == "a"


def test_a_port_in_use_is_one_line():
    taken = listen("127.0.0.1", 0)
    with pytest.raises(EnvironmentFailure, match=f"--http-port {taken.getsockname()[1]}: port already in use"):
        listen("127.0.0.1", taken.getsockname()[1])
    taken.close()


def test_history_stays_bounded_and_keeps_the_whole_run():
    history = RunHistory(points=100)
    for batch in range(20):
        steps = [[float(i), i, 1.0, 1.0] for i in range(batch * 50, batch * 50 + 50)]
        doc = history.merge({"time": 0, "run": {}, "history": {"a": {"steps": steps, "outer": [], "eval": [],
                                                                      "membership": []}}})
    kept = doc["history"]["a"]["steps"]
    assert len(kept) <= 101 and kept[0][1] == 0 and kept[-1][1] == 999, "the newest point is always drawn"
    gaps = [b[1] - a[1] for a, b in zip(kept, kept[1:-1])]
    assert max(gaps) <= 4 * min(gaps), f"the run is drawn evenly, not only its end: {gaps}"


# -- the report ----------------------------------------------------------------------------------
def _write_metrics(path, uid: str, steps: int) -> None:
    path.mkdir(parents=True)
    lines = [{"event": "run_start", "time": 100.0, "node": uid, "host": "h", "pid": 1, "local_world_size": 1,
              "device": "cpu", "settings": {}},
             {"event": "membership", "time": 100.5, "node": uid, "mesh_version": 1, "global_world_size": 2,
              "leader": "a", "joined": [], "left": [], "died": [], "global_rank": 0 if uid == "a" else 1}]
    lines += [{**_step(i, 101.0 + i), "node": uid} for i in range(1, steps + 1)]
    lines += [{"event": "outer_step", "time": 120.0, "node": uid, "outer_step": 1, "step": 5, "mesh_version": 1,
               "global_world_size": 2, "num_peers": 2, "allreduce_s": 0.5, "wire_bytes": 9, "wire_mbps": 7.0}]
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + '\n{"event": "step", "ti')


def test_report_from_metrics_files(tmp_path):
    _write_metrics(tmp_path / "a", "a", 6)
    _write_metrics(tmp_path / "b", "b", 4)
    doc = build_report([str(tmp_path)])
    assert [n["uid"] for n in doc["nodes"]] == ["a", "b"] and doc["skipped_lines"] == 2
    assert len(doc["history"]["a"]["steps"]) == 6 and doc["history"]["b"]["outer"][0][3] == 7.0
    assert doc["membership"][0]["leader"] == "a" and doc["nodes"][0]["outer_step"] == 1
    assert doc["nodes"][0]["compression"] == "none" and doc["nodes"][0]["wire_bytes"] == 9   # the "sync" column
    html = render(doc)
    assert 'id="zb-data"' in html and "zb run report" in html


def test_a_long_run_makes_a_light_report(tmp_path):
    _write_metrics(tmp_path / "a", "a", 5000)
    steps = build_report([str(tmp_path)])["history"]["a"]["steps"]
    assert len(steps) <= 2001 and steps[0][1] == 1 and steps[-1][1] == 5000


def test_report_data_cannot_close_its_script_element():
    html = render({"nodes": [{"uid": "</script><script>alert(1)</script>"}], "run": {}, "history": {}})
    data = html.split('<script id="zb-data" type="application/json">', 1)[1].split("</script>", 1)[0]
    assert json.loads(data)["nodes"][0]["uid"].startswith("</script>")


def test_report_refusals(tmp_path):
    with pytest.raises(InvalidInput, match="no such file"):
        build_report([str(tmp_path / "nope")])
    with pytest.raises(InvalidInput, match="no metrics.jsonl there"):
        build_report([str(tmp_path)])
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "metrics.jsonl").write_text('{"event": "run_start", "time": 1}\n')
    with pytest.raises(InvalidInput, match="no step events"):
        build_report([str(tmp_path)])


# -- the command ---------------------------------------------------------------------------------
@pytest.mark.parametrize("args, code, message", [
    (["--store", "nohostport"], 2, "expected HOST:PORT"),
    ([], 2, "no store given"),
    (["--store", "127.0.0.1:PORT", "--timeout", "0.5"], 1, "unreachable after 0.5 s"),
    (["--http-port", "8600", "--store", "127.0.0.1:1"], 2, "--http-port goes with --serve"),
    (["--from", "x", "--watch"], 2, "--from reads metrics files; --watch"),
    (["--out", "x.html", "--store", "127.0.0.1:1"], 2, "--out and --force go with --from"),
    (["--watch", "--serve", "--store", "127.0.0.1:1"], 2, "give one"),
    (["--from", "/nonexistent/logs"], 2, "no such file or directory"),
    (["--from", "tests", "--out", "/nonexistent/r.html"], 2, "directory /nonexistent does not exist"),
    (["--store", "127.0.0.1:1", "--bind", "0.0.0.0"], 2, "--bind goes with --serve"),
    (["--store", "127.0.0.1:1", "--interval", "5"], 2, "--interval goes with --watch or --serve"),
    (["--from", "tests", "--timeout", "5"], 2, "--timeout has no effect with --from"),
    (["--from", "tests", "--json", "--out", "r.html"], 2, "--out and --force have no effect with --json"),
    (["--store", "127.0.0.1:PORT,,127.0.0.1:1"], 2, "has an empty entry"),
    (["--store", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:1"], 2, "names the store 127.0.0.1:1 twice"),
    (["--store", "127.0.0.1:1,nohostport"], 2, "--store 'nohostport': expected HOST:PORT"),
    (["--store", "127.0.0.1:PORT,127.0.0.1:PORT2", "--timeout", "0.5"], 1, "unreachable after 0.5 s"),
])
def test_bad_invocations_are_one_line(args, code, message):
    args = [a.replace("PORT2", str(free_port())).replace("PORT", str(free_port())) for a in args]
    proc = zb_process("status", *args, timeout=60)
    assert proc.returncode == code, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr


def test_status_of_an_empty_store_and_a_port_in_use(store, tmp_path):
    proc = zb_process("status", "--store", f"127.0.0.1:{store.port}", timeout=60)
    assert proc.returncode == 1 and "no run on the store" in proc.stderr and "Traceback" not in proc.stderr
    taken = listen("127.0.0.1", 0)
    proc = zb_process("status", "--serve", "--http-port", str(taken.getsockname()[1]), "--store",
                      f"127.0.0.1:{store.port}", timeout=60)
    taken.close()
    assert proc.returncode == 1 and "port already in use" in proc.stderr, proc.stderr
    proc = zb_process("store", "--port", str(free_port()), "--http-port", str(store.port), timeout=60)
    assert proc.returncode == 1 and "port already in use" in proc.stderr, proc.stderr


def test_something_that_is_not_a_store_is_one_line():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    stop = threading.Event()

    def answer():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.recv(64)
            conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
            conn.close()

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        proc = zb_process("status", "--store", f"127.0.0.1:{server.getsockname()[1]}", "--timeout", "2", timeout=90)
    finally:
        stop.set()
        thread.join()
        server.close()
    assert proc.returncode == 1 and "does not answer as a TCPStore" in proc.stderr, proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr


def test_zb_store_serves_the_dashboard_on_its_own_address():
    import subprocess
    import sys

    from zb.testing.procs import REPO, subprocess_env

    proc = subprocess.Popen([sys.executable, "-m", "zb", "store", "--port", str(free_port()), "--http-port", "0",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                            cwd=REPO)
    try:
        info = json.loads(proc.stdout.readline())
        assert info["dashboard"].startswith("http://127.0.0.1:"), info
        status, body, _ = _get(info["dashboard"] + "api/status")
        assert status == 200 and "no run on the store" in json.loads(body)["error"]
        assert _get(info["dashboard"])[0] == 200
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "dashboard (read-only): http://127.0.0.1:" in err, err


def _plain_world(nodes, **kw):
    from types import SimpleNamespace

    return SimpleNamespace(nodes=nodes, tokens={}, died=kw.get("died", []), joined=kw.get("joined", []),
                           leader=nodes[0] if nodes else None, version=kw.get("version", 3))


def test_a_node_out_of_the_world_that_does_not_beat_is_dead_not_joining():
    """Issue 30, defect 4: a SIGKILLed node of an earlier world showed as `joining` for ever."""
    from zb.status.reader import _state

    world = _plain_world(["a", "b"])
    rec = {"state": "training", "heartbeat_interval": 1.0, "heartbeat_timeout": 10.0}
    assert _state("c", rec, world, set(), [], None, 2.5) == "dead"              # no beat in 2.5 s of watching
    assert _state("c", dict(rec, state="joining"), world, set(), [], 0.3, 2.5) == "joining"   # starting: it beats
    assert _state("c", dict(rec, state="joining"), world, set(), ["c"], None, 2.5) == "joining"  # queued to join
    assert _state("c", rec, world, set(), [], None, 1.0) == "joining"           # watched too briefly to tell


def test_a_finished_run_takes_its_step_from_its_members_and_has_no_eta():
    """The run's step and ETA came from the dead node ("step 20/140 ... ETA 1m 06s" for a finished run)."""
    from zb.status.reader import _run

    def node(uid, state, step):
        return {"uid": uid, "state": state, "step": step, "outer_step": step // 10, "total_steps": 140,
                "steps_per_s": 2.0, "tokens_per_s": 100.0}

    nodes = [node("a", "left", 140), node("b", "left", 140), node("c", "dead", 20)]
    run = _run(_plain_world([]), nodes, {})
    assert run["step"] == 140 and run["eta_s"] is None
    live = [node("a", "training", 100), node("c", "dead", 20)]
    run = _run(_plain_world(["a"]), live, {})
    assert run["step"] == 100 and run["eta_s"] == 20.0


def test_a_refused_node_publishes_refused_with_its_reason_not_left():
    from zb.status.reader import _state
    from zb.status.record import NodeStatus

    status = NodeStatus("odd", state="joining", total_steps=10, heartbeat_interval=1.0, heartbeat_timeout=5.0)
    status.observe({"event": "refused", "reason": "model.n_layers differs from the run's"})
    status.end()
    record, _, _ = status.snapshot()
    assert record["state"] == "refused" and "model.n_layers" in record["reason"]
    assert _state("odd", record, _plain_world(["a"]), set(), [], None, 30.0) == "refused"
    plain = NodeStatus("n", state="training", total_steps=10, heartbeat_interval=1.0, heartbeat_timeout=5.0)
    plain.end()
    assert plain.snapshot()[0]["state"] == "left"


# -- several stores (elastic.addr's failover list) ----------------------------------------------------
def _failed_over_run(second) -> str:
    """A run that moved to `second`: its world and records are there (each node moved once); its address."""
    where = f"127.0.0.1:{second.port}"
    _world(second, ["a", "b"])
    _node(second, "a", step=20, store=where, failovers=1)
    _node(second, "b", step=20, store=where, failovers=1)
    _node(second, "late", state="left", store=where, failovers=0)
    _beat(second, "a", "b", "late")
    return where


def test_status_reads_the_store_the_run_failed_over_to(store):
    first = host("127.0.0.1", 0)              # answers, holds no run (it came back empty, say)
    b = _failed_over_run(store)
    a = f"127.0.0.1:{first.port}"
    proc = zb_process("status", "--store", f"{a},{b}", "--json", timeout=90)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["source"] == b and doc["stores"]["current"] == b and doc["stores"]["failovers"] == 1
    assert doc["stores"]["list"] == [{"address": a, "answers": True, "holds_run": False, "current": False},
                                     {"address": b, "answers": True, "holds_run": True, "current": True}]
    nodes = {n["uid"]: n for n in doc["nodes"]}
    assert nodes["a"]["store"] == b and nodes["a"]["failovers"] == 1 and nodes["late"]["failovers"] == 0


def test_a_store_of_the_list_that_does_not_answer_is_listed_not_fatal(store):
    b = _failed_over_run(store)
    silent = f"127.0.0.1:{free_port()}"      # nothing listens there
    proc = zb_process("status", "--store", f"{silent},{b}", "--timeout", "5", timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert f"store {b} (current; 1 failover so far; {silent} does not answer)" in proc.stdout
    assert proc.stdout.count("store 127.0.0.1") == 1 and f"run on {b}: mesh v3, 2 node(s)" in proc.stdout


def test_open_reader_picks_as_a_starting_node_does(store):
    from zb.addresses import StoreAddress
    from zb.status.reader import open_reader

    first = host("127.0.0.1", 0)
    a, b = StoreAddress("127.0.0.1", first.port), StoreAddress("127.0.0.1", store.port)
    silent = StoreAddress("127.0.0.1", free_port())
    reader = open_reader([a, b], 5.0)
    assert reader.where == str(a), "no world anywhere: the first that answers"
    assert [s["holds_run"] for s in reader.stores] == [False, False] and reader.several
    _world(first, ["x"])
    _world(store, ["a"])
    assert open_reader([a, b], 5.0).where == str(b), "the latest holding a world: the run moved there"
    assert open_reader([b, a], 5.0).where == str(a), "order is the list's, not the ports'"
    started = time.monotonic()
    reader = open_reader([silent, b], 5.0)
    assert reader.where == str(b) and time.monotonic() - started < 4, "a refused port does not answer, at once"
    assert [s["answers"] for s in reader.stores] == [False, True]
    with pytest.raises(EnvironmentFailure, match="unreachable after 0.5 s"):
        open_reader([silent, StoreAddress("127.0.0.1", free_port())], 0.5)
    single = open_reader([b], 5.0)
    assert not single.several and single.read()["stores"] == {
        "current": str(b), "failovers": 0, "list": [{"address": str(b), "answers": True, "holds_run": True,
                                                      "current": True}]}


def test_a_dashboard_that_finds_no_run_on_its_store_picks_again(store):
    from zb.addresses import StoreAddress
    from zb.status.reader import open_reader

    first = host("127.0.0.1", 0)
    a, b = StoreAddress("127.0.0.1", first.port), StoreAddress("127.0.0.1", store.port)
    _world(first, ["x"])
    board = Dashboard(listen("127.0.0.1", 0), lambda: open_reader([a, b], 5.0), 30.0, f"{a},{b}")
    try:
        board.sample()
        assert board.document()["source"] == str(a)
        first.delete_key(keys.WORLD)             # the store the run was on came back empty ...
        _failed_over_run(store)                  # ... and the run is on the next one
        board.sample()
        assert "error" in board.document() and board._reader is None, "no run there: the next refresh picks again"
        board.sample()
        doc = board.document()
        assert doc["source"] == str(b) and doc["stores"]["failovers"] == 1 and "error" not in doc
    finally:
        board._server.server_close()     # never started: nothing to shut down but its socket


def test_the_stores_line_only_when_there_is_something_to_say():
    import io

    from rich.console import Console

    from zb.cli.status import status_table, status_view, stores_line

    def doc(listed, failovers, current="s2:1"):
        return {"source": current, "run": {}, "nodes": [],
                "stores": {"current": current, "failovers": failovers,
                           "list": [{"address": a, "answers": ok} for a, ok in listed]}}

    assert stores_line(doc([("s2:1", True)], 0)) is None, "one store, no failover: the table alone, as ever"
    assert stores_line({"source": "x", "run": {}, "nodes": []}) is None
    assert stores_line(doc([("s2:1", True)], 2)) == "store s2:1 (current; 2 failovers so far)"
    assert stores_line(doc([("s1:1", False), ("s2:1", True)], 1)) == \
        "store s2:1 (current; 1 failover so far; s1:1 does not answer)"
    assert stores_line(doc([("s1:1", False), ("s2:1", True), ("s3:1", False)], 0)) == \
        "store s2:1 (current; no failover so far; s1:1, s3:1 do not answer)"
    console = Console(file=io.StringIO(), width=250, color_system=None)
    console.print(status_view(doc([("s2:1", True)], 0)))
    plain = console.file.getvalue()
    console = Console(file=io.StringIO(), width=250, color_system=None)
    console.print(status_table(doc([("s2:1", True)], 0)))
    assert plain == console.file.getvalue()


def test_the_clipped_nodes_of_the_newest_outer_step_are_shown():
    """diloco.clip: each node's record keeps who was clipped at its last outer step; the run shows the newest
    node's list and the table says it under itself (and nothing when nobody was)."""
    from zb.cli.status import clipped_line
    from zb.status.reader import _run

    records = {}
    for uid, outer, clipped in (("a", 4, ["c"]), ("b", 3, ["b"])):
        s = _status(uid)
        s.observe({"event": "outer_step", "time": 3.0, "outer_step": outer, "step": 5 * outer, "mesh_version": 1,
                   "global_world_size": 3, "num_peers": 3, "clipped": clipped})
        records[uid] = decode_record(encode(s.snapshot()[0]))
    assert records["a"]["clipped"] == ["c"]
    run = _run(None, [], records)
    assert run["clipped"] == ["c"]                      # the newest outer step's (a's, at 4)
    assert clipped_line({"run": {**run, "outer_step": 4}}) == "diloco.clip scaled down c at outer step 4"
    s = _status("a")
    s.observe({"event": "outer_step", "time": 4.0, "outer_step": 5, "step": 25, "mesh_version": 1,
               "global_world_size": 3, "num_peers": 3})
    assert s.snapshot()[0]["clipped"] == [] and clipped_line({"run": {"clipped": []}}) is None


def test_a_run_whose_nodes_sealed_its_end_shows_where_and_when_it_finished(store):
    """keys.FINISHED (what a node writes at the run's end, zb.elastic.membership.mark_finished): the document
    carries it and the table says it under itself; a record of an earlier run in the namespace, or one the run
    went on past (a later world), says nothing."""
    import io

    from rich.console import Console

    from zb.cli.status import finished_line, status_view
    from zb.elastic.store_state import Finished

    _world(store, ["a"], run="r1", version=4)
    _node(store, "a", state="left", step=120, outer_step=12)
    doc = RunReader(store, "test").read()
    assert doc["run"]["finished"] is None and finished_line(doc) is None
    store.set(keys.FINISHED, Finished("r1", 4, 12, 120, 1_700_000_000.0).encode())
    doc = RunReader(store, "test").read()
    line = "finished at outer step 12 (step 120) at 2023-11-14 22:13:20 UTC"
    assert doc["run"]["finished"] == {"mesh_version": 4, "outer_step": 12, "step": 120, "time": 1_700_000_000.0,
                                      "line": line}
    assert finished_line(doc) == line
    console = Console(file=io.StringIO(), width=250, color_system=None)
    console.print(status_view(doc))
    assert console.file.getvalue().splitlines()[-1] == line
    _world(store, ["a"], run="r1", version=5)                 # nodes started again: the run goes on
    assert RunReader(store, "test").read()["run"]["finished"] is None
    _world(store, ["a"], run="r2", version=4)                 # another run in the namespace
    assert RunReader(store, "test").read()["run"]["finished"] is None
