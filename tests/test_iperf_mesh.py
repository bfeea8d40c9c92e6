"""`zb iperf-mesh`: the schedule, the summary, and the command as real processes on loopback.

The netns test (shaped links across emulated hosts) runs only on request, as root:
  sudo .venv/bin/python -m pytest -m netns tests/test_iperf_mesh.py
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from zb.net.netns import netns_unavailable
from zb.net.schedule import mesh_phases, round_robin
from zb.testing.procs import PYTHON, REPO, free_port, subprocess_env, zb_process

FAST = ["--duration", "0.2", "--json"]


def _zb(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return zb_process("iperf-mesh", *args, timeout=timeout)


def _ranks(world: int, *extra_per_rank: list[str], common: list[str] = FAST, ranks=None,
           timeout: float = 90) -> list[subprocess.CompletedProcess]:
    """One `zb iperf-mesh --store` process per rank (rank 0 hosts the store), run to the end."""
    store = f"127.0.0.1:{free_port()}"
    ranks = range(world) if ranks is None else ranks
    procs = {r: subprocess.Popen([PYTHON, "-m", "zb", "iperf-mesh", "--store", store, "--rank", str(r),
                                  "--world-size", str(world), *common,
                                  *(extra_per_rank[r] if r < len(extra_per_rank) else [])],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
             for r in ranks}
    done = []
    try:
        for p in procs.values():
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


def _check_full_mesh(report: dict, world: int) -> None:
    links = report["links"]
    assert report["world_size"] == world and report["duration_s"] == 0.2 and report["parallel"] >= 1
    assert sorted((link["src"], link["dst"]) for link in links) == [
        (a, b) for a in range(world) for b in range(world) if a != b]
    assert all(link["error"] is None and link["mbps"] > 0 and link["rtt_ms"] > 0 and link["bytes"] > 0
               and link["seconds"] > 0 for link in links), links
    matrix = report["matrix_mbps"]
    assert len(matrix) == world and all(len(row) == world for row in matrix)
    assert all(matrix[i][i] is None for i in range(world))
    assert all(matrix[link["src"]][link["dst"]] == link["mbps"] for link in links)
    assert sorted(report["hosts"]) == [str(r) for r in range(world)]


# --- schedule (pure) ---------------------------------------------------------------------------

@pytest.mark.parametrize("world", range(1, 8))
@pytest.mark.parametrize("serial", [False, True])
def test_schedule_covers_every_ordered_pair_once_without_overlap(world: int, serial: bool) -> None:
    phases = mesh_phases(world, serial)
    ordered = [pair for phase in phases for pair in phase.pairs]
    expected = {(a, b) for a in range(world) for b in range(world) if a != b}
    assert len(ordered) == len(expected) and set(ordered) == expected
    for phase in phases:
        nodes = [n for pair in phase.pairs for n in pair]
        assert len(nodes) == len(set(nodes)), phase  # no node in two measurements at once
        assert len(phase.pairs) == 1 or not serial
    rounds = round_robin(world)
    for pairs in rounds:
        nodes = [n for pair in pairs for n in pair]
        assert len(nodes) == len(set(nodes))
    # W-1 rounds for even W, W for odd W (one node idles per round); a 1-node mesh has none.
    assert len(rounds) == (0 if world == 1 else world - 1 if world % 2 == 0 else world)


# --- summary (pure) ----------------------------------------------------------------------------

def _link(src, dst, mbps, rtt=1.0, error=None):
    return {"src": src, "dst": dst, "mbps": mbps, "bytes": 1, "seconds": 1.0, "rtt_ms": rtt, "error": error}


def test_summary_names_slowest_asymmetric_and_unreachable() -> None:
    from zb.cli.iperf_mesh import matrix_table, summary_lines
    from zb.net.iperf import MeshConfig, build_report, failed_links

    links = [_link(0, 1, 100.0, 2.0), _link(1, 0, 20.0, 4.0), _link(0, 2, 90.0), _link(2, 0, 80.0),
             _link(1, 2, None, None, "connect to 10.0.0.3:5000 failed: Connection refused"), _link(2, 1, 95.0)]
    hosts = {r: {"addr": f"10.0.0.{r + 1}", "port": 5000} for r in range(3)}
    report = build_report(3, MeshConfig(duration_s=1.0), hosts, links)
    lines = "\n".join(summary_lines(report))
    assert "slowest link: 1 -> 0 20.0 Mbit/s" in lines
    assert "most asymmetric pair: 0 -> 1 100.0 Mbit/s vs 1 -> 0 20.0 Mbit/s (5.00x)" in lines
    assert "0-1 3.00" in lines and "ZB_DILOCO_MIN_BANDWIDTH_MBPS" in lines and "20 Mbit/s" in lines
    assert [(link["src"], link["dst"]) for link in failed_links(report)] == [(1, 2)]
    assert report["matrix_mbps"][1] == [20.0, None, None] and report["hosts"]["2"] == "10.0.0.3:5000"

    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(matrix_table(report))
    text = console.export_text()
    assert "unreachable" in text and "—" in text and "100.0" in text


# --- the command, as processes on loopback -----------------------------------------------------

def test_local_three_ranks_json() -> None:
    proc = _zb("--world-size", "3", *FAST)
    assert proc.returncode == 0, proc.stderr
    _check_full_mesh(json.loads(proc.stdout), 3)
    # Logs (not a terminal): one plain progress line per measurement.
    progress = [line for line in proc.stderr.splitlines() if line.startswith("round ")]
    assert len(progress) == 6 and "Mbit/s, rtt" in progress[0], proc.stderr


def test_multi_host_three_processes_agree() -> None:
    procs = _ranks(3, common=[*FAST, "--parallel", "2", "--serial"])
    assert all(p.returncode == 0 for p in procs), [p.stderr for p in procs]
    reports = [json.loads(p.stdout) for p in procs]
    _check_full_mesh(reports[0], 3)
    assert reports[0]["parallel"] == 2 and reports[0]["serial"] is True
    assert reports[0] == reports[1] == reports[2]  # every rank gathers the whole mesh
    assert [line.split(":")[0] for line in procs[1].stderr.splitlines() if line.startswith("pair ")] == [
        f"pair {i}/6" for i in range(1, 7)]


def test_unreachable_peer_is_named_and_the_rest_measured() -> None:
    closed = free_port()  # nothing listens here: peers dialing rank 2 are refused
    procs = _ranks(3, [], [], ["--advertise", f"127.0.0.1:{closed}"])
    for p in procs:
        assert p.returncode == 1, p.stderr
        assert "unreachable (sender -> receiver): 0 -> 2, 1 -> 2" in p.stderr, p.stderr
        assert "Connection refused" in p.stderr and "Traceback" not in p.stderr
    report = json.loads(procs[0].stdout)
    ok = {(link["src"], link["dst"]) for link in report["links"] if link["error"] is None}
    assert ok == {(0, 1), (1, 0), (2, 0), (2, 1)}
    assert all(link["mbps"] > 0 for link in report["links"] if link["error"] is None)
    bad = [link for link in report["links"] if link["error"]]
    assert all(link["mbps"] is None and str(closed) in link["error"] for link in bad)
    assert report["matrix_mbps"][0][2] is None and report["hosts"]["2"] == f"127.0.0.1:{closed}"


def test_missing_rank_is_named_within_the_timeout() -> None:
    procs = _ranks(3, common=[*FAST, "--timeout", "3"], ranks=[0, 1])
    for p in procs:
        assert p.returncode == 1, p.stderr
        lines = p.stderr.strip().splitlines()
        assert lines[-1].startswith("error: rank 2 did not reach the start within 3 s"), p.stderr
        assert "Traceback" not in p.stderr


def test_store_unreachable_exits_1_after_the_timeout() -> None:
    proc = _zb("--store", f"127.0.0.1:{free_port()}", "--rank", "1", "--world-size", "2", "--timeout", "2", *FAST)
    assert proc.returncode == 1 and "cannot reach the store at 127.0.0.1:" in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()  # only zb's line: no C++ frames from torch's TCPStore
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr


def test_port_in_use_exits_1() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _zb("--store", f"127.0.0.1:{free_port()}", "--rank", "0", "--world-size", "2",
                   "--bind", "127.0.0.1", "--port", str(port), *FAST)
    assert proc.returncode == 1, proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--rank", "1"], "--rank needs --store"),
    (["--store", "127.0.0.1:29500", "--world-size", "3"], "--store needs --rank"),
    (["--store", "127.0.0.1:29500", "--rank", "3", "--world-size", "3"], "0 <= R < --world-size (3)"),
    (["--store", "localhost", "--rank", "0"], "--store 'localhost': expected HOST:PORT"),
    (["--store", "h:70000", "--rank", "0"], "expected HOST:PORT"),
    (["--advertise", "10.0.0.1:x"], "--advertise '10.0.0.1:x'"),
    (["--duration", "0"], "--duration"),
    (["--parallel", "0"], "--parallel"),
    # Bounded at parse time: a typo must not hold every host of the mesh for hours.
    (["--duration", "inf"], "--duration"),
    (["--duration", "1e9"], "--duration"),
    (["--parallel", "100000"], "--parallel"),
    # A host name that does not resolve is a bad invocation wherever it is given, not a busy port.
    (["--bind", "no-such-host.invalid", "--world-size", "2"], "--bind 'no-such-host.invalid' is not"),
    # A mesh of one has no link to measure (it exited 0 with an empty matrix: issue 30).
    (["--world-size", "1"], "1 is not in the range x>=2"),
    (["--store", "no-such-host.invalid:5000", "--rank", "1", "--timeout", "60"],
     "--store 'no-such-host.invalid' is not"),
])
def test_bad_inputs_exit_2_with_one_line(args: list[str], message: str) -> None:
    proc = _zb(*args, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_help_documents_modes_and_exit_codes(run_zb) -> None:
    result = run_zb("iperf-mesh", "--help")
    assert result.exit_code == 0
    for text in ("--store", "--serial", "--advertise", "--parallel", "Exit codes"):
        assert text in result.output


# --- shaped links across emulated hosts (root, on request) -------------------------------------

REASON = netns_unavailable()


@pytest.mark.netns
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_shaped_links_measure_near_the_shaped_rate() -> None:
    sys.path.insert(0, str(Path(REPO) / "scripts"))
    from bench_netns_iperf import run

    report = run(3, 50.0, 2.0)
    assert len(report["links"]) == 6
    for link in report["links"]:
        assert 40.0 <= link["mbps"] <= 60.0, link  # within ±20% of tbf's 50 Mbit/s
