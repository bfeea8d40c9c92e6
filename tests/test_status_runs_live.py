"""Several runs on one store with real `zb train` nodes of the debug model (issue 44): three runs in their own
namespaces listed by one `zb status`, each with its nodes, the one that reached its end marked finished, each run
shown alone with --namespace (or ZB_ELASTIC_NAMESPACE); two runs on a store with a secret, listed by name only
without it and shown with it. Listing leaves every key of the store as it was."""

from __future__ import annotations

import json
import signal
from datetime import timedelta

import pytest

from zb.secret import write_new_secret
from zb.testing.cluster import TrainCluster
from zb.testing.procs import zb_process

# The process variant of tests/test_status_runs.py's in-process runs (a minute of real nodes): on request.
pytestmark = pytest.mark.soak

SHORT = ["--optim.total_steps", "10", "--elastic.status_interval", "0.5"]      # two outer steps, then the end
LONG = ["--optim.total_steps", "100000", "--elastic.status_interval", "0.5"]


def _items(port: int) -> dict[str, bytes]:
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=True, timeout=timedelta(seconds=30))
    names = sorted(client.list_keys())
    return dict(zip(names, client.multi_get(names))) if names else {}


def _status(where: str, *args: str, **env: str) -> dict:
    proc = zb_process("status", "--store", where, "--json", *args, timeout=90, **env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _rows(doc: dict) -> dict[str, dict]:
    return {r["namespace"]: r for r in doc["runs"]}


def test_three_runs_on_one_store_each_listed_with_its_nodes(tmp_path):
    run = TrainCluster(tmp_path, 1)
    where = f"127.0.0.1:{run.port}"
    try:
        for uid, namespace, length in (("a", "alpha", LONG), ("b", "beta", SHORT), ("g", "gamma", LONG)):
            run.start_train(uid, "--elastic.namespace", namespace, *length)
        assert run.finish("b") == 0, run.log("b")
        for uid in ("a", "g"):
            run.wait_outer(uid, 1)
        rows = _rows(_status(where))
        assert {n: [u["uid"] for u in r["nodes"]] for n, r in rows.items()} == {"alpha": ["a"], "beta": ["b"],
                                                                              "gamma": ["g"]}
        assert rows["beta"]["finished"] and rows["beta"]["state"] == "finished" and rows["beta"]["step"] == 10
        for name in ("alpha", "gamma"):
            assert not rows[name]["finished"] and rows[name]["nodes_alive"] == 1 and rows[name]["state"] == "running"
            assert rows[name]["step"] >= 5 and rows[name]["loss"] > 0 and rows[name]["outer_step"] >= 1
        alone = _status(where, "--namespace", "alpha")
        assert [n["uid"] for n in alone["nodes"]] == ["a"] and alone["run"]["world_size"] == 1
        assert [n["uid"] for n in _status(where, ZB_ELASTIC_NAMESPACE="gamma")["nodes"]] == ["g"]
        table = zb_process("status", "--store", where, timeout=90)
        assert table.returncode == 0 and "3 runs on" in table.stdout, table.stderr
        assert all(n in table.stdout for n in ("alpha", "beta", "gamma", "finished", "running"))

        for uid in ("a", "g"):
            run.procs[uid].send_signal(signal.SIGTERM)
            assert run.finish(uid) == 128 + signal.SIGTERM, run.log(uid)
        before = _items(run.port)
        after = _rows(_status(where))
        assert [after[n]["state"] for n in ("alpha", "beta", "gamma")] == ["stopped", "finished", "stopped"]
        assert [n["uid"] for n in _status(where, "--namespace", "beta")["nodes"]] == ["b"]
        assert _items(run.port) == before, "listing the runs wrote to the store"
    finally:
        run.close()


def test_two_runs_on_a_store_with_a_secret_are_listed_sealed_without_it(tmp_path):
    secret = tmp_path / "run.secret"
    write_new_secret(secret)
    run = TrainCluster(tmp_path, 1, ZB_ELASTIC_SECRET_FILE=str(secret))
    where = f"127.0.0.1:{run.port}"
    try:
        for uid, namespace in (("a", "alpha"), ("b", "beta")):
            run.start_train(uid, "--elastic.namespace", namespace, *SHORT)
        for uid in ("a", "b"):
            assert run.finish(uid) == 0, run.log(uid)
        before = _items(run.port)
        without = _status(where)
        assert [(r["namespace"], r["sealed"], r["nodes"], r["secret"]) for r in without["runs"]] == \
            [("alpha", True, [], True), ("beta", True, [], True)]
        assert "pass --secret-file" in without["warning"]
        shown = _rows(_status(where, "--secret-file", str(secret)))
        assert {n: [u["uid"] for u in r["nodes"]] for n, r in shown.items()} == {"alpha": ["a"], "beta": ["b"]}
        assert all(r["finished"] and not r["sealed"] and r["step"] == 10 for r in shown.values())
        assert _items(run.port) == before, "listing the runs wrote to the store"
    finally:
        run.close()
