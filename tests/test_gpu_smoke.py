"""scripts/gpu_smoke.py, as far as a machine without a GPU can check it: usage, and a clean refusal."""

import subprocess
import sys

from zb.testing.procs import REPO, subprocess_env

SCRIPT = str(REPO / "scripts" / "gpu_smoke.py")


def test_help_lists_the_stages():
    proc = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=60,
                          env=subprocess_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    for stage in ("single", "ac-compile", "torchrun", "diloco"):
        assert stage in proc.stdout


def test_refuses_in_one_line_without_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--keep", str(tmp_path / "w")], capture_output=True, text=True,
                          timeout=60, env=subprocess_env(CUDA_VISIBLE_DEVICES=""), cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line
    assert "no CUDA GPU is visible" in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "w").exists()  # nothing was run


def test_rejects_an_unknown_stage():
    proc = subprocess.run([sys.executable, SCRIPT, "--stage", "everything"], capture_output=True, text=True,
                          timeout=60, env=subprocess_env(), cwd=REPO)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


BENCH = str(REPO / "scripts" / "bench_gpu.py")


def test_gpu_bench_refuses_in_one_line_without_a_gpu():
    proc = subprocess.run([sys.executable, BENCH, "throughput"], capture_output=True, text=True, timeout=60,
                          env=subprocess_env(CUDA_VISIBLE_DEVICES=""), cwd=REPO)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "no CUDA GPU is visible" in proc.stderr


def test_gpu_bench_throughput_runs_both_loops_on_the_cpu():
    """--cpu checks the script itself (the GPU numbers are in BENCHMARKS.md): both loops run, interleaved,
    and the row carries the ratio of their rates."""
    import json

    proc = subprocess.run([sys.executable, BENCH, "throughput", "--cpu", "--model", "debug", "--compile", "off",
                           "--steps", "4", "--warmup", "1", "--repeats", "1"], capture_output=True, text=True,
                          timeout=170, env=subprocess_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    assert len(row["plain_tokens_per_s"]) == len(row["zb_tokens_per_s"]) == 1
    assert row["ratio"] > 0 and row["micro_bs"] == 8 and row["seq"] == 128


def test_gpu_bench_features_runs_a_combination_on_the_cpu(tmp_path):
    """`features --only` runs the named rows as real two-node runs (here eager overlap with int2, the row
    that rewrites the model between rounds) and reports their hashes and bytes per row."""
    import json

    proc = subprocess.run([sys.executable, BENCH, "features", "--cpu", "--model", "debug", "--seq", "64",
                           "--inner-steps", "4", "--outer-steps", "2", "--only", "int2 + eager", "--timeout", "150",
                           "--keep", str(tmp_path)], capture_output=True, text=True, timeout=200,
                          env=subprocess_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert row["label"] == "int2 + eager overlap" and row["hashes_equal"] and row["outer_steps"] == 2
    # debug model at a 32,000-token vocabulary: 4.4M params, int8 would send 4.3 MB, int2 a quarter of that
    assert "--diloco.overlap eager" in row["extra"] and 1_000_000 < row["wire_bytes"] < 1_200_000


def test_gpu_bench_refuses_options_that_would_do_nothing():
    for argv, said in ((["features", "--only", "int3"], "matches no combination; the combinations: int8;"),
                       (["diloco", "--only", "int4"], "has no effect on diloco"),
                       (["features", "--compression", "int4"], "--compression has no effect on features")):
        proc = subprocess.run([sys.executable, BENCH, *argv, "--cpu"], capture_output=True, text=True, timeout=60,
                              env=subprocess_env(), cwd=REPO)
        assert proc.returncode == 2 and said in proc.stderr.splitlines()[-1]
