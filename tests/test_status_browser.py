"""The dashboard in a real browser (headless Chromium) on a live DiLoCo run: two nodes train, a third
joins, one leaves. The page loads with no network but loopback, shows the nodes and their states in
its table, draws their curves and lists the membership changes; a screenshot is kept. And on a store
with two runs: the page opens on the list of runs, and each run's page shows its own nodes.

Marked `browser` (about a minute, and it needs Debian's chromium: apt-get install -y chromium):
    python -m pytest -m browser tests/test_status_browser.py
UPDATE_DOCS_SCREENSHOT=1 also writes the screenshot to docs/dashboard.png (docs/watching.md's picture).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import urllib.request

import pytest
from status_run import api, start_dashboard, start_run, wait_for_curves

from zb.testing.cluster import TrainCluster
from zb.testing.procs import REPO, wait_until

pytestmark = pytest.mark.browser

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "chromium-headless-shell")) if p), None)
PNG = b"\x89PNG\r\n\x1a\n"


def _chromium(*args: str, tmp) -> subprocess.CompletedProcess:
    # --no-sandbox: the tests may run as root, where Chromium's sandbox refuses to start.
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--no-first-run", f"--user-data-dir={tmp / 'chromium-profile'}",
                           "--virtual-time-budget=5000", *args], capture_output=True, timeout=120)


def _join_and_leave(cluster, url: str) -> None:
    """c joins the run of a and b, then b leaves (SIGTERM); until the dashboard has seen both changes."""
    cluster.start_train("c", "--optim.total_steps", "100000", "--elastic.status_interval", "0.5",
                        "--eval.interval", "10", rank=2)
    cluster.wait_outer("c", 3)
    cluster.procs["b"].send_signal(signal.SIGTERM)
    cluster.finish("b", 90)

    def seen():
        doc = api(url)
        states = {n["uid"]: n["state"] for n in doc["nodes"]}
        changes = doc["membership"]
        return (states == {"a": "training", "b": "left", "c": "training"} and len(changes) >= 3
                and any("c" in m["joined"] for m in changes) and any("b" in m["left"] for m in changes)
                and len(doc["history"]["c"]["steps"]) >= 10)

    wait_until(seen, 60, "the dashboard showing c joined and b left")


@pytest.mark.skipif(CHROMIUM is None, reason="no headless browser: install Debian's chromium (apt-get install -y "
                                             "chromium) to run the dashboard's browser test")
def test_dashboard_in_headless_chromium(tmp_path):
    cluster = start_run(tmp_path, "--eval.interval", "10")
    dashboard = None
    try:
        dashboard, url = start_dashboard(cluster)
        wait_for_curves(url, points=10)
        _join_and_leave(cluster, url)
        dom = _chromium("--dump-dom", url, tmp=tmp_path)
        html = dom.stdout.decode(errors="replace")
        assert dom.returncode == 0 and 'id="nodes-table"' in html, dom.stderr.decode(errors="replace")[-2000:]
        for uid, state in (("a", "training"), ("c", "training"), ("b", "left")):
            assert re.search(rf'<tr data-node="{uid}">.*?<span class="state {state}">{state}</span>', html), uid
            sync = rf'<tr data-node="{uid}">(?:(?!</tr>).)*<td>none \d[\d.,]* [kMG]?B</td></tr>'
            assert re.search(sync, html), f"{uid}'s compression and bytes per sync"
            curves = re.findall(rf'<path class="curve" d="M[^"]+" stroke="[^"]+" data-node="{uid}" data-points="(\d+)"',
                                html)
            assert curves and max(map(int, curves)) >= 10, f"no curve of {uid} drawn"
        assert "no data yet" not in html.split('id="loss"')[1].split("</section>")[0]
        changes = html.split('id="membership"')[1].split("</section>")[0]
        assert changes.count("<tr>") >= 4, "a header and one row per mesh version"
        assert re.search(r'data-node="nodes in the run" data-points="\d+"', html), "the world size is drawn"

        shot = tmp_path / "dashboard.png"
        done = _chromium(f"--screenshot={shot}", "--window-size=1400,1150", url, tmp=tmp_path)
        assert done.returncode == 0 and shot.read_bytes()[:8] == PNG and shot.stat().st_size > 20_000, done.stderr
        if os.environ.get("UPDATE_DOCS_SCREENSHOT"):
            shutil.copyfile(shot, REPO / "docs" / "dashboard.png")
    finally:
        if dashboard is not None and dashboard.poll() is None:
            dashboard.send_signal(signal.SIGINT)
            dashboard.wait(30)
        cluster.close()


@pytest.mark.skipif(CHROMIUM is None, reason="no headless browser: install Debian's chromium (apt-get install -y "
                                             "chromium) to run the dashboard's browser test")
def test_dashboard_opens_on_the_list_of_runs_in_headless_chromium(tmp_path):
    """Two runs in their own namespaces on one store (issue 44): alpha trains on, beta reaches its end. The dashboard
    opens on the list of runs, each a link to its page, beta marked finished; alpha's page shows alpha's node only."""
    cluster = TrainCluster(tmp_path, 1)
    dashboard = None
    try:
        cluster.start_train("a", "--elastic.namespace", "alpha", "--optim.total_steps", "100000",
                            "--elastic.status_interval", "0.5")
        cluster.start_train("b", "--elastic.namespace", "beta", "--optim.total_steps", "10",
                            "--elastic.status_interval", "0.5")
        assert cluster.finish("b") == 0, cluster.log("b")
        dashboard, url = start_dashboard(cluster)

        def listed():
            runs = {r["namespace"]: r for r in api(url).get("runs", [])}
            return runs if set(runs) == {"alpha", "beta"} and runs["alpha"]["state"] == "running" and \
                runs["beta"]["state"] == "finished" else None

        wait_until(listed, 60, "the dashboard listing alpha running and beta finished")
        def curves() -> bool:
            with urllib.request.urlopen(url + "api/status?namespace=alpha", timeout=10) as r:
                return len(json.loads(r.read())["history"].get("a", {}).get("steps", [])) >= 3

        wait_until(curves, 60, "alpha's curves on its page")
        dom = _chromium("--dump-dom", url, tmp=tmp_path)
        html = dom.stdout.decode(errors="replace")
        assert dom.returncode == 0 and 'id="runs-table"' in html, dom.stderr.decode(errors="replace")[-2000:]
        for run, state in (("alpha", "running"), ("beta", "finished")):
            assert re.search(rf'<tr data-run="{run}"><td class="text"><a href="\?namespace={run}">{run}</a></td>'
                             rf'.*?<span class="state {state}">{state}</span>', html), run
        page = _chromium("--dump-dom", url + "?namespace=alpha", tmp=tmp_path)
        html = page.stdout.decode(errors="replace")
        assert page.returncode == 0 and 'id="nodes-table"' in html, page.stderr.decode(errors="replace")[-2000:]
        assert '<tr data-node="a">' in html and 'data-node="b"' not in html, "a run's page shows its nodes only"
        assert "zb run alpha" in html and re.search(r'data-node="a" data-points="\d+"', html), "alpha's curves"
    finally:
        if dashboard is not None and dashboard.poll() is None:
            dashboard.send_signal(signal.SIGINT)
            dashboard.wait(30)
        cluster.close()
