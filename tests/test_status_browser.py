"""The dashboard in a real browser (headless Chromium) on a live 2-node DiLoCo run: the page loads with
no network but loopback, shows both nodes in its table and draws their curves; a screenshot is kept.

Marked `browser` (about 40 s, and it needs Debian's chromium: apt-get install -y chromium):
    python -m pytest -m browser tests/test_status_browser.py
UPDATE_DOCS_SCREENSHOT=1 also writes the screenshot to docs/dashboard.png (the README's picture).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess

import pytest
from conftest import REPO
from status_run import NODES, start_dashboard, start_run, wait_for_curves

pytestmark = pytest.mark.browser

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "chromium-headless-shell")) if p), None)
PNG = b"\x89PNG\r\n\x1a\n"


def _chromium(*args: str, tmp) -> subprocess.CompletedProcess:
    # --no-sandbox: the tests may run as root, where Chromium's sandbox refuses to start.
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--no-first-run", f"--user-data-dir={tmp / 'chromium-profile'}",
                           "--virtual-time-budget=5000", *args], capture_output=True, timeout=120)


@pytest.mark.skipif(CHROMIUM is None, reason="no headless browser: install Debian's chromium (apt-get install -y "
                                             "chromium) to run the dashboard's browser test")
def test_dashboard_in_headless_chromium(tmp_path):
    cluster = start_run(tmp_path)
    dashboard = None
    try:
        dashboard, url = start_dashboard(cluster)
        wait_for_curves(url, points=10)
        dom = _chromium("--dump-dom", url, tmp=tmp_path)
        html = dom.stdout.decode(errors="replace")
        assert dom.returncode == 0 and 'id="nodes-table"' in html, dom.stderr.decode(errors="replace")[-2000:]
        for uid in NODES:
            assert re.search(rf'<tr data-node="{uid}">.*?<span class="state training">training</span>', html), uid
            curves = re.findall(rf'<path class="curve" d="M[^"]+" stroke="[^"]+" data-node="{uid}" data-points="(\d+)"',
                                html)
            assert curves and max(map(int, curves)) >= 10, f"no curve of {uid} drawn"
        assert "no data yet" not in html.split('id="loss"')[1].split("</section>")[0]

        shot = tmp_path / "dashboard.png"
        done = _chromium(f"--screenshot={shot}", "--window-size=1400,1100", url, tmp=tmp_path)
        assert done.returncode == 0 and shot.read_bytes()[:8] == PNG and shot.stat().st_size > 20_000, done.stderr
        if os.environ.get("UPDATE_DOCS_SCREENSHOT"):
            shutil.copyfile(shot, REPO / "docs" / "dashboard.png")
    finally:
        if dashboard is not None and dashboard.poll() is None:
            dashboard.send_signal(signal.SIGINT)
            dashboard.wait(30)
        cluster.close()
