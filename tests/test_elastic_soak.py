"""The elastic failure tests, many times over (pytest -m soak; ELASTIC_SOAK_REPEATS=N, default 5).

False evictions and rare races only show up in repetition on a busy machine; each repeat gets a
fresh store and fresh processes.
"""

from __future__ import annotations

import os
from functools import partial

import pytest
import test_elastic_mesh as t

from zb.testing.cluster import Cluster

SCENARIOS = {
    "static": t.test_static_world_of_three,
    "join": t.test_join,
    "leave": t.test_graceful_leave,
    "sigkill-follower": partial(t.test_sigkill, victim="c"),
    "sigkill-leader": partial(t.test_sigkill, victim="a"),
    "sigterm": t.test_sigterm_sends_deathrattle,
    "sigstop-follower": partial(t.test_sigstop_evicted_then_rejoins, victim="c"),
    "sigstop-leader": partial(t.test_sigstop_evicted_then_rejoins, victim="a"),
    "two-deaths": t.test_two_deaths_at_once,
    "join-and-death": t.test_join_and_death_in_one_resolution,
    "duplicate-id": t.test_duplicate_unique_id_refused,
    "store-restart": t._store_restart,
}
REPEATS = int(os.environ.get("ELASTIC_SOAK_REPEATS", "5"))


@pytest.mark.soak
@pytest.mark.timeout(300)
@pytest.mark.parametrize("repeat", range(REPEATS))
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_soak(name, repeat, tmp_path):
    cluster = Cluster(tmp_path)
    cluster.start_store()
    try:
        SCENARIOS[name](cluster)
    finally:
        cluster.close()
