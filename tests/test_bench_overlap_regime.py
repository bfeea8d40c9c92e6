"""scripts/bench_overlap_regime.py: a smoke-size run of all three rules, the best-vs-best arithmetic on
made-up losses (the minimum is picked, the ratio is of the two numbers, the spread is per seed), and
the refusals of bad input (the numbers themselves are in BENCHMARKS.md)."""

from __future__ import annotations

import pytest
from conftest import load_script


def test_a_smoke_run_simulates_every_rule_and_compares_it_with_blocking():
    doc = load_script("bench_overlap_regime").main(
        ["--nodes", "2", "--steps", "30", "--hs", "10", "--settings", "1.0:0", "--rules", "eager,streaming",
         "--streaming", "2:1:0.5", "--batch", "2", "--seq", "32", "--json"])
    assert [r["rule"] for r in doc["rows"]] == ["blocking", "eager", "streaming"]
    blocking, eager, streaming = doc["rows"]
    assert all(r["loss"] > 0 and r["losses"] == [r["loss"]] for r in doc["rows"])
    assert (streaming["fragments"], streaming["fragment_delay"], streaming["fragment_alpha"]) == (2, 1, 0.5)
    # Different rules, different losses (a rule flag that got lost would make them equal).
    assert len({blocking["loss"], eager["loss"], streaming["loss"]}) == 3
    assert eager["vs_blocking_pct"] == pytest.approx(100 * (eager["loss"] / blocking["loss"] - 1), abs=0.01)
    assert [b["rule"] for b in doc["best"]] == ["eager", "streaming"]


def test_best_against_best_takes_each_rules_lowest_mean_and_keeps_the_seed_spread():
    mod = load_script("bench_overlap_regime")
    args = mod.parse_args(["--models", "debug", "--hs", "10", "--seeds", "1,2", "--settings", "1.0:0,0.5:0",
                           "--rules", "eager,streaming", "--streaming", "2:1:0.5,5:1:0.0"])
    losses = {  # (variant, lr): (seed 1, seed 2)
        ("blocking", 1.0): (1.0, 1.2), ("blocking", 0.5): (1.5, 0.9),       # means 1.1, 1.2
        ("eager", 1.0): (1.6, 1.6), ("eager", 0.5): (1.3, 1.5),             # means 1.6, 1.4
        ("streaming 2:1:0.5", 1.0): (1.2, 1.2), ("streaming 2:1:0.5", 0.5): (2.0, 2.0),
        ("streaming 5:1:0.0", 1.0): (1.3, 1.3), ("streaming 5:1:0.0", 0.5): (1.1, 1.2),  # best: 1.15
    }
    found = {("debug", 10, v, lr, 0.0, s): losses[(mod.label(v), lr)][i]
             for v in mod.variants(args) for lr in (1.0, 0.5) for i, s in enumerate((1, 2))}
    rows, best = mod.summarize(args, found)
    assert len(rows) == 8
    eager, streaming = best
    assert (eager["loss"], eager["setting"]["outer_lr"], eager["losses"]) == (1.4, 0.5, [1.3, 1.5])
    assert (eager["blocking"], eager["blocking_setting"]) == (1.1, {"outer_lr": 1.0, "outer_momentum": 0.0})
    assert eager["vs_blocking_pct"] == pytest.approx(100 * (1.4 / 1.1 - 1), abs=0.01)
    assert eager["per_seed_vs_blocking_pct"] == pytest.approx([30.0, 25.0], abs=0.01)
    assert streaming["loss"] == 1.15 and streaming["setting"]["fragments"] == 5
    assert streaming["setting"]["fragment_alpha"] == 0.0
    row = next(r for r in rows if r["rule"] == "eager" and r["outer_lr"] == 0.5)
    assert row["vs_blocking_pct"] == pytest.approx(100 * (1.4 / 1.2 - 1), abs=0.01)   # same setting's blocking


def test_recovered_is_the_share_of_the_delays_cost_that_eager_wins_back():
    mod = load_script("bench_overlap_regime")
    best = [{"model": "debug", "h": 10, "rule": "eager", "loss": 1.2, "blocking": 1.0},
            {"model": "debug", "h": 10, "rule": "delayed", "loss": 1.5, "blocking": 1.0},
            {"model": "debug", "h": 30, "rule": "eager", "loss": 1.0, "blocking": 1.0},
            {"model": "debug", "h": 30, "rule": "delayed", "loss": 0.9, "blocking": 1.0},
            {"model": "tiny", "h": 10, "rule": "eager", "loss": 1.0, "blocking": 1.0}]   # no delayed: not listed
    assert [(r["h"], r["recovered_pct"]) for r in mod.recovered(best)] == [(10, 60.0), (30, None)]


def test_the_delayed_rule_simulates_and_differs_from_eager_and_blocking():
    doc = load_script("bench_overlap_regime").main(
        ["--nodes", "2", "--steps", "30", "--hs", "10", "--settings", "1.0:0", "--rules", "eager,delayed",
         "--batch", "2", "--seq", "32", "--json"])
    blocking, eager, delayed = (r["loss"] for r in doc["rows"])
    assert len({blocking, eager, delayed}) == 3   # a rule flag that got lost would make two of them equal
    assert [(r["model"], r["h"]) for r in doc["recovered"]] == [("debug", 10)]


@pytest.mark.parametrize("argv", [
    ["--steps", "35", "--hs", "10"],                                            # steps not a multiple of H
    ["--hs", "10", "--rules", "streaming", "--streaming", "4:1:0.5"],           # 4 fragments do not divide 10
    ["--hs", "10", "--rules", "streaming", "--streaming", "2:5:0.5"],           # tau >= H / fragments
    ["--hs", "10", "--rules", "streaming", "--streaming", "2:1"],               # not fragments:tau:alpha
    ["--hs", "10", "--rules", "streaming", "--streaming", "2:1:1.5"],           # alpha outside [0, 1]
    ["--rules", "lazy"],
    ["--models", "huge"],
    ["--settings", "1.0"],
])
def test_bad_input_is_refused_before_anything_runs(argv, capsys):
    with pytest.raises(SystemExit) as e:
        load_script("bench_overlap_regime").main(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err
