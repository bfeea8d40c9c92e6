"""A run with a secret (elastic.secret_file), for real: a `zb store` started with it and two `zb train` nodes
holding it. Records a test writes with a raw store client (a join request, a world, an address) are ignored by
every node; a node without the secret, or with another, is refused in one line (exit 2) before it writes
anything, so it is never handed the run's state."""

from __future__ import annotations

import json
from datetime import timedelta

from zb.elastic import keys
from zb.secret import read_secret, write_new_secret
from zb.signed_store import authenticated
from zb.testing.cluster import TrainCluster
from zb.testing.procs import zb_process


def _raw_client(port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=True, timeout=timedelta(seconds=30))


def test_a_run_with_a_secret_ignores_forged_records_and_refuses_nodes_without_it(tmp_path):
    secret = tmp_path / "run.secret"
    write_new_secret(secret)
    cluster = TrainCluster(tmp_path, 2, ZB_ELASTIC_SECRET_FILE=str(secret))
    try:
        for rank, uid in enumerate("ab"):
            cluster.start_train(uid, "--optim.total_steps", "40", rank=rank)
        cluster.wait_outer("a", 1)
        raw = _raw_client(cluster.port)
        honest = authenticated(_raw_client(cluster.port), read_secret(secret), "test", keys.is_counter)
        world = json.loads(honest.get(keys.WORLD))
        assert sorted(world["nodes"]) == ["a", "b"]
        # What someone who reaches the port but lacks the secret can write:
        raw.append(keys.JOINS, json.dumps({"uid": "rogue", "token": "t", "pref_rank": 0, "last_version": 0,
                                           "last_rank": 0, "stripes": 1, "run": ""}) + "\n")
        raw.add(keys.heartbeat("rogue"), 1)
        raw.set(keys.probe("rogue"), "127.0.0.1:9")
        forged = dict(world, nodes=[*world["nodes"], "rogue"], version=world["version"] + 1)
        raw.set(keys.WORLD, json.dumps(forged))

        env = {"GLOBAL_ADDR": "127.0.0.1", "GLOBAL_PORT": str(cluster.port), "GLOBAL_WORLD_SIZE": "2"}
        none = zb_process("train", *TrainCluster.ARGS, "--ckpt.path", str(tmp_path / "c"), timeout=120,
                          GLOBAL_UNIQUE_ID="c", **env)
        (tmp_path / "other.secret").write_text("another secret, of 32 characters\n")
        (tmp_path / "other.secret").chmod(0o600)
        other = zb_process("train", *TrainCluster.ARGS, "--ckpt.path", str(tmp_path / "d"),
                           "--secret-file", str(tmp_path / "other.secret"), timeout=120, GLOBAL_UNIQUE_ID="d", **env)
        assert none.returncode == 2 and "admits only nodes that hold its secret" in none.stderr
        assert other.returncode == 2 and "started with another secret" in other.stderr
        for refused in (none, other):
            assert [line for line in refused.stderr.splitlines() if line.startswith("error:")], refused.stderr

        for uid in "ab":
            assert cluster.finish(uid) == 0, cluster.log(uid)
        worlds = [e["nodes"] for uid in "ab" for e in cluster.metrics(uid, "membership")]
        assert worlds and not any({"rogue", "c", "d"} & set(nodes) for nodes in worlds)
        common = set(cluster.hashes("a")) & set(cluster.hashes("b"))
        assert common and all(cluster.hashes("a")[s] == cluster.hashes("b")[s] for s in common)
        logs = (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()
        assert "store record zb/joins does not open" in logs and "store record zb/world does not open" in logs
        assert "rejoining" not in logs   # the forged world is written over: not read as a restarted store
        # The refused nodes wrote nothing the run could act on: no heartbeat counter, no join request.
        assert not raw.check([keys.heartbeat("c")]) and not raw.check([keys.heartbeat("d")])
        assert b'"c"' not in honest.get(keys.JOINS) and b'"d"' not in honest.get(keys.JOINS)
    finally:
        cluster.close()
