"""The training throughput benchmark runs in a smoke size and reports its ratio."""

import subprocess
import sys

from zb.testing.procs import REPO, subprocess_env


def test_bench_train_throughput_smoke():
    proc = subprocess.run([sys.executable, "scripts/bench_train_throughput.py", "--model", "debug", "--steps", "6",
                           "--warmup", "2", "--repeats", "1", "--seq", "32", "--json"], capture_output=True, text=True,
                          timeout=170, env=subprocess_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ratio_median"] > 0 and len(result["zb_tokens_per_s"]) == 1


def test_bench_train_prefetch_ab_smoke():
    proc = subprocess.run([sys.executable, "scripts/bench_train_throughput.py", "--prefetch-ab", "--model", "debug",
                           "--steps", "6", "--warmup", "2", "--repeats", "1", "--seq", "32", "--json"],
                          capture_output=True, text=True, timeout=170, env=subprocess_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["data"] == "builtin" and len(result["inline_tokens_per_s"]) == len(result["prefetch_tokens_per_s"]) == 1


def test_bench_data_overlap_smoke():
    proc = subprocess.run([sys.executable, "scripts/bench_train_throughput.py", "--data-overlap", "--micro-bs", "2",
                           "--seq", "64", "--steps", "3"], capture_output=True, text=True, timeout=120,
                          env=subprocess_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["inline_step_ms"] > 0 and result["prefetch_step_ms"] > 0 and result["ratio"] > 0
