"""The store's list of runs (zb.elastic.runs, issue 44): what a node writes there as it joins a run and as the run
reaches its end (at the store's root, unsealed, whatever its namespace and secret; never holding the run's end on a
silent store), and what a reader keeps of it (lines of the right shape and range, the newest, a bounded number of runs).
"""

from __future__ import annotations

import json
import threading

import pytest

from zb.diloco.claims import RunClaims
from zb.elastic import keys, runs
from zb.elastic.tcpstore import host
from zb.errors import EnvironmentFailure
from zb.signed_store import MAGIC, authenticated, prefixed

SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture
def store():
    return host("127.0.0.1", 0)


def test_the_list_keeps_only_lines_of_its_shape():
    good = runs.start_line("alpha", secret=True, now=100.0) + runs.finish_line("beta/", now=50.0)
    junk = [b"not json", b"[1]", b'{"namespace": 7, "event": "start", "time": 1}',
            b'{"namespace": "x", "event": "boom", "time": 1}', b'{"namespace": "x", "event": "start", "time": 1e300}',
            b'{"namespace": "x", "event": "start", "time": true}', b'{"namespace": "x", "event": "start", "time": -1}',
            b'{"namespace": "x", "event": "start", "time": NaN}', b'{"namespace": "x", "event": "start", "time": 5, '
            b'"secret": "yes"}', b'{"namespace": "esc\\u001b[2J", "event": "start", "time": 5}',
            json.dumps({"namespace": "n" * 300, "event": "start", "time": 5}).encode(),
            json.dumps({"namespace": "long", "event": "start", "time": 5, "pad": "x" * 2000}).encode()]
    listed, omitted = runs.parse(good.encode() + b"\n".join(junk) + b"\n")
    assert [(r.namespace, r.secret, r.finished) for r in listed] == [("alpha", True, None), ("beta", False, 50.0)]
    assert omitted == 0


def test_a_run_is_finished_until_a_node_starts_it_again_and_the_list_is_bounded():
    lines = runs.start_line("a", False, 10.0) + runs.start_line("a", True, 12.0) + runs.finish_line("a", 20.0)
    (run,), _ = runs.parse(lines.encode())
    assert (run.started, run.secret, run.finished) == (10.0, True, 20.0)
    (again,), _ = runs.parse((lines + runs.start_line("a", False, 30.0)).encode())
    assert again.finished is None and again.started == 10.0
    many = "".join(runs.start_line(f"run{i:03d}", False, 1000.0 + i) for i in range(runs.MAX_RUNS + 5))
    listed, omitted = runs.parse(many.encode())
    assert len(listed) == runs.MAX_RUNS and omitted == 5 and listed[0].namespace == "run005", "the newest are kept"
    flood = (runs.start_line("old", False, 1.0) + "x" * runs.MAX_BYTES + "\n" + runs.start_line("new", False, 2.0))
    assert [r.namespace for r in runs.parse(flood.encode())[0]] == ["new"], "only the newest MAX_BYTES are read"


def test_a_node_announces_its_run_at_the_root_unsealed_and_marks_it_finished(store):
    """The node's client is sealed and under its namespace; its lines are at the store's root, in plain JSON."""
    client = prefixed(authenticated(store, SECRET, "test", keys.is_counter), "alpha")
    claims = RunClaims(lambda wait_s=None: client, {"stripes": 1, "model": "debug"}, local_rank=0, local_world_size=1,
                       namespace="alpha")
    assert claims.check_fingerprint(follow_stripes=False) == 1
    assert store.check(["alpha/zb/run/fingerprint"]) and not store.check(["alpha/" + keys.RUNS])
    raw = store.get(keys.RUNS)
    assert MAGIC not in raw and json.loads(raw)["namespace"] == "alpha" and json.loads(raw)["secret"] is True
    assert claims.finish()
    (run,), _ = runs.parse(store.get(keys.RUNS))
    assert run.namespace == "alpha" and run.secret and run.finished is not None


def test_a_silent_store_never_holds_the_end_of_a_run():
    """The finish line is written from a thread waited for a bounded time: a store that never answers (here a
    connect that never returns) leaves the run's end unmarked, never stuck."""
    hang = threading.Event()

    def connect(wait_s=None):
        hang.wait()
        raise EnvironmentFailure("the store never answered")

    claims = RunClaims(connect, {"stripes": 1}, local_rank=0, local_world_size=1, namespace="slow")
    try:
        assert claims.finish() is False
    finally:
        hang.set()


