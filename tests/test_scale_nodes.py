"""Sixteen real `zb train` nodes on one loopback store (soak: 16 processes on 2 cores take minutes): every node
that trained an outer step in a world holds the same params as every other node of that world, through a node
killed (SIGKILL) and a node joining mid-run; the int8 all-reduce takes halving-doubling at 16 nodes and at 15 the
ring (diloco.reduce_shape auto). What each part costs at 4 to 32 nodes is in BENCHMARKS.md "Scale"."""

from __future__ import annotations

import signal

import pytest

from zb.testing.cluster import hashes_by_mesh

NODES = 16


@pytest.mark.soak
def test_sixteen_nodes_agree_through_a_kill_and_a_join(make_run):
    run = make_run(NODES)
    uids = [f"n{i:02d}" for i in range(NODES)]
    args = ("--optim.total_steps", "100000", "--diloco.compression", "int8")
    for i, uid in enumerate(uids):
        run.start_train(uid, *args, rank=i)
    run.wait_outer(uids[0], 2, timeout=600)
    run.procs[uids[5]].kill()                           # a member gone without a word
    run.wait_for(uids[0], lambda: any(e["global_world_size"] == NODES - 1 for e in run.metrics(uids[0], "outer_step")),
                 "an outer step without the killed node", timeout=600)
    run.start_train("late", *args, rank=NODES)          # a joiner: back to 16
    run.wait_for("late", lambda: sum(e["global_world_size"] == NODES for e in run.metrics("late", "outer_step")) >= 2,
                 "two outer steps of the joiner in a world of 16", timeout=600)
    alive = [u for u in uids if u != uids[5]] + ["late"]
    for uid in alive:
        run.procs[uid].send_signal(signal.SIGTERM)
    for uid in alive:
        assert run.finish(uid, timeout=300) == 128 + signal.SIGTERM, run.log(uid)
    for size in (NODES, NODES - 1):
        hashes = {uid: hashes_by_mesh(run, uid, size) for uid in alive}
        keys = set.union(*(set(h) for h in hashes.values()))
        assert keys, f"no outer step in a world of {size}"
        for key in keys:
            held = {h[key] for h in hashes.values() if key in h}
            assert len(held) == 1, f"world of {size}, all-reduce {key}: {len(held)} different params"
    assert hashes_by_mesh(run, "late", NODES), "the joiner trained with the others"
