"""Ring order from measured links: the bottleneck-cycle solver against brute force, the link
matrix file and its refusals, the leader's reordering of the world, and a real 3-node mesh whose
ring follows a link matrix while its all-reduce still sums correctly."""

from __future__ import annotations

import itertools
import json
import random
import time

import pytest

from zb.elastic.ring import RingPlanner, apply_ring_order, check_link_matrix, link_table
from zb.elastic.world import World
from zb.errors import InvalidInput
from zb.net.bottleneck import bottleneck, rotate_to, solve
from zb.net.link_matrix import parse_link_matrix


def brute_force(matrix) -> float:
    n = len(matrix)
    return max(bottleneck(matrix, (0, *rest)) for rest in itertools.permutations(range(1, n)))


def random_matrix(rng: random.Random, n: int, tiers: bool, holes: bool):
    def rate():
        return rng.choice([10, 20, 50, 100, 1000]) if tiers else rng.uniform(1, 1000)

    m = [[None if a == b else rate() for b in range(n)] for a in range(n)]
    if holes:  # failed or unmeasured links
        for _ in range(n):
            a, b = rng.randrange(n), rng.randrange(n)
            m[a][b] = None
    return m


@pytest.mark.parametrize("seed", range(6))
def test_solver_matches_brute_force_on_small_random_matrices(seed):
    rng = random.Random(seed)
    for trial in range(40):
        n = rng.randint(3, 8)
        m = random_matrix(rng, n, tiers=trial % 2 == 0, holes=trial % 5 == 0)
        r = solve(m)
        assert sorted(r.order) == list(range(n)) and r.order[0] == 0
        assert r.exact and r.bottleneck_mbps == pytest.approx(brute_force(m))
        assert r.bottleneck_mbps == pytest.approx(bottleneck(m, r.order))


def test_solver_is_deterministic_and_avoids_the_slow_link():
    m = [[None, 20, 100], [100, None, 100], [100, 100, None]]    # 0 -> 1 is slow: rank order uses it
    assert bottleneck(m, [0, 1, 2]) == 20
    r = solve(m)
    assert r.order == [0, 2, 1] and r.bottleneck_mbps == 100 and r.exact
    assert solve(m) == r


def test_solver_handles_trivial_sizes_and_no_data():
    assert solve([]).order == [] and solve([[None]]).order == [0]
    assert solve([[None, 5], [7, None]]).bottleneck_mbps == 5
    r = solve([[None] * 4 for _ in range(4)])          # nothing measured: some cycle, bottleneck 0
    assert sorted(r.order) == [0, 1, 2, 3] and r.bottleneck_mbps == 0


def test_solver_on_32_nodes_gives_a_cycle_no_worse_than_rank_order():
    rng = random.Random(7)
    for p in (0.1, 0.2, 0.5):
        m = [[None if a == b else (rng.uniform(500, 1000) if rng.random() < p else rng.uniform(1, 500))
              for b in range(32)] for a in range(32)]
        r = solve(m)
        assert sorted(r.order) == list(range(32))
        assert r.bottleneck_mbps >= bottleneck(m, list(range(32)))


@pytest.mark.perf
def test_solver_under_a_second_for_32_nodes():
    rng = random.Random(3)
    worst = 0.0
    for _ in range(20):
        p = rng.choice([0.05, 0.1, 0.2, 0.3, 1.0])
        m = [[None if a == b else (rng.uniform(500, 1000) if rng.random() < p else rng.uniform(1, 500))
              for b in range(32)] for a in range(32)]
        started = time.perf_counter()
        solve(m)
        worst = max(worst, time.perf_counter() - started)
    assert worst < 1.0


def test_rotate_keeps_the_cycle():
    assert rotate_to([0, 2, 1, 3], 1) == [1, 3, 0, 2]


# -- the link matrix file ------------------------------------------------------------------------------

def mesh_doc(matrix, addrs=None, nodes=None) -> str:
    n = len(matrix)
    addrs = addrs or [f"10.0.0.{i + 1}" for i in range(n)]
    doc = {"world_size": n, "hosts": {str(i): f"{a}:5000" for i, a in enumerate(addrs)}, "matrix_mbps": matrix}
    if nodes:
        doc["nodes"] = {str(i): u for i, u in enumerate(nodes)}
    return json.dumps(doc)


SLOW_AB = [[None, 20.0, 100.0], [100.0, None, 100.0], [100.0, 100.0, None]]


@pytest.mark.parametrize("text, why", [
    ("{", "not JSON"),
    ("[]", "not a zb iperf-mesh document"),
    (json.dumps({"hosts": {}, "matrix_mbps": [[None]]}), "square matrix"),
    (json.dumps({"hosts": {"0": "a:1"}, "matrix_mbps": [[None, 1], [1, None]]}), "no entry for rank 1"),
    (mesh_doc([[None, -3], [1, None]]), "matrix_mbps[0][1] = -3"),
    (mesh_doc([[None, "fast"], [1, None]]), "is not a rate"),
])
def test_bad_matrix_files_name_what_is_wrong(text, why):
    with pytest.raises(InvalidInput, match="elastic.link_matrix f.json") as e:
        parse_link_matrix(text, "f.json")
    assert why in str(e.value) and "zb iperf-mesh --json" in str(e.value)


def test_rows_match_by_id_then_by_unique_address():
    m = parse_link_matrix(mesh_doc(SLOW_AB, addrs=["10.0.0.1", "10.0.0.2", "10.0.0.2"], nodes=["a"]), "f")
    assert m.index_of("a", "10.9.9.9") == 0
    assert m.index_of("x", "10.0.0.1") == 0
    assert m.index_of("y", "10.0.0.2") is None           # two rows share it: ambiguous
    assert m.index_of("z", None) is None


def test_a_file_without_this_node_is_refused(tmp_path):
    path = tmp_path / "links.json"
    path.write_text(mesh_doc(SLOW_AB, nodes=["a", "b", "c"]))
    assert check_link_matrix(str(path), "b", "127.0.0.1") == path.read_text()
    with pytest.raises(InvalidInput, match="no row is this node \\(id d, gloo address 127.0.0.1\\)"):
        check_link_matrix(str(path), "d", "127.0.0.1")
    with pytest.raises(InvalidInput, match="cannot read it"):
        check_link_matrix(str(tmp_path / "missing.json"), "a", "127.0.0.1")


# -- the leader's plan ---------------------------------------------------------------------------------

class DictStore:
    """The four store calls zb.elastic.tcpstore.read_many makes."""

    def __init__(self, values: dict[str, bytes]) -> None:
        self.values = values

    def check(self, keys):
        return all(k in self.values for k in keys)

    def multi_get(self, keys):
        return [self.values[k] for k in keys]

    def get(self, key):
        return self.values[key]


def store_with(file_text=None, into=None, probes=None) -> DictStore:
    values = {}
    if file_text:
        values["zb/links/file"] = file_text.encode()
    for dst, row in (into or {}).items():
        values[f"zb/links/into/{dst}"] = json.dumps(row).encode()
        values["zb/links/measured"] = b"1"      # what a node publishing a row sets (zb.elastic.linkprobe)
    for uid, addr in (probes or {}).items():
        values[f"zb/probe/{uid}"] = f"{addr}:4000".encode()
    return DictStore(values)


def test_without_any_link_data_the_leader_reads_two_keys_not_every_member_s():
    """No link file and no measured row anywhere: rank order after two existence checks (with 1,000 members,
    reading 2N + 1 missing keys one at a time cost the leader 2,001 store round trips at every world written)."""
    store = store_with(probes={"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3"})
    asked: list[list[str]] = []
    real = store.check
    store.check = lambda keys: asked.append(list(keys)) or real(keys)   # type: ignore[method-assign]
    assert RingPlanner().plan(store, ["a", "b", "c"]) is None
    assert asked == [["zb/links/file"], ["zb/links/measured"]]


def test_plan_from_the_file_avoids_the_slow_link_and_keeps_the_leader_first():
    store = store_with(mesh_doc(SLOW_AB, nodes=["a", "b", "c"]))
    plan = RingPlanner().plan(store, ["a", "b", "c"])
    assert plan.nodes == ["a", "c", "b"] and plan.mbps == 100 and plan.rank_order_mbps == 20
    plan = RingPlanner().plan(store, ["b", "a", "c"])     # b leads: the same cycle, starting at b
    assert plan.nodes == ["b", "a", "c"] and plan.mbps == 100


def test_plan_matches_file_rows_by_gloo_address():
    store = store_with(mesh_doc(SLOW_AB), probes={"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3"})
    assert RingPlanner().plan(store, ["a", "b", "c"]).nodes == ["a", "c", "b"]


def test_measured_links_win_over_the_file():
    # The file says a -> b is slow; measurements say it is fine and c -> b is slow instead.
    into = {"b": {"a": 100, "c": 5}, "a": {"b": 100, "c": 100}, "c": {"a": 100, "b": 100}}
    store = store_with(mesh_doc(SLOW_AB, nodes=["a", "b", "c"]), into=into)
    plan = RingPlanner().plan(store, ["a", "b", "c"])
    assert plan.nodes == ["a", "b", "c"] and plan.mbps == 100 and plan.rank_order_mbps == 100


def test_unknown_links_keep_rank_order_with_one_warning(caplog):
    store = store_with(mesh_doc(SLOW_AB, nodes=["a", "b", "c"]))
    planner = RingPlanner()
    with caplog.at_level("WARNING", logger="zb.elastic"):
        assert planner.plan(store, ["a", "b", "c", "d"]) is None
        assert planner.plan(store, ["a", "b", "c", "d"]) is None
    warned = [r for r in caplog.records if "no link data" in r.getMessage()]
    assert len(warned) == 1 and "keeping rank order" in warned[0].getMessage()
    assert RingPlanner().plan(store_with(), ["a", "b", "c"]) is None       # no data at all: silent
    assert RingPlanner().plan(store, ["a", "b"]) is None                   # two nodes: one ring


def test_link_table_reads_measured_then_file():
    m = parse_link_matrix(mesh_doc(SLOW_AB, nodes=["a", "b", "c"]), "f")
    table, unknown = link_table(["a", "b", "x"], {("x", "a"): 7.0}, m, {})
    assert table[0][1] == 20 and table[2][0] == 7.0 and ("a", "x") in unknown and ("x", "a") not in unknown


def test_apply_bumps_the_version_only_when_the_order_changes():
    from zb.elastic.ring import RingPlan

    old = World(version=4, nodes=["a", "b", "c"])
    same = apply_ring_order(old, World(version=4, nodes=["a", "b", "c"]), RingPlan(["a", "b", "c"], 100, 100, True))
    assert same.version == 4 and same.ring_mbps == 100
    moved = apply_ring_order(old, World(version=4, nodes=["a", "b", "c"]), RingPlan(["a", "c", "b"], 100, 20, True))
    assert moved.version == 5 and moved.nodes == ["a", "c", "b"]
    joined = apply_ring_order(old, World(version=5, nodes=["a", "b", "c", "d"]),
                              RingPlan(["a", "d", "b", "c"], 50, 10, True))
    assert joined.version == 5 and World.decode(joined.encode()) == joined
    assert apply_ring_order(old, same, None) is same


# -- real processes ------------------------------------------------------------------------------------



def test_three_nodes_ring_follows_the_link_matrix(cluster, tmp_path):
    path = tmp_path / "links.json"
    path.write_text(mesh_doc(SLOW_AB, nodes=["a", "b", "c"]))
    nodes = cluster.start_world(3, ZB_ELASTIC_LINK_MATRIX=str(path))
    view = cluster.agreement(nodes, 3)               # every node summed correctly over the reordered groups
    assert view["nodes"] == ["a", "c", "b"]
    event = [e for e in nodes[0].events("membership") if e["nodes"] == ["a", "c", "b"]][0]
    assert event["ring_mbps"] == 100


def test_a_node_missing_from_the_matrix_exits_2(cluster, tmp_path):
    from zb.testing.procs import wait_until

    path = tmp_path / "links.json"
    path.write_text(mesh_doc(SLOW_AB, nodes=["a", "b", "c"]))
    node = cluster.start("zed", 0, 1, ZB_ELASTIC_LINK_MATRIX=str(path))
    wait_until(lambda: node.proc.poll() is not None, 60, "the node to exit")
    errors = node.events("error")
    assert node.proc.returncode == 2 and len(errors) == 1
    assert "no row is this node (id zed" in errors[0]["message"]


def test_backward_rings_count_the_transposed_links():
    # gloo's fp32 ring sends rank r -> r - 1: order [0, 1, 2] then uses 1 -> 0, 2 -> 1 and 0 -> 2.
    m = [[None, 100, 20], [100, None, 100], [100, 100, None]]    # 0 -> 2 slow
    r = solve(m, backward=True)
    assert r.order == [0, 2, 1] and r.bottleneck_mbps == 100
    assert bottleneck(m, r.order[::-1]) == 100 and bottleneck(m, [2, 1, 0]) == 20
    store = store_with(mesh_doc(m, nodes=["a", "b", "c"]))
    plan = RingPlanner(backward=True).plan(store, ["a", "b", "c"])
    assert plan.nodes == ["a", "c", "b"] and plan.rank_order_mbps == 20


def test_a_ring_within_ten_percent_of_the_best_is_kept():
    # Noisy background measurements: a -> b -> c -> a is 95 Mbit/s at worst, the best ring 100.
    near = {"b": {"a": 95, "c": 100}, "c": {"b": 100, "a": 100}, "a": {"c": 100, "b": 100}}
    plan = RingPlanner().plan(store_with(into=near), ["a", "b", "c"])
    assert plan.nodes == ["a", "b", "c"] and plan.mbps == 100 and plan.rank_order_mbps == 95
    far = {**near, "b": {"a": 80, "c": 100}}           # 20% slower: worth a rebuild
    assert RingPlanner().plan(store_with(into=far), ["a", "b", "c"]).nodes == ["a", "c", "b"]


def test_measured_rows_carry_round_trips_and_the_plan_the_longest_delay():
    """Rows as zb.elastic.linkprobe writes them ({"mbps", "rtt_ms"}) beside bare figures; the world's delay is half
    the longest round trip, and only when every ordered pair has one."""
    full = {"a": {"b": {"mbps": 100, "rtt_ms": 2.0}, "c": {"mbps": 100, "rtt_ms": 100.0}},
            "b": {"a": {"mbps": 100, "rtt_ms": 2.0}, "c": {"mbps": 100, "rtt_ms": 4.0}},
            "c": {"a": {"mbps": 100, "rtt_ms": 98.0}, "b": {"mbps": 100, "rtt_ms": 4.0}}}
    plan = RingPlanner().plan(store_with(into=full), ["a", "b", "c"])
    assert plan.mbps == 100 and plan.link_ms == 50.0
    world = apply_ring_order(World(version=1, nodes=["a", "b", "c"]), World(version=1, nodes=["a", "b", "c"]), plan)
    assert world.link_ms == 50.0 and World.decode(world.encode()) == world
    partial = {**full, "c": {"a": 100, "b": {"mbps": 100, "rtt_ms": 4.0}}}   # c -> a untimed: no delay for the world
    plan = RingPlanner().plan(store_with(into=partial), ["a", "b", "c"])
    assert plan.mbps == 100 and plan.link_ms is None


@pytest.mark.parametrize("row", [{"mbps": "fast", "rtt_ms": 1.0}, {"mbps": 100, "rtt_ms": -1.0},
                                 {"mbps": 100, "rtt_ms": 1e9}, {"mbps": True}, {"rtt_ms": 1.0}, "100", [100, 1.0],
                                 {"mbps": float("nan")}])
def test_a_row_figure_that_is_not_a_measurement_is_not_read(row):
    from zb.elastic.ring import read_links

    measured, _, _, delays = read_links(store_with(into={"b": {"a": row}}), ["a", "b"])
    assert ("a", "b") not in delays
    assert ("a", "b") not in measured or measured[("a", "b")] == 100   # a good Mbit/s figure stays, alone


@pytest.mark.parametrize("field,value", [("ring_mbps", "fast"), ("link_ms", -1), ("link_ms", True),
                                         ("link_ms", float("inf")), ("ring_mbps", [1])])
def test_a_world_whose_link_figures_are_not_numbers_is_not_a_world(field, value):
    """The link figures pick every node's reduce shape (zb.collectives.allreduce.pick_shape): a record holding
    anything but a finite non-negative number there reads as no world, like any malformed record."""
    raw = json.loads(World(version=1, nodes=["a"], tokens={"a": "t"}).encode())
    raw[field] = value
    assert World.decode(json.dumps(raw)) is None
    raw[field] = 12.5
    assert World.decode(json.dumps(raw)) is not None


def test_a_new_link_delay_is_a_new_mesh_version():
    """The delay picks the reduce's shape: a world whose delay changed is a new version even with the same order,
    and so is one that lost it (the plan gone: a pair no longer measured); an unchanged one keeps its version."""
    from zb.elastic.ring import RingPlan

    old = World(version=4, nodes=["a", "b", "c"], link_ms=None)
    timed = apply_ring_order(old, World(version=4, nodes=["a", "b", "c"]), RingPlan(["a", "b", "c"], 100, 100, True, 25.0))
    assert timed.version == 5 and timed.link_ms == 25.0
    again = apply_ring_order(timed, World(version=5, nodes=["a", "b", "c"]),
                             RingPlan(["a", "b", "c"], 100, 100, True, 25.0))
    assert again.version == 5
    lost = apply_ring_order(timed, World(version=5, nodes=["a", "b", "c"]), None)
    assert lost.version == 6 and lost.link_ms is None
