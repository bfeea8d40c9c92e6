"""scripts/bench_eager_regime.py at a smoke size: both rules simulated, the row and the best-vs-best
line carry the ratio (the numbers themselves are in BENCHMARKS.md)."""

from __future__ import annotations

import pytest
from conftest import load_script


def test_the_sweep_compares_eager_with_blocking_best_against_best():
    doc = load_script("bench_eager_regime").main(["--nodes", "2", "--steps", "30", "--hs", "10", "--settings", "1.0:0",
                                                  "--batch", "2", "--seq", "32", "--json"])
    (row,) = doc["rows"]
    assert row["blocking"] > 0 and row["eager"] > 0
    assert row["eager_vs_blocking_pct"] == pytest.approx(100 * (row["eager"] / row["blocking"] - 1), abs=0.01)
    assert doc["best"][0]["eager_setting"] == [1.0, 0.0]


def test_steps_that_are_not_a_multiple_of_h_are_refused():
    with pytest.raises(SystemExit):
        load_script("bench_eager_regime").main(["--steps", "35", "--hs", "10"])
