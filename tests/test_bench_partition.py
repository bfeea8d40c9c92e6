"""scripts/bench_partition.py: its arguments and the measures it reads from the nodes' events (fast), and one
shape end to end in network namespaces (netns: root, iproute2, nft)."""

from __future__ import annotations

import pytest
from conftest import load_script

ALL = ["n0", "n1", "n2", "n3"]


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_partition")


@pytest.fixture(scope="module")
def report():
    return load_script("_partition_report")


def _world(version: int, nodes: list[str], t: float) -> list[dict]:
    return [{"event": "membership", "time": t, "mesh_version": version, "nodes": nodes, "node": u} for u in nodes]


def _steps(version: int, nodes: list[str], times: list[float], first: int = 1, h: str = "h") -> list[dict]:
    return [{"event": "outer_step", "time": t + 0.01 * i, "mesh_version": version, "outer_step": first + k,
             "applied": True, "params_hash": f"{h}{first + k}", "global_world_size": len(nodes), "node": u}
            for k, t in enumerate(times) for i, u in enumerate(nodes)]


def _by_uid(*lists: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {u: [] for u in ALL}
    for events in lists:
        for e in events:
            out[e["node"]].append(e)
    return out


def test_arguments_pick_shapes_in_order_and_refuse_a_cut_shorter_than_the_timeouts(bench):
    args = bench.parse_args([])
    assert [s.name for s in args.shapes] == ["cut1", "cut2", "cut1-ab", "cut2-ab", "cut3-ab", "groups", "silent-a"]
    assert args.cut_s > max(bench.HEARTBEAT_TIMEOUT, args.failover_s)
    assert [s.name for s in bench.parse_args(["--shapes", "groups,cut1"]).shapes] == ["groups", "cut1"]
    quick = bench.parse_args(["--quick", "--shapes", "cut1"])
    assert quick.cut_s == max(bench.HEARTBEAT_TIMEOUT, quick.failover_s) + 3 and quick.before == 2
    for bad in (["--shapes", "cut9"], ["--shapes", ","], ["--cut-s", "5"], ["--failover-s", "30"], ["--repeats", "0"]):
        with pytest.raises(SystemExit) as exc:
            bench.parse_args(bad)
        assert exc.value.code == 2, bad


def test_the_sides_of_each_shape(bench):
    shapes = bench.BY_NAME
    assert shapes["cut3-ab"].sides() == {"store": ["n0"], "cut": ["n1", "n2", "n3"]}
    assert shapes["cut1"].sides() == {"store": ["n0", "n1", "n2"], "cut": ["n3"]}
    assert shapes["groups"].sides() == {"n0,n1": ["n0", "n1"], "n2,n3": ["n2", "n3"]}
    assert shapes["silent-a"].sides() == {"all": ALL} and shapes["silent-a"].failover
    assert bench.settings(shapes["cut2-ab"], 5.0) == "A,B; store_failover_s 5" and bench.settings(shapes["cut2"], 5) == "A"


def test_one_world_after_another_is_no_split_and_the_run_is_whole_again_in_the_new_world(report):
    events = _by_uid(_world(1, ALL, 0), _steps(1, ALL, [1, 2, 3]), _world(2, ALL[:3], 10),
                     _steps(2, ALL[:3], [11, 12], first=4), _world(3, ALL, 20), _steps(3, ALL, [21, 22], first=6))
    worlds = report.by_world(events)
    assert report.two_worlds(worlds) == []
    when, world = report.reunited(worlds, ALL, cut_at=5, heal_at=15)
    assert world == (3, tuple(ALL)) and when == pytest.approx(21.03)
    assert report.last_agreement(worlds) == {"last_step": 7, "reached": ALL, "same_hash": True}


def test_two_sides_applying_at_once_are_found_even_with_one_version_number_on_two_stores(report):
    store_a = _world(2, ALL[:2], 10) + _steps(2, ALL[:2], [11, 12, 13], first=4, h="a")
    store_b = _world(2, ALL[2:], 10) + _steps(2, ALL[2:], [11.5, 12.5], first=4, h="b")
    worlds = report.by_world(_by_uid(_world(1, ALL, 0), _steps(1, ALL, [1, 2, 3]), store_a, store_b))
    found = report.two_worlds(worlds)
    assert len(found) == 1 and "['n0', 'n1']" in found[0] and "['n2', 'n3']" in found[0]


def test_a_node_applying_alone_in_the_old_world_while_the_others_went_on_is_a_split(report):
    alone = [e for e in _steps(1, ALL, [12, 13], first=4) if e["node"] == "n3"]
    worlds = report.by_world(_by_uid(_world(1, ALL, 0), _steps(1, ALL, [1, 2, 3]), alone, _world(2, ALL[:3], 10),
                                     _steps(2, ALL[:3], [11, 12.5, 14], first=4)))
    assert any("['n3']" in f for f in report.two_worlds(worlds))


def test_the_old_world_counts_as_whole_again_only_after_the_heal(report):
    worlds = report.by_world(_by_uid(_world(1, ALL, 0), _steps(1, ALL, [1, 2, 3, 6, 16, 17])))
    when, world = report.reunited(worlds, ALL, cut_at=5, heal_at=15)
    assert world[0] == 1 and when == pytest.approx(16.03)
    assert report.reunited(worlds, ALL, cut_at=5, heal_at=None) is None       # never healed: a new world is needed


def test_a_sides_cost_from_its_own_applied_outer_steps(report):
    worlds = report.by_world(_by_uid(_world(1, ALL, 0), _steps(1, ALL, [1, 2, 3]), _world(2, ALL[:3], 10),
                                     _steps(2, ALL[:3], [11, 12], first=4), _world(3, ALL, 20),
                                     _steps(3, ALL, [21, 22], first=6)))
    store = report.side_cost(worlds, ALL[:3], cut_at=5, heal_at=15, end=21.03)
    assert store == {"next_s": 6.0, "gap_s": pytest.approx(21 - 12.02), "during": 2}   # the wait for n3
    cut = report.side_cost(worlds, ["n3"], cut_at=5, heal_at=15, end=21.03)
    assert cut == {"next_s": pytest.approx(16.03), "gap_s": pytest.approx(18.0), "during": 0}
    stuck = report.side_cost(worlds, ["n3"], cut_at=5, heal_at=15, end=19, open_end=True)
    assert stuck["next_s"] is None and stuck["gap_s"] == pytest.approx(19 - 3.03)


def test_a_hash_mismatch_at_the_last_outer_step_is_reported(report):
    events = _by_uid(_world(1, ALL, 0), _steps(1, ALL, [1, 2]))
    events["n2"][-1] = {**events["n2"][-1], "params_hash": "other"}
    agreement = report.last_agreement(report.by_world(events))
    assert agreement["last_step"] == 2 and not agreement["same_hash"]


def test_the_table_and_the_failures_of_a_row(bench, capsys):
    row = {"shape": "cut1", "settings": "A", "round_s": 0.4, "one_world_after_cut_s": 25.8, "one_world_s": 5.8,
           "two_worlds": [], "same_hash": True, "last_step": 9, "reached": ALL, "exited_early": {},
           "sides": [{"side": "store", "nodes": ALL[:3], "next_s": 5.3, "gap_s": 5.4, "during": 15},
                     {"side": "cut", "nodes": ["n3"], "next_s": None, "gap_s": 14.0, "during": 0}]}
    bench.print_table([row])
    out = capsys.readouterr().out
    assert "cut1" in out and "never" in out and "n0,n1,n2" in out
    assert bench.failed(row) == []
    assert bench.failed({**row, "one_world_after_cut_s": None, "two_worlds": ["x"]})[:2] == [
        "x", "no one world of all 4 within the bound (exited: none)"]


@pytest.mark.netns
@pytest.mark.timeout(420)
def test_one_shape_end_to_end_in_namespaces(bench, tmp_path, capsys):
    reason = load_script("_chaos_netns").unavailable()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    assert bench.main(["--quick", "--shapes", "cut1", "--keep", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "cut1" in out and '"failures": []' in out
