"""Several runs on one store (issue 44): `zb status` without a namespace lists every run the store's list names (a
line each), with one shows that run alone, and the dashboard opens on the list, each run a link to its page. In-process,
over a hosted store (the list itself: tests/test_run_registry.py; the runs of real `zb train` nodes:
tests/test_status_runs_live.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request

import pytest

from zb.elastic import keys, runs
from zb.elastic.tcpstore import host
from zb.elastic.world import World
from zb.signed_store import authenticated, declare, for_reading, holds_secret, prefixed
from zb.status.listing import StoreView
from zb.status.page import render
from zb.status.reader import RunReader
from zb.status.record import encode
from zb.status.server import Dashboard, listen
from zb.testing.fake_dom import FAKE_DOM

SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture
def store():
    return host("127.0.0.1", 0)


def _run(root, namespace: str, nodes: dict[str, float], *, finished: bool = False, started: float = 1.7e9) -> None:
    """A run in `namespace` as its nodes leave it in the store: the world, each node's record (its loss) and beat,
    and its lines on the store's list of runs."""
    store = prefixed(root, namespace) if namespace else root
    store.set(keys.WORLD, World(version=2, resolution=1, nodes=list(nodes), tokens={u: "t" for u in nodes}).encode())
    for uid, loss in nodes.items():
        store.append(keys.STATUS_INDEX, uid + "\n")
        store.set(keys.status(uid), encode({"format": 1, "uid": uid, "state": "training", "step": 20, "outer_step": 4,
                                            "loss": loss, "tokens_per_s": 100.0, "total_steps": 40,
                                            "heartbeat_interval": 0.05, "heartbeat_timeout": 60.0}))
        store.add(keys.heartbeat(uid), 1)
    plain = runs.root_of(store)
    plain.append(keys.RUNS, runs.start_line(namespace, secret=holds_secret(store), now=started))
    if finished:
        plain.append(keys.RUNS, runs.finish_line(namespace, now=started + 60))


def _view(store, secret: bytes | None = None, namespace: str | None = None) -> StoreView:
    def open_run(name: str) -> RunReader:
        return RunReader(for_reading(store, secret, "test", keys.is_counter), "test", secret=secret, namespace=name)

    return StoreView([] if namespace is not None else [store], open_run, "test", namespace=namespace)


def _items(store) -> dict[str, bytes]:
    names = sorted(store.list_keys())
    return dict(zip(names, store.multi_get(names)))


# -- zb status: the list and each run -------------------------------------------------------------
def test_the_list_names_every_run_with_its_nodes_and_each_run_shows_only_its_own(store):
    _run(store, "", {"r0": 3.0})
    _run(store, "alpha", {"a1": 2.0, "a2": 4.0})
    _run(store, "beta", {"b1": 5.0}, finished=True)
    before = _items(store)
    view = _view(store)
    doc = view.read()
    rows = {r["namespace"]: r for r in doc["runs"]}
    assert list(rows) == ["", "alpha", "beta"]
    assert {n: [u["uid"] for u in r["nodes"]] for n, r in rows.items()} == {"": ["r0"], "alpha": ["a1", "a2"],
                                                                          "beta": ["b1"]}
    assert rows["alpha"]["loss"] == 3.0 and rows["alpha"]["step"] == 20 and rows["alpha"]["outer_step"] == 4
    assert rows["beta"]["finished"] and rows["beta"]["state"] == "finished"
    assert not rows["alpha"]["finished"] and rows["alpha"]["state"] == "running" and rows["alpha"]["nodes_alive"] == 2
    assert view.sample(doc, poll=0.01)
    for namespace, uids in (("alpha", {"a1", "a2"}), ("beta", {"b1"}), ("", {"r0"})):
        one = _view(store, namespace=namespace).read()
        assert {n["uid"] for n in one["nodes"]} == uids and one["namespace"] == namespace
        assert one["run"]["world_size"] == len(uids)
    assert _items(store) == before, "listing writes nothing"


def test_one_run_on_the_list_is_shown_as_zb_status_always_showed_it(store):
    _run(store, "solo", {"s1": 1.0})
    doc = _view(store).read()
    assert "runs" not in doc and [n["uid"] for n in doc["nodes"]] == ["s1"] and doc["namespace"] == "solo"


def test_a_run_sealed_with_a_secret_the_caller_does_not_hold_is_listed_by_name_only(store):
    declare(store, SECRET, "test")                    # `zb store --new-secret`: every run on it holds the secret
    sealed = authenticated(store, SECRET, "test", keys.is_counter)
    _run(sealed, "alpha", {"a1": 2.0})
    _run(sealed, "beta", {"b1": 3.0}, finished=True)
    before = _items(store)
    doc = _view(store).read()
    assert [(r["namespace"], r["sealed"], r["nodes"], r["state"]) for r in doc["runs"]] == \
        [("alpha", True, [], "sealed"), ("beta", True, [], "sealed")]
    assert all(r["secret"] for r in doc["runs"]) and "pass --secret-file" in doc["warning"]
    shown = _view(store, secret=SECRET).read()
    assert {r["namespace"]: [u["uid"] for u in r["nodes"]] for r in shown["runs"]} == {"alpha": ["a1"], "beta": ["b1"]}
    assert shown["warning"] is None and [r["finished"] for r in shown["runs"]] == [False, True]
    assert _items(store) == before, "listing writes nothing, not even the run marker"


def test_a_run_whose_nodes_sealed_its_end_is_listed_finished_with_where_and_when(store):
    """Each DiLoCo-SWARM stage is a run of the list (swarm/s0, swarm/s1); a stage whose workers sealed its end
    (keys.FINISHED) is finished, even when the finish line on the store's list did not get there, and a line
    under the list says where and when it ended."""
    import io

    from rich.console import Console

    from zb.cli.status import runs_view
    from zb.elastic.store_state import Finished

    _run(store, "swarm/s0", {"w0": 2.0})
    _run(store, "swarm/s1", {"w1": 3.0})
    world = World(version=2, resolution=1, nodes=["w0"], tokens={"w0": "t"}, run="r0")
    prefixed(store, "swarm/s0").set(keys.WORLD, world.encode())
    prefixed(store, "swarm/s0").set(keys.FINISHED, Finished("r0", 2, 4, 20, 1_700_000_000.0).encode())
    doc = _view(store).read()
    rows = {r["namespace"]: r for r in doc["runs"]}
    assert rows["swarm/s0"]["finished"] and rows["swarm/s0"]["state"] == "finished"
    assert rows["swarm/s0"]["end"]["outer_step"] == 4 and rows["swarm/s1"]["end"] is None
    assert rows["swarm/s1"]["state"] == "running"
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(runs_view(doc))
    assert console.file.getvalue().splitlines()[-1] == \
        "swarm/s0 finished at outer step 4 (step 20) at 2023-11-14 22:13:20 UTC"


def test_the_list_as_a_table():
    from rich.console import Console

    from zb.cli.status import runs_table

    doc = {"source": "h:1", "runs": [
        {"namespace": "", "sealed": False, "nodes_alive": 1, "nodes": [{"uid": "r0"}], "step": 5, "total_steps": 9,
         "outer_step": 1, "loss": 2.5, "tokens_per_s": 10.0, "state": "running"},
        {"namespace": "beta", "sealed": False, "nodes_alive": 0, "nodes": [{"uid": f"b{i}"} for i in range(8)],
         "step": 9, "outer_step": 2, "loss": 2.0, "tokens_per_s": None, "state": "finished"},
        {"namespace": "[red]x", "sealed": True, "nodes": [], "state": "sealed"}]}
    console = Console(width=200, record=True)
    console.print(runs_table(doc))
    text = console.export_text()
    lines = {line.split("│")[1].strip(): line for line in text.splitlines() if line.count("│") > 2}
    assert "3 runs on h:1" in text and set(lines) >= {"(default)", "beta", "[red]x"}
    assert "5/9" in lines["(default)"] and "running" in lines["(default)"] and "2.5000" in lines["(default)"]
    assert "finished" in lines["beta"] and "b5 and 2 more" in lines["beta"]
    assert "sealed" in lines["[red]x"]


# -- the dashboard ----------------------------------------------------------------------------------
def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def test_the_dashboard_opens_on_the_list_and_each_run_has_its_page(store):
    _run(store, "alpha", {"a1": 2.0})
    _run(store, "beta/gamma", {"b1": 3.0}, finished=True)
    for ns, uid in (("alpha", "a1"), ("beta/gamma", "b1")):
        prefixed(store, ns).set(keys.status_history(uid), encode({"uid": uid, "steps": [[1.0, 1, 3.0, 10.0]],
                                                                  "outer": [], "eval": [], "membership": []}))
    board = Dashboard(listen("127.0.0.1", 0), lambda: _view(store), 0.2, "test").start()
    try:
        listed = _get(board.url + "api/status")
        assert [(r["namespace"], [n["uid"] for n in r["nodes"]]) for r in listed["runs"]] == \
            [("alpha", ["a1"]), ("beta/gamma", ["b1"])]
        page = _get(board.url + "api/status?namespace=beta%2Fgamma")
        assert [n["uid"] for n in page["nodes"]] == ["b1"] and page["history"]["b1"]["steps"] == [[1.0, 1, 3.0, 10.0]]
        assert [n["uid"] for n in _get(board.url + "api/status?namespace=alpha")["nodes"]] == ["a1"]
        assert "no run 'nope'" in _get(board.url + "api/status?namespace=nope")["error"]
        with urllib.request.urlopen(board.url + "?namespace=alpha", timeout=10) as r:
            assert r.status == 200 and b'id="run-view"' in r.read()
    finally:
        board.close()




def test_the_page_draws_the_list_each_run_a_link_to_its_page(tmp_path):
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("no node.js to run the page's script")
    script = render().split("<!--ZB_DATA-->")[1].split("<script>")[1].split("</script>")[0]
    show = ('const rows = byId["runs"].children[0].children.slice(1);'
            'console.log(JSON.stringify({title: byId["title"].textContent, shown: byId["run-view"].style.display,'
            ' rows: rows.map(r => [r.attrs["data-run"], r.children[0].children[0].attrs.href,'
            ' r.children.map(c => c.textContent)])}));')
    (tmp_path / "page.js").write_text(FAKE_DOM + script + show)
    doc = {"source": "test", "time": time.time(), "runs": [
        {"namespace": "", "sealed": False, "nodes_alive": 1, "nodes": [{"uid": "r0"}], "step": 5, "state": "running"},
        {"namespace": "a b/c", "sealed": False, "nodes_alive": 0, "nodes": [{"uid": "x"}, {"uid": "y"}], "step": 9,
         "total_steps": 9, "loss": 2.0, "state": "finished"},
        {"namespace": "s", "sealed": True, "nodes": [], "state": "sealed"}]}
    out = subprocess.run([node, str(tmp_path / "page.js"), json.dumps(doc)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["title"] == "zb runs" and shown["shown"] == "none", "the list replaces the run's sections"
    assert [r[:2] for r in shown["rows"]] == [["", "?namespace="], ["a b/c", "?namespace=a%20b%2Fc"],
                                             ["s", "?namespace=s"]]
    cells = {r[0]: r[2] for r in shown["rows"]}
    assert cells[""][:3] == ["(default)", "1", "r0"] and cells["a b/c"][2:4] == ["x, y", "9 / 9"]
    assert cells["a b/c"][-1] == "finished" and cells["s"][1] == "—" and cells["s"][-1] == "sealed"


def test_zb_store_says_how_to_start_a_second_run_and_serves_the_list_of_its_runs():
    import signal
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    from zb.testing.procs import REPO, free_port, subprocess_env

    proc = subprocess.Popen([sys.executable, "-m", "zb", "store", "--port", str(free_port()), "--http-port", "0",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                            cwd=REPO)
    try:
        info = json.loads(proc.stdout.readline())
        client = dist.TCPStore("127.0.0.1", info["port"], is_master=False, use_libuv=True,
                               timeout=timedelta(seconds=30))
        _run(client, "alpha", {"a1": 2.0})
        _run(client, "beta", {"b1": 3.0}, finished=True)
        url = info["dashboard"]
        deadline = time.monotonic() + 30
        while "runs" not in (doc := _get(url + "api/status")) and time.monotonic() < deadline:
            time.sleep(0.2)     # the dashboard samples every 2 s
        assert [(r["namespace"], r["state"]) for r in doc["runs"]] == [("alpha", "running"), ("beta", "finished")]
        assert [n["uid"] for n in _get(url + "api/status?namespace=beta")["nodes"]] == ["b1"]
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "the same plus --elastic.namespace NAME" in err, err
    assert f"every run on it: zb status --store 127.0.0.1:{info['port']}" in err, err


def test_namespace_goes_with_a_store_not_with_from(tmp_path):
    from zb.testing.procs import zb_process

    proc = zb_process("status", "--from", str(tmp_path), "--namespace", "alpha", timeout=60)
    assert proc.returncode == 2 and "--namespace has no effect with --from" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
