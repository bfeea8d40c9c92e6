"""`zb bench-allreduce` in a smoke size, through the real command tree and as real processes."""

from __future__ import annotations

import json

from conftest import zb_process



def test_bench_two_local_ranks_json() -> None:
    proc = zb_process("bench-allreduce", "--world-size", "2", "--size-mb", "0.4", "--iterations", "2", "--warmup", "0",
               "--streams", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["world_size"] == 2 and report["numel"] == 100_000, report
    none, int8 = report["results"]["none"], report["results"]["int8"]
    assert none["rel_error"] < 1e-6 and none["bit_identical"] and int8["bit_identical"], report
    assert 0 < int8["rel_error"] < 0.05, report
    assert int8["wire_bytes"] < 0.27 * none["wire_bytes"]
    assert len(int8["times_s"]) == 2 and int8["median_s"] > 0 and int8["busbw_gbps"] == int8["algbw_gbps"]


def test_bench_kernels_json() -> None:
    proc = zb_process("bench-allreduce", "--kernels", "--size-mb", "1", "--threads", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert set(report["kernels"]) == {"quantize", "dequantize", "dequantize_add", "reduce_quantize"}
    assert report["memcpy_gbps"] > 0 and all(r["twin_gbps"] > 0 for r in report["kernels"].values())


def test_bench_table_and_bad_input(run_zb) -> None:
    result = run_zb("bench-allreduce", "--help")
    assert result.exit_code == 0 and "--store" in result.output and "ZB_DILOCO_STREAMS" in result.output
    proc = zb_process("bench-allreduce", "--compressions", "int4")
    assert proc.returncode == 2 and "int4" in proc.stderr
    proc = zb_process("bench-allreduce", "--rank", "1")
    assert proc.returncode == 2 and "--store" in proc.stderr
