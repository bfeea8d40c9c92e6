"""Elastic membership over the global store: who is in the run, and the global groups between them.

Knows nothing of training. The DiLoCo layer drives it at outer-step boundaries:

    from zb.elastic import ElasticDeviceMesh

    mesh = ElasticDeviceMesh(cfg.elastic, local_group,          # None for a 1-process node
                             local_rank=lw.rank, stripes=lw.world_size,   # replica groups of the run
                             sink=metrics)                      # anything with .log(event, **fields)
    view = mesh.start()          # connect, check the id, heartbeat, join; waits for the quorum
    if view.is_joiner:           # new (or evicted and back): fetch state from a live node
        ...
    while training:
        ...H inner steps (no global traffic; heartbeats go on in a thread)...
        view = mesh.resolve()    # Prime's maybe_reinit(): admit joiners, drop leavers/dead/late
        try:
            all_reduce(pseudo_grad, group=mesh.global_pg)   # this local rank's replica group (None: it has none)
        except PeerFailure as e:
            mesh.report_failure(e.rank)   # group rank of the suspect, or None; then resolve + retry
    mesh.shutdown(graceful=True)  # deathrattle: peers drop this node at their next resolution

WorldView (zb.elastic.view): mesh_version, global_rank, global_world_size, nodes (unique ids by
rank), leader, joined / left / died (changes made by the last resolution), is_joiner, changed (the
global groups were rebuilt), store_ok (False: the store was unreachable and this is the previous
world; keep training and call resolve again at the next outer step).

Every local rank calls the same methods in the same order; local rank 0 decides and broadcasts.
Waits and the config keys (section `elastic`) that bound them:
- start: store connection `connect_timeout`; quorum of `world_size` nodes `start_timeout`;
  admission of a joiner `store_timeout`; an old node with the same id `heartbeat_timeout`.
- resolve: a member that has not answered `sync_deadline`; a silent one `heartbeat_timeout`;
  one blamed by report_failure `heartbeat_interval`; a leader that does not write the next world
  2 x `sync_deadline` + `heartbeat_timeout`; building the global groups `pg_timeout`.
- every collective on global_pg: `pg_timeout` (callers should bound each transfer tighter).
- after a failed collective and before building the global groups: one connect to every member's
  probe listener, min(2 s, `heartbeat_timeout` / 2); silent members are reported in its answer and
  the judge keeps no two nodes that cannot reach each other in one world; a rejoin waits for them
  up to `store_timeout`.

Membership events go to the logs and to `sink.log("membership", mesh_version=..., global_world_size=...,
leader=..., joined=[...], left=[...], died=[...], global_rank=..., new_leader=bool)`.
Modules: keys (every store key), tcpstore (client, host, reads), identity, heartbeat, deathrattle,
probe (reachability), world (the record and its pure update rule), store_state (one read of the
store's membership keys), judge (deadlines and the acting leader), membership (the protocol),
localsync, view, mesh, storehost.
"""

from zb.elastic.mesh import ElasticDeviceMesh, EventSink
from zb.elastic.view import WorldView

__all__ = ["ElasticDeviceMesh", "EventSink", "WorldView"]
