"""scripts/bench_swarm.py: its table and JSON from runs (fast), and a real smoke run (soak)."""

from __future__ import annotations

import argparse

import pytest
from conftest import load_script


def _run(row, seed, loss, stage_bytes, served=None):
    return dict(row=row, seed=seed, loss=loss, agree=True, wall_s=1.0, run_tokens_per_s=100.0,
                stage_bytes=stage_bytes, pipeline_bytes=10, served=served or {}, reissued=0)


def test_report_compares_every_row_with_swarm_and_reports_the_slowed_share(capsys):
    bench = load_script("bench_swarm")
    args = bench.parse_args(["--rows", "single,swarm,dswarm-h10,slowed"])
    runs = [_run("swarm", 1, 1.0, 1000), _run("swarm", 2, 1.2, 1000), _run("dswarm-h10", 1, 1.05, 100),
            _run("dswarm-h10", 2, 1.1, 100), dict(row="dswarm-h50", seed=1, error="boom"),
            _run("slowed", 1, 1.0, 100, {"s1w0": 75, "s1w1": 25})]
    doc = bench.report(runs, args)
    table = {t["row"]: t for t in doc["table"]}
    assert "dswarm-h50" not in table                       # a failed run is left out of the means
    assert table["dswarm-h10"]["loss_vs_swarm"] == pytest.approx(1.075 / 1.1 - 1, abs=1e-4)
    assert table["dswarm-h10"]["stage_bytes_vs_swarm"] == pytest.approx(0.1)
    assert table["slowed"]["slowed_share"] == 0.25
    assert "held-out" in capsys.readouterr().err


def test_bad_rows_and_steps_are_refused():
    bench = load_script("bench_swarm")
    with pytest.raises(SystemExit):
        bench.parse_args(["--rows", "nonsense"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--rows", "dswarm-h7", "--steps", "20"])
    assert isinstance(bench.parse_args([]), argparse.Namespace)


@pytest.mark.soak
def test_quick_run_end_to_end():
    bench = load_script("bench_swarm")
    doc = bench.main(["--quick", "--seeds", "1", "--rows", "single,swarm,dswarm-h10"])
    table = {t["row"]: t for t in doc["table"]}
    assert set(table) == {"single", "swarm", "dswarm-h10"} and all(t["agree"] for t in table.values())
    assert table["dswarm-h10"]["stage_bytes_vs_swarm"] == pytest.approx(0.1, rel=0.01)
