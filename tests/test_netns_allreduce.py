"""All-reduce across emulated hosts (network namespaces, tbf-shaped links). Root only.

Run explicitly: sudo .venv/bin/python -m pytest -m netns tests/test_netns_allreduce.py
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from zb.net.netns import emulated_hosts, netns_unavailable, remove_stale

pytestmark = pytest.mark.netns

REASON = netns_unavailable()
needs_netns = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@needs_netns
def test_hosts_are_isolated_shaped_and_cleaned_up() -> None:
    with emulated_hosts(2, rate_mbit=50) as net:
        names = [h.name for h in net.hosts] + [net.bridge]
        a, b = net.hosts
        server = b.popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
        client = a.run([sys.executable, "-c", _SOURCE.format(addr=b.addr)], timeout=60)
        assert client.returncode == 0, client.stderr
        mbit = float(server.communicate(timeout=60)[0])
        assert 30 < mbit < 55  # tbf at 50 Mbit/s: TCP payload a little under the rate
        probe = [sys.executable, "-c", _PROBE.format(addr=b.addr)]
        assert a.run(probe).stdout.strip() == "refused"  # link up: the host answers (no listener)
        b.set_link(up=False)
        assert a.run(probe).stdout.strip() == "timeout"  # partition: silence
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)
    assert remove_stale() == []


@needs_netns
def test_int8_beats_fp32_on_shaped_links() -> None:
    sys.path.insert(0, "scripts")
    from bench_netns_allreduce import run

    from zb.collectives.bench import BenchConfig

    cfg = BenchConfig(size_mb=8, iterations=1, warmup=1, threads=1)
    report = run(3, 100.0, cfg)
    res = report["results"]
    assert res["int8"]["bit_identical"] and res["none"]["bit_identical"]
    assert report["int8_speedup"] > 2.5, report  # 4x at most; small tensors pay latency
    assert res["none"]["link_utilization"] > 0.6


_SINK = """
import socket, time
s = socket.socket(); s.bind(("0.0.0.0", 5599)); s.listen(); c, _ = s.accept()
n, t = 0, time.time()
while True:
    d = c.recv(1 << 20)
    if not d:
        break
    n += len(d)
print(n * 8 / (time.time() - t) / 1e6)
"""

_SOURCE = """
import socket, time
for _ in range(50):
    try:
        s = socket.create_connection(("{addr}", 5599), timeout=2); break
    except OSError:
        time.sleep(0.1)
s.sendall(b"x" * (4 << 20)); s.close()
"""

_PROBE = """
import socket
try:
    socket.create_connection(("{addr}", 5598), timeout=2)
    print("connected")
except ConnectionRefusedError:
    print("refused")
except OSError:
    print("timeout")
"""
