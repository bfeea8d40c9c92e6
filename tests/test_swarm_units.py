"""DiLoCo-SWARM pieces on their own: the stage split, the wire format, the routing rule, the registry."""

from __future__ import annotations

import socket
import struct

import pytest
import torch

from zb.config_schema import Config
from zb.models import Transformer, model_args
from zb.swarm import registry, wire
from zb.swarm.router import NoWorker, Router
from zb.swarm.stages import build_stage, split_blocks


def _args(n_layers: int = 4):
    cfg = Config()
    cfg.model.n_layers = n_layers
    return model_args(cfg.model, vocab_size=256, max_seq_len=32)


# -- stages ------------------------------------------------------------------------------------------
def test_split_balances_parameters_with_embeddings_first_and_head_last():
    args = _args(6)
    bounds = split_blocks(args, 3)
    assert bounds[0][0] == 0 and bounds[-1][1] == 6
    assert all(a < b for a, b in bounds) and all(bounds[i][1] == bounds[i + 1][0] for i in range(2))
    assert split_blocks(args, 2, "5,1") == [(0, 5), (5, 6)]


@pytest.mark.parametrize("stages, split, message", [(7, None, "only 6 blocks"), (2, "3,2", "holds 5 blocks")])
def test_split_refuses_what_cannot_be(stages, split, message):
    with pytest.raises(ValueError, match=message):
        split_blocks(_args(6), stages, split)


def test_stages_chained_equal_the_whole_model_forward_and_backward():
    args = _args(3)
    whole = Transformer(args)
    whole.init_weights(5)
    bounds = split_blocks(args, 3)
    stages = [build_stage(args, i, bounds, 5) for i in range(3)]
    tokens, labels = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    loss, _ = whole(tokens, labels=labels)
    loss.backward()
    h = tokens
    for s in stages[:-1]:
        h = s(h)
    piped, _ = stages[-1](h, labels=labels)
    piped.backward()
    assert torch.equal(loss, piped)
    names = dict(whole.named_parameters())
    for s in stages:
        for name, p in s.named_parameters():
            assert torch.allclose(p.grad, names[name].grad, atol=1e-6), name


def _server(args, stage_index: int = 1):
    from zb.models.loss import LossSpec
    from zb.swarm.server import StageServer

    stage = build_stage(args, stage_index, split_blocks(args, 2), 5)
    return StageServer(stage, "127.0.0.1", 0, hop_timeout=0.4, loss=LossSpec(0.0))


def test_a_restarted_worker_takes_the_runs_step_from_its_first_request_only():
    """Adoption (a worker restarting a stage that lost all its workers): the first request says where the run is.
    One that finds the run at this worker's own step disarms it: a later request for the next step is then the
    first stage running ahead of this worker's inner step, held and refused as for any worker, never computed
    on this step's params and counted into it."""
    args = _args(2)
    hidden = torch.randn(2, 16, args.dim)
    ahead = _server(args)
    ahead.adopt = True
    reply = ahead.handle(wire.Message(wire.FORWARD, 7, 0, {}, [hidden]))
    assert reply.kind == wire.REPLY and ahead.adopted == 7 and ahead.open_step == 7 and not ahead.adopt
    same = _server(args)
    same.adopt = True
    assert same.handle(wire.Message(wire.FORWARD, 0, 0, {}, [hidden])).kind == wire.REPLY
    assert not same.adopt and same.adopted is None
    early = same.handle(wire.Message(wire.FORWARD, 1, 1, {}, [hidden]))
    assert early.kind == wire.NOT_READY and same.open_step == 0
    for server in (ahead, same):
        server.close()


# -- wire ----------------------------------------------------------------------------------------------
def _pair():
    a, b = socket.socketpair()
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_wire_round_trip(dtype):
    a, b = _pair()
    tensors = [torch.randn(3, 5, 7).to(dtype), torch.arange(6).reshape(2, 3), torch.empty(0, 4)]
    msg = wire.Message(wire.BACKWARD, 12, 345, {"cu": 1, "owner": "x"}, tensors)
    sent = wire.send(a, msg, wire.deadline_in(5))
    got, size = wire.receive(b, wire.deadline_in(5))
    assert size == sent and (got.kind, got.step, got.mb, got.meta) == (wire.BACKWARD, 12, 345, {"cu": 1, "owner": "x"})
    for x, y in zip(tensors, got.tensors):
        assert x.dtype == y.dtype and torch.equal(x, y)


def _raw(msg: wire.Message) -> bytearray:
    return bytearray(b"".join(bytes(p) for p in wire.encode(msg)))


@pytest.mark.parametrize("damage, message", [
    (lambda r: r.__setitem__(slice(0, 4), b"EVIL"), "bad magic"),
    (lambda r: r.__setitem__(4, 9), "wire version 9"),
    (lambda r: r.__setitem__(-10, r[-10] ^ 0xFF), "checksum mismatch"),
])
def test_wire_refuses_damaged_messages(damage, message):
    raw = _raw(wire.Message(wire.FORWARD, 1, 2, {}, [torch.ones(4, 4)]))
    damage(raw)
    a, b = _pair()
    a.sendall(raw)
    with pytest.raises(wire.WireError, match=message):
        wire.receive(b, wire.deadline_in(2))


def test_wire_refuses_an_absurd_size_before_allocating():
    header = wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.FORWARD, 1, 0, 0, 0)
    dims = struct.pack("<BB3q", 0, 3, 1 << 20, 1 << 20, 1 << 20)
    a, b = _pair()
    a.sendall(header + dims)
    with pytest.raises(wire.WireError, match="larger than any micro-batch"):
        wire.receive(b, wire.deadline_in(2))


def test_wire_deadline_bounds_a_stalled_peer():
    a, b = _pair()
    a.sendall(_raw(wire.Message(wire.FORWARD, 1, 2, {}, [torch.ones(64)]))[:20])   # then silence
    with pytest.raises(wire.WireError, match="timed out|deadline"):
        wire.receive(b, wire.deadline_in(0.3))


# -- router ------------------------------------------------------------------------------------------
class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def test_router_sends_more_to_the_faster_worker():
    r = Router()
    r.set_workers(["fast", "slow"])
    for _ in range(400):
        uid = r.choose(1.0)
        r.done(uid, 1.0, 0.01 if uid == "fast" else 0.04)
    share = r.sent["fast"] / (r.sent["fast"] + r.sent["slow"])
    assert 0.7 < share < 0.9   # throughput 4:1 -> 80 %


def test_router_unmeasured_workers_are_all_tried_first():
    r = Router()
    r.set_workers(["a", "b", "c"])
    assert sorted(r.choose(5.0) for _ in range(3)) == ["a", "b", "c"]


def test_router_newcomer_is_probed_soon_and_dropped_worker_gets_nothing():
    clock = Clock()
    r = Router(ban_s=10, clock=clock)
    r.set_workers(["a"])
    for _ in range(50):
        r.done(r.choose(1.0), 1.0, 0.01)
    r.set_workers(["a", "b"])
    assert r.choose(1.0) == "b"   # enters at the current minimum busy time
    r.drop("b")
    assert {r.choose(1.0) for _ in range(5)} == {"a"}
    r.set_workers(["a", "b"])
    assert "b" not in r.live()      # banned for ban_s
    clock.now = 11
    r.set_workers(["a", "b"])
    assert "b" in r.live()
    with pytest.raises(NoWorker):
        r.choose(1.0, avoid={"a", "b"})
    r.drop("b")                        # b failed again; then a new process registers under its id
    r.renew("b")
    r.set_workers(["a", "b"])
    assert "b" in r.live() and r.choose(1.0) == "b"   # a newcomer at once, not banned for the dead one


def test_router_tries_again_a_worker_whose_first_request_was_slow():
    """A cold first request (connection, warm-up) must not starve a worker for good: once its estimated
    busy time has passed on the clock it is tried again and its estimate recovers."""
    clock = Clock()
    r = Router(clock=clock)
    r.set_workers(["a", "b"])
    r.done(r.choose(1.0), 1.0, 1.0)    # a: one slow cold request
    picks = []
    for _ in range(400):
        clock.now += 0.01
        uid = r.choose(1.0)
        r.done(uid, 1.0, 0.02)          # both are equally fast from now on
        picks.append(uid)
    assert "a" in picks[50:150] and 0.35 < picks[200:].count("a") / 200 < 0.65


def test_router_idle_workers_the_faster_still_gets_more():
    """A synchronous step starts with every worker idle: SWARM's least-busy rule alone would alternate between
    them; the earliest expected finish sends the faster one its share."""
    clock = Clock()
    r = Router(clock=clock)
    r.set_workers(["fast", "slow"])
    r.done("fast", 1.0, 0.01)
    r.done("slow", 1.0, 0.04)
    for _ in range(50):       # steps of 4 micro-batches, dispatched at once, each step after both are idle again
        for uid in [r.choose(1.0) for _ in range(4)]:
            r.done(uid, 1.0, 0.01 if uid == "fast" else 0.04)
        clock.now += 1.0
    assert r.sent["fast"] >= 3 * r.sent["slow"] > 0


def test_router_reprobes_a_worker_left_unmeasured():
    clock = Clock()
    r = Router(clock=clock, reprobe_s=20)
    r.set_workers(["fast", "slow"])
    r.done("fast", 1.0, 0.01)
    r.done("slow", 1.0, 1.0)
    assert r.choose(1.0) == "fast"
    clock.now = 30            # nothing measured "slow" for 30 s: it may have recovered
    r.done("fast", 1.0, 0.01)
    assert r.choose(1.0) == "slow"


def test_router_bias_corrected_average():
    r = Router()
    r.set_workers(["a"])
    r.done("a", 10.0, 1.0)
    assert r.throughputs()["a"] == pytest.approx(10.0)   # not 1.0: the first sample is not shrunk toward 0


# -- registry ----------------------------------------------------------------------------------------
@pytest.fixture()
def store():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)


def test_registry_workers_leave_and_rejoin(store):
    a1 = registry.Worker("a", "h:1", 0, "t1")
    registry.register(store, 1, a1)
    registry.register(store, 1, registry.Worker("b", "h:2", 3, "t2"))
    assert sorted(registry.workers(store, 1)) == ["a", "b"]
    registry.leave(store, a1, 7)
    assert sorted(registry.workers(store, 1)) == ["b"] and registry.left_after(store) == {"a": 7}
    registry.register(store, 1, registry.Worker("a", "h:3", 9, "t3"))   # restarted under the same id
    assert registry.workers(store, 1)["a"].address == "h:3"
    # b's process died and a new one started under its id: its old registration (a closed address, a heartbeat
    # counter the new process keeps moving) is nobody's any more, until the new one registers.
    registry.announce_start(store, 1, "b", "t4")
    assert sorted(registry.workers(store, 1)) == ["a"]
    registry.register(store, 1, registry.Worker("b", "h:4", 12, "t4"))
    assert registry.workers(store, 1)["b"].address == "h:4"


def test_stage_choice_spreads_simultaneous_starts_then_follows_throughput(store):
    picks = [registry.choose_stage(store, 3) for _ in range(3)]
    assert sorted(picks) == [0, 1, 2]
    for j, uid in enumerate(["a", "b", "c"]):
        registry.register(store, j, registry.Worker(uid, "h:1", 0, "t"))
    for uid, speed in (("a", 5.0), ("b", 1.0), ("c", 9.0)):
        registry.publish_speed(store, uid, speed)
    assert registry.choose_stage(store, 3) == 1


def test_stage_namespace_keeps_the_users_own():
    assert registry.stage_namespace("", 2) == "swarm/s2"
    assert registry.stage_namespace("runA", 0) == "runA/swarm/s0"


def test_namespaced_clients_do_not_see_each_other(store):
    from zb.elastic.keys import is_counter
    from zb.store_clients import run_client

    a = run_client("127.0.0.1", store.port, 30, 30, counters=is_counter, namespace="swarm/s0")
    b = run_client("127.0.0.1", store.port, 30, 30, counters=is_counter, namespace="swarm/s1")
    a.set("zb/world", "A")
    assert not b.check(["zb/world"]) and store.check(["swarm/s0/zb/world"])


def test_liveness_reads_the_heartbeats_a_stage_mesh_writes_under_a_user_namespace(store):
    """The stage's DiLoCo mesh bumps zb/hb/<uid> under <namespace>swarm/s<j>/; the swarm reads it from a client
    already under <namespace>."""
    import time

    from zb.elastic import keys
    from zb.elastic.keys import is_counter
    from zb.store_clients import run_client

    mesh_side = run_client("127.0.0.1", store.port, 30, 30, counters=is_counter,
                           namespace=registry.stage_namespace("runA", 0))
    link = registry.StoreLink(lambda: run_client("127.0.0.1", store.port, 30, 30, counters=is_counter, namespace="runA"))
    live = registry.Liveness(link, timeout=0.3)
    mesh_side.add(keys.heartbeat("u"), 1)
    assert live.alive(0, ["u"]) == {"u"}
    time.sleep(0.4)
    assert live.alive(0, ["u"]) == set()          # no beat within the timeout: dead
    mesh_side.add(keys.heartbeat("u"), 1)
    assert live.alive(0, ["u"]) == {"u"}


def test_store_link_falls_back_while_the_store_is_away_and_reconnects():
    import torch.distributed as dist

    from zb.elastic.keys import is_counter
    from zb.store_clients import run_client
    from zb.testing.procs import free_port

    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, use_libuv=True, wait_for_workers=False)
    link = registry.StoreLink(lambda: run_client("127.0.0.1", port, 3, 5, counters=is_counter))
    assert link.run(lambda s: s.add("n", 1)) == 1
    del host                                                   # the store goes away
    assert link.run(lambda s: s.add("n", 1), fallback="known") == "known"
    host = dist.TCPStore("127.0.0.1", port, is_master=True, use_libuv=True, wait_for_workers=False)  # noqa: F841 - restarted, held open
    assert link.run(lambda s: s.add("n", 1)) == 1              # a new, empty store: reconnected


def test_a_first_stage_worker_asks_whether_its_stage_run_ended_when_a_later_stage_has_no_worker(store):
    """A first-stage worker cut off until the others finished finds every later stage gone and never reaches its
    next outer step: its stage's end (run_over: zb.elastic.membership.check_finished) is asked as soon as a stage
    has no worker, so it stops with that line instead of waiting swarm.stage_wait. A worker of the final world
    (run_over says nothing) waits as before, asks again before giving up, and names the stage."""
    from zb.errors import EnvironmentFailure, RunFinishedWithout
    from zb.swarm.client import Hops

    link, asked = registry.StoreLink(lambda: store), []

    def ended() -> None:
        asked.append("late")
        raise RunFinishedWithout("the run finished without this node")

    msg = wire.Message(wire.FORWARD, 3, 0, {}, [torch.zeros(2)])
    late = Hops(link, 2, hop_timeout=1.0, stage_wait=600.0, heartbeat_timeout=5.0, run_over=ended)
    with pytest.raises(RunFinishedWithout):
        late.call(1, msg)
    final = Hops(link, 2, hop_timeout=1.0, stage_wait=0.3, heartbeat_timeout=5.0, run_over=lambda: asked.append("final"))
    with pytest.raises(EnvironmentFailure, match="stage 1 has had no live worker for 0.3 s"):
        final.call(1, msg)
    assert asked == ["late", "final", "final"]
