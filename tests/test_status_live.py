"""`zb status` on a live 2-node DiLoCo run: the table, --json, the dashboard's data, the nodes'
goodbye, and the report from the same run's metrics files."""

from __future__ import annotations

import json
import re
import signal

from status_run import NODES, start_dashboard, start_run, wait_for_curves

from zb.testing.procs import zb_process


def test_status_of_a_live_run_then_its_report(tmp_path):
    cluster = start_run(tmp_path)
    dashboard = None
    try:
        where = f"127.0.0.1:{cluster.port}"
        proc = zb_process("status", "--store", where, "--json", timeout=90)
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        nodes = {n["uid"]: n for n in doc["nodes"]}
        assert set(nodes) == set(NODES) and {n["state"] for n in nodes.values()} == {"training"}
        assert sorted(n["global_rank"] for n in nodes.values()) == [0, 1]
        for n in nodes.values():
            assert n["step"] >= 10 and n["outer_step"] >= 2 and n["loss"] > 0 and n["tokens_per_s"] > 0
            assert n["allreduce_s"] is not None and n["wire_mbps"] > 0 and n["device"] == "cpu"
            assert n["compression"] == "none" and n["wire_bytes"] > 0, "DiLoCo at its default: fp32 on the wire"
            assert n["heartbeat_age_s"] is not None, "a one-shot status watches the heartbeats first"
            assert n["heartbeat_age_s"] < 2.0
        run = doc["run"]
        assert run["world_size"] == 2 and run["leader"] in NODES and run["mesh_version"] >= 1
        assert run["tokens_per_s"] > 0 and run["eta_s"] > 0 and run["total_steps"] == 100000

        table = zb_process("status", "--store", where, timeout=90)
        assert table.returncode == 0 and all(uid in table.stdout for uid in NODES) and "training" in table.stdout
        assert "sync" in table.stdout and len(re.findall(r"\bnone \d[\d.,]* [kMG]?B\b", table.stdout)) == 2

        dashboard, url = start_dashboard(cluster)
        live = wait_for_curves(url)
        assert [c["mesh_version"] for c in live["membership"]][-1] == run["mesh_version"]
        for uid in NODES:
            steps = live["history"][uid]["steps"]
            assert all(b[1] > a[1] for a, b in zip(steps, steps[1:])), "a node's curve moves forward"
        dashboard.send_signal(signal.SIGINT)
        assert dashboard.wait(30) == 0

        for proc in cluster.procs.values():
            proc.send_signal(signal.SIGTERM)
        for uid in NODES:
            cluster.finish(uid, 120)
        after = json.loads(zb_process("status", "--store", where, "--json", timeout=90).stdout)
        assert {n["uid"]: n["state"] for n in after["nodes"]} == {u: "left" for u in NODES}
    finally:
        if dashboard is not None and dashboard.poll() is None:
            dashboard.kill()
        cluster.close()

    out = tmp_path / "report.html"
    proc = zb_process("status", "--from", str(tmp_path / "a"), "--from", str(tmp_path / "b"), "--out", str(out))
    assert proc.returncode == 0 and f"report of 2 node(s) written to {out}" in proc.stderr, proc.stderr
    report = json.loads(out.read_text().split('<script id="zb-data" type="application/json">')[1].split("</script>")[0])
    for uid in NODES:
        steps = cluster.metrics(uid, "step")
        assert [p[1] for p in report["history"][uid]["steps"]] == [e["step"] for e in steps]
        assert len(report["history"][uid]["outer"]) == len(cluster.metrics(uid, "outer_step"))
    assert report["membership"] and report["run"]["world_size"] == 2
    again = zb_process("status", "--from", str(tmp_path), "--out", str(out))
    assert again.returncode == 2 and "exists; pass --force" in again.stderr, "a report is never overwritten unasked"
