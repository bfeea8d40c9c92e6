"""The membership protocol at 200 members in one process: real `Membership` objects, each member a thread, over
one in-process store (torch's HashStore: a TCPStore client takes about 170 ms to connect here, 200 of them half a
minute; scripts/bench_scale.py runs the same protocol over a real `zb store` at up to 1,000 members). One thread
beats for all members and reads for each the counters its own heartbeat thread would (zb.testing.pump).

A join and a resolution agree on every member, and the store's requests per resolution stay a small constant a
member (zb.elastic.standby: only the first members in line judge the roll call; the rest wait for its end)."""

from __future__ import annotations

import torch.distributed as dist

from zb.config_schema import ElasticConfig
from zb.elastic import keys, standby
from zb.elastic.heartbeat import Liveness
from zb.elastic.membership import Membership
from zb.testing.pump import Pump
from zb.testing.store_count import Tally
from zb.testing.threads import each_at_once

MEMBERS = 200
CFG = ElasticConfig(store_timeout=300, polling_interval=0.05, sync_deadline=120, heartbeat_interval=0.5,
                    heartbeat_timeout=30.0, start_timeout=300)


def test_two_hundred_members_join_and_resolve_to_one_world_with_linear_store_work():
    store = dist.HashStore()
    tally = Tally()

    def connect():
        return tally.client(store)

    members = {f"m{i:03d}": Membership(CFG, f"m{i:03d}", f"tok-{i}", 1, Liveness(CFG.heartbeat_timeout), connect)
               for i in range(MEMBERS)}
    for m in members.values():
        m.ensure_store().add(keys.heartbeat(m.uid), 1)
    pump = Pump(lambda: store, list(members.values()), CFG.heartbeat_interval)
    pump.start()
    try:
        joined = each_at_once(members, members, lambda m: m.join(quorum=MEMBERS, quorum_timeout=300), 300)
        assert all(not isinstance(w, BaseException) for w in joined.values()), next(
            w for w in joined.values() if isinstance(w, BaseException))
        assert len({w.encode() for w in joined.values()}) == 1 and len(joined["m000"].nodes) == MEMBERS
        first = joined["m000"]
        assert sum(standby.judges(first, uid, members[uid].liveness, set()) for uid in first.nodes) == standby.STANDBY
        tally.clear()
        resolved = each_at_once(members, members, lambda m: m.resolve(), 300)
        worlds = {w.encode() for w in resolved.values() if not isinstance(w, BaseException)}
        assert len(worlds) == 1 and len(resolved) == MEMBERS, [w for w in resolved.values() if isinstance(w, BaseException)][:1]
        after = resolved["m000"]
        assert after.resolution == first.resolution + 1 and sorted(after.nodes) == sorted(first.nodes)
        # Every member: a light read (check + multi_get), its answer and wake-up (append, add, set), the wait, the
        # world with the light keys (check + multi_get): 8, the judges' reads on top (8.3 a member at 200). Every
        # member judging (before zb.elastic.standby) read the roll call at every answer: about 90 a member at 128.
        requests = tally.totals()["requests"]
        assert requests < 10 * MEMBERS, dict(tally.totals())
    finally:
        pump.stop()
