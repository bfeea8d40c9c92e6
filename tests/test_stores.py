"""Store failover's decisions (zb.elastic.stores, zb.addresses) as pure functions, and the config's answers
to a bad store list."""

from __future__ import annotations

import time

import pytest

from zb.addresses import StoreAddress, parse_stores
from zb.config import load_config
from zb.elastic.stores import (
    JOIN,
    MOVE,
    OTHER_RUN,
    REFORM,
    TRAIN_ON,
    WAIT,
    StoreList,
    arrival,
    boundary_action,
    reform_quorum,
    start_index,
)
from zb.errors import InvalidInput


def test_a_list_parses_in_failover_order_with_the_default_port():
    assert parse_stores("a.example,10.0.0.2:29700, [::1]:29800,fe80::1", 29600) == [
        StoreAddress("a.example", 29600), StoreAddress("10.0.0.2", 29700), StoreAddress("::1", 29800),
        StoreAddress("fe80::1", 29600)]
    assert str(StoreAddress("::1", 29800)) == "[::1]:29800"


@pytest.mark.parametrize("text, says", [
    ("a,,b", "has an empty entry"),
    ("a:29600,a", "names the store a:29600 twice"),
    ("a:0", "port '0'"),
    ("a:http", "port 'http'"),
    (":29600", "has no host"),
])
def test_a_bad_list_is_one_line_naming_what_is_wrong(text, says):
    with pytest.raises(InvalidInput, match=says) as e:
        parse_stores(text, 29600)
    assert "elastic.addr (GLOBAL_ADDR)" in str(e.value) and "\n" not in str(e.value)


def test_the_config_refuses_a_bad_list_and_warns_when_failover_has_nothing_to_do(caplog):
    with pytest.raises(InvalidInput, match="elastic.addr = 'a,,b'.*failover order"):
        load_config([], {"elastic.addr": "a,,b"}, environ={})
    with pytest.raises(InvalidInput, match="DiLoCo-SWARM run does not fail over"):
        load_config([], {"elastic.addr": "a,b", "swarm.stages": "2", "diloco.inner_steps": "2"}, environ={})
    with pytest.raises(InvalidInput, match="elastic.store_failover_s.*must exceed elastic.heartbeat_interval"):
        load_config([], {"elastic.addr": "a,b", "elastic.store_failover_s": "1"}, environ={})
    caplog.set_level("WARNING")
    load_config([], {"elastic.addr": "a", "elastic.store_failover_s": "5"}, environ={})
    assert "elastic.store_failover_s" in caplog.text and "one store" in caplog.text
    caplog.clear()
    cfg = load_config([], {}, environ={"GLOBAL_ADDR": "a:29601,b:29602", "ZB_ELASTIC_STORE_FAILOVER_S": "5"})
    assert cfg.elastic.addr == "a:29601,b:29602" and not caplog.text


def test_a_starting_node_goes_where_the_run_is():
    assert start_index([False, False]) == 0                 # a new run: the first store
    assert start_index([None, False]) == 1                  # the first does not answer: the next that does
    assert start_index([False, True]) == 1                  # the first came back empty after the run moved on
    assert start_index([True, False, True]) == 2            # the latest store the run formed on
    assert start_index([None, None]) is None                # none answers: the usual failure


def test_at_a_silent_boundary_a_node_trains_on_waits_or_moves():
    assert boundary_action(1000.0, 30.0, has_next=False) == TRAIN_ON   # one store: as before failover existed
    assert boundary_action(5.0, 30.0, has_next=True) == WAIT
    assert boundary_action(30.0, 30.0, has_next=True) == MOVE


def test_at_the_next_store_a_node_reforms_joins_or_refuses_another_run():
    assert arrival("run-1", None) == REFORM
    assert arrival("run-1", "run-1") == JOIN
    assert arrival("run-1", "run-2") == OTHER_RUN
    assert arrival("", "run-2") == JOIN          # a node of no run yet (it was joining): the run it finds


def test_the_world_reforms_with_a_strict_majority_of_the_last_one():
    assert [reform_quorum(n) for n in (1, 2, 3, 4, 5, 6)] == [1, 2, 2, 3, 3, 4]
    # the movers and the nodes left behind on the earlier store can never both hold a majority
    for n in range(1, 9):
        assert all(not (moved >= reform_quorum(n) and n - moved >= reform_quorum(n)) for moved in range(n + 1))


def test_the_store_list_moves_forward_only_and_times_silence_from_the_last_answer():
    stores = StoreList(parse_stores("a:1,b:2,c:3", 29600), failover_s=30.0)
    assert str(stores.current) == "a:1" and stores.has_next and stores.text == "a:1,b:2,c:3"
    stores.answered()
    assert stores.silent_s() < 5.0
    moved = stores.move()
    assert (moved.from_store, moved.to_store, moved.index) == ("a:1", "b:2", 1)
    assert stores.silent_s() < 5.0              # the new store gets its own elastic.store_failover_s
    stores.follow(0)                            # a local rank told an older index keeps the newer one
    assert stores.index == 1
    stores.follow(2)
    assert str(stores.current) == "c:3" and not stores.has_next
    with pytest.raises(AssertionError):
        stores.move()
    assert [f.to_store for f in stores.failovers] == ["b:2"]


def test_a_node_that_went_back_has_left_nothing():
    """Chaos seed 18: a mover that went back to the store it left still named that store as the one it left, looked
    back at it (the store it was on) after a restart there, and hit back()'s assertion: the node exited 1."""
    stores = StoreList(parse_stores("a:1,b:2", 29600), failover_s=30.0)
    assert stores.left is None
    stores.move()
    assert stores.left == 0
    stores.back(0, "the run went on at a:1")
    assert stores.index == 0 and stores.left is None


def test_silence_grows_without_answers():
    stores = StoreList(parse_stores("a:1,b:2", 29600), failover_s=0.05)
    time.sleep(0.06)   # the silence measured on the list's own clock: no store involved
    assert boundary_action(stores.silent_s(), stores.failover_s, stores.has_next) == MOVE
