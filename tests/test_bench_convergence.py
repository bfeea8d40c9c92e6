"""Smoke test of scripts/bench_convergence.py: one tiny DiLoCo row with real `zb store` + node processes."""

from __future__ import annotations

import json

from conftest import load_script


def test_bench_convergence_quick_diloco_row(capsys):
    doc = load_script("bench_convergence").main(["--quick", "--rows", "diloco-h5-int8", "--seeds", "1", "--json"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == doc
    assert set(doc) == {"bench", "entropy_floor", "params", "config", "rows", "targets", "runs"}
    assert 0.4 < doc["entropy_floor"] < 0.6 and doc["params"] > 0
    row = doc["rows"]["diloco-h5-int8"]
    assert {"loss_mean", "loss_spread", "bytes_per_node", "comm_reduction", "agree", "outer_steps"} <= set(row)
    assert row["outer_steps"] == 4 and row["agree"] is True and row["failed_runs"] == 0
    # The loss has left its initial value (ln 320 ~ 5.8) but cannot beat the data's entropy floor.
    assert doc["entropy_floor"] < row["loss_mean"] < 5.0
    # int8 sends ~1/4 of fp32, and 4 outer syncs in 20 steps: ~20x less than all-reducing every step.
    assert 15 < row["comm_reduction"] <= 20.5, row
    assert doc["targets"]["diloco-h5-int8_comm"]["met"] is True
