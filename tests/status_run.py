"""A live 2-node DiLoCo run for the `zb status` tests: a real `zb store` and two `zb train` nodes (a and
b) publishing their status every half second, plus a `zb status --serve` dashboard beside it."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

from zb.testing.cluster import TrainCluster
from zb.testing.procs import REPO, subprocess_env, wait_until

NODES = ("a", "b")


def start_run(tmp: Path, *args: str) -> TrainCluster:
    cluster = TrainCluster(tmp, len(NODES))
    for rank, uid in enumerate(NODES):
        cluster.start_train(uid, "--optim.total_steps", "100000", "--elastic.status_interval", "0.5", *args,
                            rank=rank)
    for uid in NODES:
        cluster.wait_outer(uid, 2)
    return cluster


def start_dashboard(cluster: TrainCluster) -> tuple[subprocess.Popen, str]:
    """`zb status --serve` on a free port; returns the process and the page's URL."""
    proc = subprocess.Popen([sys.executable, "-m", "zb", "status", "--serve", "--http-port", "0", "--interval", "0.5",
                             "--store", f"127.0.0.1:{cluster.port}", "--json"], stdout=subprocess.PIPE,
                            stderr=open(cluster.tmp / "dashboard.log", "w"), text=True, env=subprocess_env(), cwd=REPO)
    line = proc.stdout.readline()
    assert line, (cluster.tmp / "dashboard.log").read_text()
    return proc, json.loads(line)["url"]


def api(url: str) -> dict:
    with urllib.request.urlopen(url + "api/status", timeout=10) as r:
        return json.loads(r.read())


def wait_for_curves(url: str, points: int = 3) -> dict:
    """Until the dashboard has both nodes training with `points` step points each."""
    def ready():
        doc = api(url)
        training = {n["uid"] for n in doc["nodes"] if n["state"] == "training"}
        curves = all(len(doc["history"].get(u, {}).get("steps", [])) >= points for u in NODES)
        return doc if training == set(NODES) and curves else None

    return wait_until(ready, 60, "both nodes training with curves on the dashboard")
