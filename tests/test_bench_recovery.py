"""Smoke test of scripts/bench_recovery.py (loopback), and its shaped-link targets under netns."""

from __future__ import annotations

import os

import pytest
from conftest import load_script


def test_bench_recovery_loopback_smoke(capsys):
    doc = load_script("bench_recovery").main(["--size-mb", "4", "--repeats", "1", "--no-netns"])
    assert doc["size_bytes"] > 4_000_000 and doc["netns"] == {"skipped": "--no-netns"}
    assert set(doc["loopback"]) == {"baseline", "one_peer", "two_peers"} and set(doc["write"]) == {"write_baseline", "write_snapshot"}
    assert '"size_bytes"' in capsys.readouterr().out.strip().splitlines()[-1]


@pytest.mark.netns
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")
def test_bench_recovery_meets_targets_on_shaped_links():
    doc = load_script("bench_recovery").main(["--size-mb", "24", "--repeats", "1", "--rate-mbit", "100"])
    assert doc["netns"]["ratio_one"] <= 1.2, doc
    assert doc["netns"]["ratio_two"] <= 1.35, doc
