"""Live recovery across network namespaces with shaped uplinks: a real `zb ckpt-serve` peer is
SIGKILLed mid-download and the joiner finishes from the other one.

Uses the temporary topology helper of scripts/ (to be replaced by zb.net.netns).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import load_script

from zb.testing.procs import REPO

pytestmark = pytest.mark.netns



@pytest.fixture
def topology():
    netns = load_script("_bench_netns")
    reason = netns.available()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    with netns.Topology(["p0", "p1", "j"], net=78) as topo:
        for host in ("p0", "p1"):
            topo.shape_uplink(host, 40)
        yield topo


def test_peer_killed_mid_download_on_shaped_links(topology, tmp_path):
    from zb.ckpt.format.snapshot import load_snapshot, write_snapshot

    bench = load_script("bench_recovery")
    tensors = {"model.safetensors": {"w": torch.randn(6 << 20)}}  # 24 MB: ~5 s from one 40 Mbit peer alone
    root = tmp_path / "p0"
    write_snapshot(root, tensors, {}, 7)
    shutil.copytree(root, tmp_path / "p1")
    servers = [bench.start_server(tmp_path / h, topology.addresses[h], bench.PORT, topology.exec_prefix(h))
               for h in ("p0", "p1")]
    dest = tmp_path / "dest"
    spec = json.dumps({"peers": [addr for _, addr in servers], "dest": str(dest)})
    client = subprocess.Popen([*topology.exec_prefix("j"), sys.executable, str(REPO / "scripts" / "bench_recovery.py"),
                               "--client", spec], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        partial = dest / ".tmp-step-000000007" / "model.safetensors"
        deadline = time.monotonic() + 60
        while not partial.exists() and client.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the download has started once its file exists
        time.sleep(1.2)
        assert client.poll() is None, client.communicate()
        servers[1][0].send_signal(signal.SIGKILL)  # about half of the bytes are in
        out, err = client.communicate(timeout=60)
        assert client.returncode == 0, err
        seconds = json.loads(out.strip().splitlines()[-1])["seconds"]
        assert seconds < 4.6, seconds  # both peers served until the kill: faster than one alone (~5 s)
        loaded, _ = load_snapshot(dest / "step-000000007")
        assert torch.equal(loaded["model.safetensors"]["w"], tensors["model.safetensors"]["w"])
    finally:
        client.kill()
        bench._stop([proc for proc, _ in servers])
