"""The pure parts of the elastic layer: the world rule, the judge, liveness, probe, store errors."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from zb.elastic import standby
from zb.elastic.heartbeat import Liveness
from zb.elastic.judge import RoundDeadlines, judge
from zb.elastic.probe import ProbeListener, check_peers
from zb.elastic.store_state import Answer, Snapshot
from zb.elastic.world import JoinRequest, Observation, World, next_world
from zb.errors import EnvironmentFailure
from zb.testing.procs import free_port, subprocess_env, wait_until, zb_process

W = World(version=3, resolution=7, nodes=["a", "b", "c"], tokens={"a": "ta", "b": "tb", "c": "tc"}, join_cursor=2)
DL = RoundDeadlines(suspect_grace=1.0, sync_deadline=10.0, stuck_after=25.0)


def obs(answered=("a", "b", "c"), gone=(), excluded=(), joiners=(), failure=False) -> Observation:
    return Observation(answered=set(answered), gone=set(gone), excluded=set(excluded), joiners=list(joiners),
                       join_end=5, failure=failure)


def test_unchanged_world_keeps_version_but_advances_the_resolution():
    new = next_world(W, obs())
    assert (new.version, new.resolution, new.nodes, new.join_cursor) == (3, 8, ["a", "b", "c"], 5)


def test_leave_death_and_join_compact_ranks():
    req = JoinRequest(uid="d", token="td", index=3)
    new = next_world(W, obs(answered=("a", "c"), gone={("b", "tb")}, joiners=[req]))
    assert new.nodes == ["a", "c", "d"] and new.version == 4
    assert (new.left, new.died, new.joined) == (["b"], [], ["d"])


def test_goodbye_of_an_older_incarnation_is_ignored():
    new = next_world(W, obs(gone={("b", "old-token")}))
    assert new.nodes == ["a", "b", "c"] and new.left == []


def test_restarted_member_is_replaced_by_its_new_incarnation():
    new = next_world(W, obs(joiners=[JoinRequest(uid="b", token="tb2", index=3)]))
    assert new.nodes == ["a", "c", "b"] and new.tokens["b"] == "tb2" and new.died == ["b"]


def test_failed_collective_bumps_version_without_membership_change():
    assert next_world(W, obs(failure=True)).version == 4


def test_reseed_after_store_restart_keeps_order_and_version_moves_on():
    reqs = [JoinRequest("c", "tc", 0, last_version=3, last_rank=2), JoinRequest("a", "ta", 1, last_version=3),
            JoinRequest("x", "tx", 2, pref_rank=0)]
    new = next_world(World(), Observation(set(), set(), set(), reqs, 3))
    assert new.nodes == ["a", "c", "x"] and new.version == 4 and new.joined == ["x"]


def test_first_seed_orders_by_preferred_rank_and_nobody_needs_state():
    reqs = [JoinRequest("b", "t", 0, pref_rank=1), JoinRequest("a", "t", 1, pref_rank=0)]
    new = next_world(World(), Observation(set(), set(), set(), reqs, 2))
    assert new.nodes == ["a", "b"] and new.version == 1 and new.joined == []


def test_world_roundtrip_and_garbage():
    assert World.decode(W.encode()) == W
    assert World.decode(b"") is None and World.decode(b"[1]") is None and World.decode(b"{bad") is None


def snap(answers=(), gone=(), world: World = W) -> Snapshot:
    return Snapshot(raw_world=world.encode().encode(), world=world, gone=set(gone), joins=[], answers=list(answers))


def test_judge_waits_for_members_then_settles():
    live = Liveness(timeout=5.0)
    v = judge(W, snap([Answer("a", "ta")]), "a", live, since=0.5, dl=DL)
    assert v.acting_leader == "a" and not v.settled
    v = judge(W, snap([Answer("a", "ta"), Answer("b", "tb"), Answer("c", "tc")]), "a", live, 0.5, DL)
    assert v.settled


def test_judge_drops_blamed_suspect_after_grace_and_missed_sync_after_deadline():
    live = Liveness(timeout=5.0)
    blamed = [Answer("a", "ta", failed=True, suspects=["c"]), Answer("b", "tb")]
    assert not judge(W, snap(blamed), "a", live, 0.5, DL).settled
    v = judge(W, snap(blamed), "a", live, 1.5, DL)
    assert v.settled and v.observation.excluded == {"c"} and v.observation.failure
    v = judge(W, snap([Answer("a", "ta"), Answer("b", "tb")]), "a", live, 10.5, DL)
    assert v.settled and v.observation.excluded == {"c"}


def test_next_in_line_leads_when_leader_is_dead_or_gone():
    live = Liveness(timeout=5.0)
    read_unchanged(live, "a", for_s=6)
    assert judge(W, snap([Answer("b", "tb")]), "b", live, 0.5, DL).acting_leader == "b"
    fresh = Liveness(timeout=5.0)
    assert judge(W, snap([Answer("b", "tb")], gone={("a", "ta")}), "b", fresh, 0.1, DL).acting_leader == "b"
    assert judge(W, snap([Answer("b", "tb")]), "b", fresh, 0.1, DL).acting_leader == "a"


def test_stuck_leader_is_passed_over():
    live = Liveness(timeout=5.0)
    checked = [Answer("a", "ta"), Answer("b", "tb"), Answer("c", "tc")]
    assert judge(W, snap(checked), "b", live, 20.0, DL).acting_leader == "a"
    assert judge(W, snap(checked), "b", live, 26.0, DL).acting_leader == "b"


def test_leader_that_checked_in_and_then_died_is_passed_over_at_once():
    """Chaos seed 3: the leader was SIGKILLed after its check-in; the others waited stuck_after (25 s)
    for it instead of the heartbeat timeout, the crash detection of members that had not checked in."""
    live = Liveness(timeout=5.0)
    read_unchanged(live, "a", for_s=6)
    checked = [Answer("a", "ta"), Answer("b", "tb"), Answer("c", "tc")]
    v = judge(W, snap(checked), "b", live, 0.5, DL)
    assert v.acting_leader == "b" and v.observation.excluded == {"a"}
    live.condemn("c")                                   # its port refused: gone, checked in or not
    assert judge(W, snap(checked), "b", live, 0.5, DL).observation.excluded == {"a", "c"}


def test_stuck_rule_passes_over_one_member_at_a_time():
    """Chaos seed 3: the node that checked in first reached stuck_after first and passed over every
    lower-ranked member at once, live ones waiting for the same stuck leader included; it then led a
    world of itself alone and the others were evicted. The next in line gets a window of its own."""
    live = Liveness(timeout=5.0)
    checked = [Answer("a", "ta"), Answer("b", "tb"), Answer("c", "tc")]
    v = judge(W, snap(checked), "c", live, 26.0, DL)
    assert v.acting_leader == "b" and v.observation.excluded == {"a"}
    assert judge(W, snap(checked), "c", live, 51.0, DL).acting_leader == "c"


def test_two_members_that_cannot_reach_each_other_do_not_share_the_next_world():
    """Chaos --netns, a two-way partition between two nodes that both still reach the store: they
    blamed nobody (gloo timed out), both checked in and beat, so every rule kept both; every outer
    step then failed again (and their group builds stalled past the sync deadline, evicting both and
    re-admitting both together) until the cut healed. Their probe reports now drop one of the pair."""
    live = Liveness(timeout=5.0)
    checked = [Answer("a", "ta", failed=True), Answer("b", "tb", failed=True, unreachable=["c"]),
               Answer("c", "tc", failed=True, unreachable=["b"])]
    for me in ("a", "b", "c"):                        # every node reaches the same verdict
        v = judge(W, snap(checked), me, live, 0.5, DL)
        assert v.acting_leader == "a" and v.settled and v.observation.excluded - {me} == {"c"} - {me}
    new = next_world(W, judge(W, snap(checked), "a", live, 0.5, DL).observation)
    assert new.nodes == ["a", "b"] and new.died == ["c"]
    one_sided = [Answer("a", "ta"), Answer("b", "tb", unreachable=["c"])]   # c has not checked in yet
    assert judge(W, snap(one_sided), "a", live, 0.5, DL).observation.excluded == {"c"}


def test_the_member_cut_off_from_all_is_the_one_dropped():
    from zb.elastic.judge import split_unreachable

    w = World(version=1, resolution=1, nodes=["a", "b", "c", "d"], tokens={u: "t" for u in "abcd"})
    lines = [Answer("a", "t", unreachable=["b", "c", "d"]), Answer("b", "t", unreachable=["a"]),
             Answer("c", "t", unreachable=["a"]), Answer("d", "t")]
    assert split_unreachable(w, lines) == {"a"}        # the leader's own link is down: it goes, not the rest
    assert split_unreachable(w, [Answer("a", "t", unreachable=["zz", "a"])]) == set()   # not members


def test_probe_reports_silence_not_refusal_as_unreachable():
    from zb.elastic.probe import unreachable_peers

    listener = ProbeListener("127.0.0.1")
    listener.start()
    # Silence on loopback: a listener that never accepts, its one-slot queue full, drops further SYNs.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(0)
    filler = socket.create_connection(silent.getsockname(), timeout=1.0)
    try:
        closed = f"127.0.0.1:{free_port()}"
        far = f"127.0.0.1:{silent.getsockname()[1]}"
        assert unreachable_peers({"ok": listener.endpoint, "gone": closed, "far": far}, timeout=0.5) == {"far"}
    finally:
        listener.stop()
        filler.close()
        silent.close()


def test_a_rejoin_waits_for_an_unreachable_member_instead_of_exiting(monkeypatch):
    """A node evicted by a partition rejoins while the cut still holds: joining then would break the
    next outer step again, and exiting (the first join's answer to a misconfigured network) would
    lose a node to a transient fault. It waits until the member is reachable."""
    from zb.config_schema import ElasticConfig
    from zb.elastic import admission
    from zb.elastic import membership as mod

    cfg = ElasticConfig(store_timeout=30, heartbeat_interval=0.01)
    world = World(version=2, resolution=3, nodes=["a", "b"], tokens={"a": "ta", "b": "tb"})
    monkeypatch.setattr(admission, "read_snapshot", lambda store, round_: snap([], world=world))
    tries = []

    def before_join(_snap):
        tries.append(time.monotonic())
        if len(tries) < 3:
            raise EnvironmentFailure("cannot reach peer b at 10.0.0.2:1 on the gloo interface within 2.0 s (NAT or ...")

    m = mod.Membership(cfg, "c", "tc", 1, Liveness(5.0), connect=lambda: None, before_join=before_join)
    with pytest.raises(EnvironmentFailure):           # a first join: a misconfigured network, fail at once
        m.admission._reachable_before_join(None, snap([], world=world))
    tries.clear()
    m.world = World(version=1, resolution=1, nodes=["a", "b", "c"], tokens={"a": "ta", "b": "tb", "c": "tc"})
    m.admission._reachable_before_join(None, snap([], world=world))   # a rejoin: waits, then goes on
    assert len(tries) == 3
    tries.clear()
    monkeypatch.setattr(cfg, "store_timeout", 0.0)
    with pytest.raises(EnvironmentFailure, match="cannot reach peer b"):   # not forever
        m.admission._reachable_before_join(None, snap([], world=world))


def test_a_change_read_after_a_pause_counts_from_when_it_was_read():
    """Chaos seed 16: a node SIGSTOPped mid heartbeat (the clock read, then the counters read after
    SIGCONT 8 s later) recorded its peers' new counters as changed 8 s ago, judged every live member
    dead, and seeded a world of itself alone, evicting the run."""
    from zb.elastic.heartbeat import observe_counters

    class PausingStore:                 # the read of the counters takes longer than the timeout
        def check(self, keys):
            return True

        def multi_get(self, keys):
            time.sleep(0.3)
            return [b"2" for _ in keys]

    live = Liveness(timeout=0.2)
    live.observe("a", b"1")
    observe_counters(PausingStore(), live, ["a"])
    assert not live.is_dead("a"), "a counter seen changing just now is alive"


def read_unchanged(live: Liveness, uid: str, for_s: float) -> None:
    """`uid`'s counter read every half timeout over the last `for_s` seconds, never changing."""
    now = time.monotonic()
    t = now - for_s
    while t < now:
        live.observe(uid, b"1", now=t)
        t += live.timeout / 2
    live.observe(uid, b"1", now=now)


def test_a_counter_not_read_for_the_timeout_is_no_evidence():
    """A node stops reading the counters of members it no longer judges (zb.elastic.standby): their last change
    ageing would make them look dead the day it judges again. Read again, the silence counts from then."""
    live = Liveness(timeout=2.0)
    live.observe("x", b"1", now=100.0)
    assert live.is_dead("x", now=102.1) is False and live.silent_for("x", now=102.1) == 0.0
    live.observe("x", b"1", now=110.0)
    assert live.silent_for("x", now=111.0) == pytest.approx(1.0)
    live.condemn("x")
    assert live.is_dead("x", now=200.0), "a condemned node stays dead, read or not"


def test_liveness_uses_local_clock_of_changes():
    live = Liveness(timeout=2.0)
    live.observe("x", b"1", now=100.0)
    live.observe("x", b"1", now=101.5)     # unchanged counter: silence keeps counting
    assert live.silent_for("x", now=102.5) == pytest.approx(2.5) and live.is_dead("x", now=102.5)
    live.observe("x", b"2", now=102.6)
    assert not live.is_dead("x", now=103.0)
    assert not live.is_dead("never-seen")


def test_probe_names_the_unreachable_live_peer():
    listener = ProbeListener("127.0.0.1")
    listener.start()
    try:
        closed = f"127.0.0.1:{free_port()}"
        check_peers({"ok": listener.endpoint}, timeout=1.0, still_alive=lambda u: True)
        check_peers({"dead": closed}, timeout=1.0, still_alive=lambda u: False)   # dead, not unreachable
        with pytest.raises(EnvironmentFailure, match="cannot reach peer far at"):
            check_peers({"ok": listener.endpoint, "far": closed}, timeout=1.0, still_alive=lambda u: True)
    finally:
        listener.stop()



def test_zb_store_port_in_use_is_one_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        result = zb_process("store", "--port", str(s.getsockname()[1]))
    assert result.returncode == 1
    assert "already in use" in result.stderr and "Traceback" not in result.stderr


def test_zb_store_bad_address_is_invalid_input():
    result = zb_process("store", "--host", "no.such.host.invalid", "--port", str(free_port()))
    assert result.returncode == 2 and "not a valid address" in result.stderr


def test_zb_store_help_names_env_and_private_network(run_zb):
    out = run_zb("store", "--help").output
    assert "GLOBAL_ADDR" in out and "GLOBAL_PORT" in out and "private network" in out


def _reachable(addr: str, port: int) -> bool:
    try:
        socket.create_connection((addr, port), timeout=5).close()
        return True
    except OSError:
        return False


def test_store_listens_on_exactly_the_address_given():
    """torch's TCPStore alone listens on every interface whatever host it gets; the store has no
    authentication, so `zb store --host 127.0.0.1` must not answer on another address."""
    import shutil

    from zb.elastic.tcpstore import host

    port = free_port()
    store = host("127.0.0.1", port)
    assert _reachable("127.0.0.1", port) and not _reachable("127.0.0.2", port)
    if shutil.which("ss"):
        listening = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
        assert f"127.0.0.1:{port}" in listening and f"*:{port}" not in listening, listening
    store.set("k", "v")
    assert store.get("k") == b"v"
    del store
    wildcard = host("0.0.0.0", port)
    assert _reachable("127.0.0.2", port), "--host 0.0.0.0 still means every interface"
    del wildcard


def test_zb_store_serves_until_sigterm_and_warns_on_wildcard_bind():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "zb", "store", "--host", "0.0.0.0", "--port", str(port), "--json"],
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        info = __import__("json").loads(proc.stdout.readline())
        assert info["port"] == port and info["env"]["GLOBAL_PORT"] == str(port) and info["public"]
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        proc.terminate()
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "anyone who reaches" in err and "--new-secret" in err and f"GLOBAL_PORT={port}" in err
    finally:
        proc.kill()
        proc.wait(10)


def test_stop_signals_wake_the_waiter_and_restore_the_handlers():
    """The handler only sets a flag: an Event.set in a handler could deadlock on the lock its own
    Event.wait holds, and `zb store` then ignored SIGTERM (1 run in ~40)."""
    import os
    import signal
    import threading

    from zb.stop_signals import StopSignals

    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        assert stop.wait() == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_stopping_heartbeat_sends_no_deathrattle_but_rattle_does():
    from datetime import timedelta

    import torch.distributed as dist

    from zb.elastic import keys
    from zb.elastic.deathrattle import Deathrattle
    from zb.elastic.heartbeat import Heartbeat

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    client = lambda: dist.TCPStore("127.0.0.1", store.port, use_libuv=True, timeout=timedelta(seconds=30))  # noqa: E731
    live = Liveness(timeout=1.0)
    beat = Heartbeat("n1", 0.05, live, client, lambda: ["n1"])
    beat.start()
    wait_until(lambda: beat.beats >= 3, 10, "three heartbeats", poll=0.02)
    beat.stop(5)
    assert int(store.get(keys.heartbeat("n1"))) >= 3
    assert not store.check([keys.GONE])
    Deathrattle("n1", "tok", client).rattle("leave")
    assert store.get(keys.GONE) == b"n1 tok\n"


def test_silent_peer_with_a_closed_port_is_condemned_and_revived_by_a_new_counter():
    from datetime import timedelta

    import torch.distributed as dist

    from zb.elastic import keys
    from zb.elastic.closedport import ClosedPortDetector

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    listener = ProbeListener("127.0.0.1")
    listener.start()
    store.set(keys.probe("gone"), f"127.0.0.1:{free_port()}")
    store.set(keys.probe("hung"), listener.endpoint)
    try:
        live = Liveness(timeout=60.0)
        for uid in ("gone", "hung"):
            live.observe(uid, b"1", now=time.monotonic() - 5)
        ClosedPortDetector(live, interval=1.0).check(store, ["gone", "hung"])
        assert live.is_dead("gone") and not live.is_dead("hung")
        live.observe("gone", b"2")          # a new incarnation beats: alive again
        assert not live.is_dead("gone")
    finally:
        listener.stop()


def test_a_node_that_said_goodbye_leaves_instead_of_hanging_in_the_next_resolution():
    """SIGTERM sends the deathrattle at once, but the node may still be finishing the step before an
    outer step. Its resolution must raise LeavingRun, not wait for a round nobody leads (it was the
    last member) or for an admission it can never get (the others already dropped it)."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from zb.config_schema import ElasticConfig
    from zb.elastic import keys
    from zb.elastic.membership import Membership
    from zb.errors import LeavingRun

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    client = lambda: dist.TCPStore("127.0.0.1", store.port, use_libuv=True, timeout=timedelta(seconds=30))  # noqa: E731
    cfg = ElasticConfig(store_timeout=120, polling_interval=0.02, sync_deadline=5, heartbeat_interval=0.5,
                        heartbeat_timeout=60)

    def member(uid: str) -> Membership:
        return Membership(cfg, uid, f"tok-{uid}", 1, Liveness(cfg.heartbeat_timeout), client)

    a, b = member("a"), member("b")
    joined = [threading.Thread(target=m.join, args=(2, 10.0)) for m in (a, b)]
    for t in joined:
        t.start()
    for t in joined:
        t.join(15)
    assert a.world is not None and a.world.nodes == b.world.nodes and len(a.world.nodes) == 2

    store.append(keys.GONE, "a tok-a\n")          # a's deathrattle; b resolves the round without it
    started = time.monotonic()
    with pytest.raises(LeavingRun):
        a.resolve()
    assert b.resolve().nodes == ["b"]
    store.append(keys.GONE, "b tok-b\n")          # now the last member says goodbye too
    with pytest.raises(LeavingRun):
        b.resolve()
    # A regression waits for an admission until store_timeout (120 s): half of it is no busy-machine bound.
    assert time.monotonic() - started < cfg.store_timeout / 2


def test_groups_are_not_built_with_a_member_this_node_cannot_reach(monkeypatch):
    """A partition between two members that are not neighbours on the ring breaks nothing until the
    next rebuild; gloo's full-mesh connect then waited 25 s for the silent one, past the sync deadline,
    so both were evicted as late. The build fails at once instead, and the next check-in reports it."""
    import types

    import torch.distributed as dist

    from zb.config_schema import ElasticConfig
    from zb.elastic.mesh import ElasticDeviceMesh
    from zb.elastic.view import WorldView

    mesh = ElasticDeviceMesh(ElasticConfig(addr="127.0.0.1"))
    mesh._membership = types.SimpleNamespace(store=None, uid="a")
    monkeypatch.setattr(mesh, "_unreachable", lambda endpoints: {"c"})
    monkeypatch.setattr(dist, "PrefixStore", lambda *a: None)
    monkeypatch.setattr(dist, "ProcessGroupGloo", lambda *a: pytest.fail("built a group with an unreachable member"))
    view = WorldView(mesh_version=4, global_rank=0, global_world_size=3, nodes=["a", "b", "c"], leader="a", uid="a")
    mesh._rebuild(view)
    assert mesh.global_pg is None and mesh._failed


def test_a_beat_that_comes_late_is_measured_and_explains_an_eviction():
    """A node that cannot beat in time (a busy machine: issue 30, defect 6) measures its own worst gap and
    says it when it finds itself dropped; a node that beat on time says nothing of the kind."""
    import time

    from zb.elastic.heartbeat import Heartbeat, stall_hint

    class SlowOnce:
        def __init__(self):
            self.calls = 0

        def add(self, key, n):
            self.calls += 1
            if self.calls == 3:
                time.sleep(0.6)        # this beat is held up, as by a starved process

        def check(self, keys):
            return False

    store = SlowOnce()
    beat = Heartbeat("me", 0.05, Liveness(1.0), lambda: store, lambda: [])
    beat.start()
    deadline = time.monotonic() + 30
    while store.calls < 6 and time.monotonic() < deadline:
        time.sleep(0.02)
    beat.stop(5)
    gap, outage = beat.take_worst_gap()
    assert gap >= 0.6 and outage == 0.0 and beat.take_worst_gap()[0] < 0.5   # forgotten: the silence since the stop
    time.sleep(0.7)     # frozen: no beat since; a node woken now asks before its thread beats again
    assert beat.take_worst_gap()[0] >= 0.7
    assert "up to" in stall_hint(gap, 1.0) and "raise elastic.heartbeat_timeout" in stall_hint(gap, 1.0)
    assert stall_hint(0.1, 1.0) == ""


def test_a_store_that_did_not_answer_is_named_instead_of_the_machine():
    """A node cut from the store (its beats fail) was told its machine was too busy to beat: the gap was the
    store's. The heartbeat tells an outage from a slow beat, and the hint names the store."""
    import time

    from zb.elastic.heartbeat import Heartbeat, stall_hint
    from zb.store_clients import StoreUnreachable

    class CutOnce:
        def __init__(self):
            self.calls = 0

        def add(self, key, n):
            self.calls += 1
            if self.calls in (3, 4, 5, 6):
                raise StoreUnreachable("cut")

        def check(self, keys):
            return False

    store = CutOnce()
    beat = Heartbeat("me", 0.1, Liveness(1.0), lambda: store, lambda: [])
    beat.start()
    deadline = time.monotonic() + 30
    while beat.beats < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    beat.stop(5)
    gap, outage = beat.take_worst_gap()
    assert outage >= 0.4 and gap >= outage
    hint = stall_hint(gap, 0.6, outage)
    assert "the store did not answer" in hint and "too busy" not in hint


def test_a_roll_call_ends_when_its_last_answer_lands_not_at_the_next_poll():
    """The nodes wait on the store for the roll call's next event (an answer, the next world) instead of
    sleeping elastic.polling_interval: with a 30 s interval, three resolutions of two members still end
    at once (a sleeping waiter would take 30 s each and miss the 20 s limit below). The leader deletes
    the roll calls every member has moved past."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from zb.config_schema import ElasticConfig
    from zb.elastic import keys
    from zb.elastic.membership import Membership

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    client = lambda: dist.TCPStore("127.0.0.1", store.port, use_libuv=True, timeout=timedelta(seconds=30))  # noqa: E731
    cfg = ElasticConfig(store_timeout=120, polling_interval=0.02, sync_deadline=60, heartbeat_interval=0.5,
                        heartbeat_timeout=60)
    members = [Membership(cfg, uid, f"tok-{uid}", 1, Liveness(cfg.heartbeat_timeout), client) for uid in "ab"]

    def together(fn) -> None:
        threads = [threading.Thread(target=fn, args=(m,), daemon=True) for m in members]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads), "a roll call did not end when its last answer landed"

    together(lambda m: m.join(2, 10.0))
    first = members[0].world.resolution
    cfg.polling_interval = 30.0
    for _ in range(3):
        together(lambda m: m.resolve())
    assert {m.world.resolution for m in members} == {first + 3}
    assert not store.check([keys.roll_call(first)]) and not store.check([keys.roll_call_events(first)])
    assert not store.check([f"{keys.roll_call_events(first)}/1"])
    assert store.check([keys.roll_call_events(first + 2)])


def test_only_the_first_members_in_line_judge_and_the_rest_read_a_few_heartbeats():
    """zb.elastic.standby: the acting leader and the next two in line judge the roll call and read every heartbeat;
    every other member reads the heartbeats of the members ahead of it up to three plausibly in. A death (or a
    goodbye) ahead moves the next member into line."""
    world = World(version=1, resolution=1, nodes=[f"m{i}" for i in range(8)], tokens={f"m{i}": "t" for i in range(8)})
    live = Liveness(timeout=5.0)
    assert [m for m in world.nodes if standby.judges(world, m, live, set())] == ["m0", "m1", "m2"]
    assert standby.watched(world, "m1", live) == world.nodes and standby.watched(world, "m6", live) == ["m0", "m1", "m2"]
    read_unchanged(live, "m1", for_s=6)                  # m1 died: m3 judges, m6 reads one more
    assert [m for m in world.nodes if m != "m1" and standby.judges(world, m, live, set())] == ["m0", "m2", "m3"]
    assert standby.watched(world, "m6", live) == ["m0", "m1", "m2", "m3"]
    assert standby.judges(world, "m4", live, {"m0"}) and not standby.judges(world, "m5", live, {"m0"})
    assert standby.watched(None, "m0", live) == []
