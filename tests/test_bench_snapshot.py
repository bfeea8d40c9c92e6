"""scripts/bench_snapshot.py: a snapshot read is one multi_get when every key exists, one operation a key more when
two are missing (what it measures), and bad counts are one line."""

from __future__ import annotations

import json

import pytest
from conftest import load_script


def test_it_counts_the_operations_of_a_read(capsys):
    assert load_script("bench_snapshot").main(["--reads", "3", "--repeats", "1"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [(r["case"], r["ops_per_read"]) for r in rows] == [("absent", 17.0), ("present", 2.0)]


def test_a_count_under_one_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        load_script("bench_snapshot").main(["--reads", "0"])
    assert e.value.code == 2 and "--reads and --repeats must be at least 1" in capsys.readouterr().err
