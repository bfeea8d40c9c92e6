"""Ring order from measured links: the leader orders the members of each new world by their links.

Both all-reduce paths send along global ranks: the int8 ring (zb.collectives.ring) from rank r to
r + 1, gloo's fp32 ring the same way, and every replica group and stream uses the world's rank
order. So the order is applied where ranks are made: the acting leader, which writes each new
world (zb.elastic.membership), lists its members in ring order. Every node reads the same world
record, so every node uses the same ring, and the DiLoCo layer needs no translation of ranks.

The link data is in the store, so any node can lead and derive the same order:
- keys.links_into(uid): the links into `uid` as `uid` timed them as the receiver, measured during
  the run in the background (elastic.measure_links, zb.elastic.linkprobe);
- keys.LINK_FILE: an `elastic.link_matrix` file (zb iperf-mesh --json), published by nodes given one.
  Its rows are matched to members by unique id or by the address in keys.probe(uid).
A measured link wins over the file. The solver (zb.net.bottleneck) works on the members sorted by
unique id, so the cycle depends only on who is in the world and on the data; it is then rotated to
start at the member that would be rank 0 anyway, so the leader does not change because of it.
If a member pair has no data at all, the ring keeps rank order (one warning per membership) until
the missing links are measured: a guess could put an unmeasured slow link in the ring. A ring whose
slowest hop is within KEEP_WITHIN of the best one found is kept as it is: measurements taken during
training are noisy, and moving every rank for a few percent would cost a group rebuild for nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zb.elastic import keys
from zb.elastic.tcpstore import read_many
from zb.elastic.world import World, is_figure
from zb.errors import InvalidInput
from zb.net.bottleneck import RingOrder, bottleneck, rotate_to, solve
from zb.net.link_matrix import LinkMatrix, load_link_matrix, parse_link_matrix

if TYPE_CHECKING:
    from zb.store_clients import StoreClient

log = logging.getLogger("zb.elastic")

KEEP_WITHIN = 0.9   # keep the current ring while its slowest hop is at least this share of the best ring's


@dataclass(frozen=True)
class RingPlan:
    nodes: list[str]                # members in ring order, starting at the would-be rank 0
    mbps: float                     # slowest hop of that ring
    rank_order_mbps: float          # slowest hop of the ring in the order the world had
    exact: bool                     # the solver proved no order has a faster slowest hop
    link_ms: float | None = None    # the longest one-way delay of the members' links (half the round trip
                                    # timed), when every ordered pair has one; for the reduce's shape


Links = dict[tuple[str, str], float | None]   # measured Mbit/s per (src, dst); None: measured, no answer
Delays = dict[tuple[str, str], float]         # measured round trip in ms per (src, dst)
MAX_RTT_MS = 60_000.0   # a round trip above a minute is no link's: a row claiming one is not read


def read_links(store: StoreClient, nodes: list[str]) -> tuple[Links, LinkMatrix | None, dict[str, str], Delays]:
    """(measured links {(src, dst): Mbit/s}, the published file, {uid: gloo address}, measured round trips
    {(src, dst): ms}) for `nodes`. A row's value is {"mbps": x, "rtt_ms": y} (zb.elastic.linkprobe), or a bare
    Mbit/s figure; anything else, or a figure that is not finite and non-negative, is not read."""
    raw = read_many(store, [keys.LINK_FILE] + [keys.links_into(u) for u in nodes] + [keys.probe(u) for u in nodes])
    matrix = None
    if raw[0]:
        try:
            matrix = parse_link_matrix(raw[0].decode(errors="replace"), "(published in the store)")
        except InvalidInput as e:
            log.warning("ignoring the link matrix in the store: %s", e)
    measured: Links = {}
    delays: Delays = {}
    for dst, value in zip(nodes, raw[1:1 + len(nodes)]):
        for src, row in _json_object(value).items():
            if src not in nodes or src == dst:
                continue
            if isinstance(row, dict) and "mbps" not in row:
                continue
            mbps, rtt = (row["mbps"], row.get("rtt_ms")) if isinstance(row, dict) else (row, None)
            if mbps is not None and not is_figure(mbps):
                continue
            measured[(src, dst)] = None if mbps is None else float(mbps)
            if rtt is not None and is_figure(rtt, MAX_RTT_MS):
                delays[(src, dst)] = float(rtt)
    addrs = {u: v.decode(errors="replace").rpartition(":")[0] for u, v in zip(nodes, raw[1 + len(nodes):]) if v}
    return measured, matrix, addrs, delays


def longest_delay_ms(nodes: list[str], delays: Delays) -> float | None:
    """Half the longest round trip among the ordered pairs of `nodes`, or None when a pair has none timed: the
    latency every step of a reduce among them may wait for (its slowest pair sets a step's pace)."""
    pairs = [(a, b) for a in nodes for b in nodes if a != b]
    if not pairs or any(p not in delays for p in pairs):
        return None
    return round(max(delays[p] for p in pairs) / 2, 3)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def link_table(nodes: list[str], measured: Links, matrix: LinkMatrix | None,
               addrs: dict[str, str]) -> tuple[list[list[float | None]], list[tuple[str, str]]]:
    """The Mbit/s matrix over `nodes` (measured first, then the file) and the pairs nobody knows."""
    rows = {u: matrix.index_of(u, addrs.get(u)) for u in nodes} if matrix else {}
    table: list[list[float | None]] = [[None] * len(nodes) for _ in nodes]
    unknown = []
    for a, src in enumerate(nodes):
        for b, dst in enumerate(nodes):
            if a == b:
                continue
            if (src, dst) in measured:
                table[a][b] = measured[(src, dst)]
            elif matrix is not None and (i := rows.get(src)) is not None and (j := rows.get(dst)) is not None:
                table[a][b] = matrix.mbps[i][j]   # rows is empty without a matrix
            else:
                unknown.append((src, dst))
    return table, unknown


class RingPlanner:
    """Used by the acting leader; remembers the last answer so an unchanged world costs one store read."""

    def __init__(self, backward: bool = False) -> None:
        self.backward = backward       # data flows rank r -> r - 1 (gloo's fp32 all-reduce), not r -> r + 1
        self._cache: tuple[tuple[tuple[str, ...], str], RingOrder] | None = None   # (members, table), its solution
        self._warned: tuple[str, ...] | None = None

    def plan(self, store: StoreClient, nodes: list[str]) -> RingPlan | None:
        """Ring order for `nodes` (in their rank order), or None: keep rank order."""
        if len(nodes) < 3:
            return None                # 1 or 2 nodes: every ring is the same ring
        if not store.check([keys.LINK_FILE]) and not store.check([keys.LINKS_MEASURED]):
            return None                # no link data at all: two requests, not 2N + 1 keys missing one by one
        members = sorted(nodes)
        measured, matrix, addrs, delays = read_links(store, members)
        table, unknown = link_table(members, measured, matrix, addrs)
        if unknown:
            self._warn_unknown(members, unknown, matrix is not None or bool(measured))
            return None
        key = (tuple(members), json.dumps(table))
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, solve(table, backward=self.backward))
        solved = self._cache[1]
        order = [members[i] for i in rotate_to(solved.order, members.index(nodes[0]))]
        old = [members.index(u) for u in nodes]
        old_mbps = bottleneck(table, old[::-1] if self.backward else old)
        if old_mbps >= KEEP_WITHIN * solved.bottleneck_mbps:
            order = list(nodes)   # good enough: no rebuild for noise
        return RingPlan(order, solved.bottleneck_mbps, old_mbps, solved.exact, longest_delay_ms(members, delays))

    def _warn_unknown(self, members: list[str], unknown: list[tuple[str, str]], have_data: bool) -> None:
        if not have_data or self._warned == tuple(members):
            return                     # no link data at all: rank order, as without this feature
        self._warned = tuple(members)
        shown = ", ".join(f"{a} -> {b}" for a, b in unknown[:3])
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        log.warning("ring order: no link data for %s%s; keeping rank order until they are measured "
                    "(elastic.measure_links on every node, or zb iperf-mesh --json and elastic.link_matrix)",
                    shown, more)


def apply_ring_order(old: World, new: World, plan: RingPlan | None) -> World:
    """`new` with its members in ring order and the plan's link figures. The mesh version bumps when only the
    order changed, and when only the link delay did: it picks every member's reduce shape
    (zb.collectives.allreduce.pick_shape), and a member that trains on with its last world while the store does
    not answer it must not meet the others with another shape, only fail on another mesh version as for any
    change."""
    if plan is not None:
        if plan.nodes != new.nodes:
            log.info("ring order: %s (slowest hop %.1f Mbit/s%s; rank order's: %.1f Mbit/s)",
                     " -> ".join(plan.nodes + plan.nodes[:1]), plan.mbps, "" if plan.exact else ", best found",
                     plan.rank_order_mbps)
        new = dataclasses.replace(new, nodes=plan.nodes, ring_mbps=round(plan.mbps, 3), link_ms=plan.link_ms)
    if new.version == old.version and (new.nodes != old.nodes or new.link_ms != old.link_ms):
        new = dataclasses.replace(new, version=new.version + 1)
    return new


def check_link_matrix(path: str, uid: str, addr: str) -> str:
    """The text of the elastic.link_matrix file, once it is known to hold this node; else InvalidInput.

    A file without this node was measured on other hosts (or before a move): refusing at start costs
    nothing, while ordering a ring by it would be silently wrong. Nodes that join later and are not
    in the file are no error: the ring keeps rank order until their links are measured.
    """
    matrix, text = load_link_matrix(path)
    if matrix.index_of(uid, addr) is None:
        raise InvalidInput(f"elastic.link_matrix {path}: no row is this node (id {uid}, gloo address {addr}); its "
                           f"hosts are {matrix.describe()}. Measure again on the run's hosts (zb iperf-mesh --json "
                           "--node-id ID), or unset elastic.link_matrix")
    return text


def publish_link_matrix(store: StoreClient, text: str, path: str) -> None:
    current = read_many(store, [keys.LINK_FILE])[0]
    if current and current.decode(errors="replace") != text:
        log.warning("elastic.link_matrix %s differs from the matrix another node published; this one replaces it "
                    "(give every node the same file)", path)
    store.set(keys.LINK_FILE, text)
