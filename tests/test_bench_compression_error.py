"""scripts/bench_compression_error.py in a smoke size: its rows, and error feedback paying off where it must."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_compression_error.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_compression_error", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_cover_every_width_shape_and_feedback(capsys) -> None:
    doc = _load().main(["--world-sizes", "3", "--numel", "4096", "--rounds", "4", "--compressions", "int4,int2"])
    rows = {(r["compression"], r["error_feedback"], r["shape"]): r for r in doc["rows"]}
    assert len(rows) == 8 and all(r["world_size"] == 3 for r in doc["rows"])
    for width in ("int4", "int2"):
        for shape in ("ring", "all-to-all (simulated)"):
            # The signal accumulates across rounds: error feedback keeps what each call dropped.
            assert rows[(width, True, shape)]["cumulative"] < rows[(width, False, shape)]["cumulative"]
    assert '"benchmark": "compression_error"' in capsys.readouterr().out
