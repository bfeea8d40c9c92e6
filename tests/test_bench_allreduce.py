"""`zb bench-allreduce` in a smoke size, through the real command tree and as real processes."""

from __future__ import annotations

import json

from zb.testing.procs import free_port, zb_process


def test_bench_two_local_ranks_json() -> None:
    proc = zb_process("bench-allreduce", "--world-size", "2", "--size-mb", "0.4", "--iterations", "2", "--warmup", "0",
               "--streams", "2", "--shape", "halving", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["world_size"] == 2 and report["numel"] == 100_000 and report["shape"] == "halving", report
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
    proc = zb_process("bench-allreduce", "--compressions", "int3")
    assert proc.returncode == 2 and "int3" in proc.stderr and "int2" in proc.stderr
    proc = zb_process("bench-allreduce", "--shape", "tree")
    assert proc.returncode == 2 and "'tree'" in proc.stderr and "halving" in proc.stderr
    proc = zb_process("bench-allreduce", "--rank", "1")
    assert proc.returncode == 2 and "--store" in proc.stderr


def _one_error_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()  # no C++ frames from torch's TCPStore or gloo
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    return lines[0]


def test_unreachable_store_fails_within_the_timeout() -> None:
    # Nothing listens there; the bound is --timeout (the test allows many times more, for a busy box).
    port = free_port()
    proc = zb_process("bench-allreduce", "--store", f"127.0.0.1:{port}", "--rank", "1", "--timeout", "2", timeout=90)
    assert proc.returncode == 1, proc.stderr
    assert f"cannot reach the store at 127.0.0.1:{port} within 2 s" in _one_error_line(proc)


def test_missing_rank_is_named_within_the_timeout() -> None:
    proc = zb_process("bench-allreduce", "--store", f"127.0.0.1:{free_port()}", "--rank", "0", "--world-size", "2",
                      "--timeout", "2", timeout=90)
    assert proc.returncode == 1, proc.stderr
    assert "rank 1 did not arrive within 2 s" in _one_error_line(proc)


def test_unresolvable_store_host_exits_2_and_the_timeout_is_documented(run_zb) -> None:
    proc = zb_process("bench-allreduce", "--store", "no-such-host.invalid:5000", "--rank", "1", timeout=90)
    assert proc.returncode == 2 and "--store 'no-such-host.invalid' is not" in _one_error_line(proc)
    result = run_zb("bench-allreduce", "--help")
    assert "--timeout" in result.output and "60" in result.output
