"""scripts/bench_overlap.py (needs root for its namespaces): what it refuses before it builds anything, and
the per-sync control figures it reports (the runs themselves are in BENCHMARKS.md)."""

from __future__ import annotations

import pytest
from conftest import load_script


@pytest.mark.parametrize("argv, why", [(["--rates", "10,1", "--inner-steps", "20,30,60"], "one per rate"),
                                       (["--steps", "240", "--inner-steps", "7"], "must divide --steps"),
                                       (["--inner-steps", "20", "--fragments", "2", "--fragment-delay", "10"],
                                        "fragment delay below")])
def test_settings_that_cannot_run_are_refused_in_one_line(argv, why, capsys):
    with pytest.raises(SystemExit) as e:
        load_script("bench_overlap").main(argv)
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_a_sync_costs_the_cheapest_nodes_time_and_the_mean_says_what_waiting_added():
    nodes = [dict(control=[0.010, 0.020, 0.5], resolve=[0.001, 0.002, 0.3], checkin=[0.004, 0.005, 0.1]),
             dict(control=[0.200, 0.030, 0.012], resolve=[0.1, 0.003, 0.002], checkin=[0.09, 0.01, 0.003])]
    c = load_script("bench_overlap").control_per_sync(nodes)
    assert c["syncs"] == 3
    assert c["cheapest_median_ms"] == 12.0        # per sync: 10, 20, 12 ms
    assert c["mean_median_ms"] == pytest.approx(105.0)   # per sync: 105, 25, 256 ms
    assert c["roll_call_median_ms"] == 2.0 and c["checkin_median_ms"] == 4.0   # medians of the per-sync minima
