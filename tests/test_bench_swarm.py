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


def test_report_compares_the_restarted_run_with_the_uninterrupted_one_of_the_same_seeds(capsys):
    bench = load_script("bench_swarm")
    args = bench.parse_args(["--rows", "dswarm-h10,restart"])
    restarted = [dict(_run("restart", seed, loss, 120), resumed_step=150, redone_steps=redone, restart_s=9.5)
                 for seed, loss, redone in ((1, 1.1, 3), (2, 0.9, 5))]
    runs = [_run("dswarm-h10", 1, 1.0, 100), _run("dswarm-h10", 2, 1.0, 100), *restarted]
    table = {t["row"]: t for t in bench.report(runs, args)["table"]}
    assert table["restart"]["loss_vs_h10"] == pytest.approx(0.0)
    assert table["restart"]["redone_steps"] == [3, 5] and table["restart"]["restart_s"] == [9.5, 9.5]
    assert "steps done twice" in capsys.readouterr().err


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


@pytest.mark.soak
def test_restart_row_end_to_end():
    bench = load_script("bench_swarm")
    doc = bench.main(["--steps", "100", "--batch", "4", "--seq", "64", "--warmup", "2", "--eval-batches", "4",
                      "--seeds", "1", "--rows", "dswarm-h10,restart"])
    table = {t["row"]: t for t in doc["table"]}
    assert set(table) == {"dswarm-h10", "restart"} and table["restart"]["agree"], doc
    # Killed at step 50 or just after: the newest checkpoint every stage committed is 40 or 50 (saves are async).
    assert table["restart"]["resumed_step"][0] in (40, 50) and 0 <= table["restart"]["redone_steps"][0] < 20
