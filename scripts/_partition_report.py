"""What scripts/bench_partition.py measures, read from the nodes' own metrics events (pure functions, tested in
tests/test_bench_partition.py): the world each applied outer step ran in, whether two worlds applied outer
steps at overlapping times, when the run was one world of all its nodes again, what a cut cost each side, and
whether the nodes that reached the last outer step hold one params_hash.

Everything here is measured from outside zb's decisions: wall-clock times of the `outer_step` events a node
logged with `applied` true, grouped by the world named in its `membership` events.
"""

from __future__ import annotations

from dataclasses import dataclass

World = tuple[int, tuple[str, ...] | None]   # (mesh version, its nodes as the node's membership event named them)


@dataclass(frozen=True)
class Applied:
    time: float
    uid: str
    outer_step: int
    params_hash: str | None


def by_world(events_by_uid: dict[str, list[dict]]) -> dict[World, list[Applied]]:
    """Every node's applied outer steps keyed by the world they ran in: the mesh version and the node list of the
    node's newest membership event for that version. The node list tells apart two worlds that carry one version
    number on two stores."""
    out: dict[World, list[Applied]] = {}
    for uid, events in events_by_uid.items():
        nodes: dict[int, tuple[str, ...]] = {}
        for e in sorted(events, key=lambda e: e["time"]):
            if e.get("event") == "membership":
                nodes[e["mesh_version"]] = tuple(e["nodes"])
            elif e.get("event") == "outer_step" and e.get("applied"):
                key = (e["mesh_version"], nodes.get(e["mesh_version"]))
                out.setdefault(key, []).append(Applied(e["time"], uid, e["outer_step"], e.get("params_hash")))
    return out


def two_worlds(worlds: dict[World, list[Applied]]) -> list[str]:
    """Pairs of worlds that applied outer steps at overlapping times with no node in common: two sides training
    apart. Within the overlap, the nodes that applied in each world are compared (a node still applying in an
    old world alone while the others went on in a new one counts), and so are the worlds' whole node sets (one
    world pausing while the other trained, then going on)."""
    out, keys = [], sorted(worlds, key=lambda k: (k[0], k[1] or ()))
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            lo = max(min(x.time for x in worlds[a]), min(x.time for x in worlds[b]))
            hi = min(max(x.time for x in worlds[a]), max(x.time for x in worlds[b]))
            if lo > hi:
                continue
            in_a = {x.uid for x in worlds[a] if lo <= x.time <= hi}
            in_b = {x.uid for x in worlds[b] if lo <= x.time <= hi}
            apart = (in_a and in_b and in_a.isdisjoint(in_b)) or \
                {x.uid for x in worlds[a]}.isdisjoint({x.uid for x in worlds[b]})
            if apart:
                out.append(f"mesh v{a[0]} ({sorted(in_a or {x.uid for x in worlds[a]})}) and mesh v{b[0]} "
                           f"({sorted(in_b or {x.uid for x in worlds[b]})}) applied outer steps at overlapping "
                           f"times ({lo:.2f}-{hi:.2f})")
    return out


def reunited(worlds: dict[World, list[Applied]], uids: list[str], cut_at: float,
             heal_at: float | None) -> tuple[float, World] | None:
    """The earliest time every node of `uids` had applied an outer step in one world of exactly them after the
    cut, and that world; None while there is none. A world formed after the cut counts from the cut (the run may
    be whole again before the heal); the world of before the cut counts only for steps after the heal (it
    went on unchanged)."""
    best = None
    for key, applied in worlds.items():
        members = set(key[1]) if key[1] is not None else {x.uid for x in applied}
        if members != set(uids):
            continue
        old = any(x.time <= cut_at for x in applied)
        since = (heal_at if heal_at is not None else float("inf")) if old else cut_at
        firsts: dict[str, float] = {}
        for x in applied:
            if x.time > since:
                firsts[x.uid] = min(firsts.get(x.uid, x.time), x.time)
        if set(firsts) == set(uids) and (best is None or max(firsts.values()) < best[0]):
            best = (max(firsts.values()), key)
    return best


def side_cost(worlds: dict[World, list[Applied]], side: list[str], cut_at: float, heal_at: float | None,
              end: float, open_end: bool = False) -> dict:
    """What the cut cost one side (its nodes' applied outer steps, any world): the time from the cut to its next
    applied outer step (None: none until `end`), the longest time it went without one, from its last before the
    cut to `end` (`open_end`: the run never became whole, so the wait up to `end` counts too), and how many outer
    steps it applied while the cut was held (heal_at None: the cut is never healed, up to `end`)."""
    times = sorted({x.time for applied in worlds.values() for x in applied if x.uid in side})
    before = [t for t in times if t <= cut_at]
    after = [t for t in times if cut_at < t <= end]
    points = [before[-1] if before else cut_at, *after, *([end] if open_end else [])]
    held_until = heal_at if heal_at is not None else end
    during = {(key[0], x.outer_step) for key, applied in worlds.items() for x in applied
              if x.uid in side and cut_at < x.time <= held_until}
    return {"next_s": round(after[0] - cut_at, 2) if after else None,
            "gap_s": round(max(b - a for a, b in zip(points, points[1:])), 2) if len(points) > 1 else None,
            "during": len(during)}


def last_agreement(worlds: dict[World, list[Applied]]) -> dict:
    """The nodes whose last applied outer step is the run's last one, and whether they hold one params_hash."""
    last: dict[str, Applied] = {}
    for applied in worlds.values():
        for x in applied:
            if x.uid not in last or x.time > last[x.uid].time:
                last[x.uid] = x
    if not last:
        return {"last_step": None, "reached": [], "same_hash": False}
    top = max(x.outer_step for x in last.values())
    reached = {u: x.params_hash for u, x in sorted(last.items()) if x.outer_step == top}
    same = len(set(reached.values())) == 1 and None not in reached.values()
    return {"last_step": top, "reached": sorted(reached), "same_hash": same}
