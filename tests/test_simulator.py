"""scripts/simulate_multi_node_diloco.sh: a short run finishes on every node; Ctrl-C leaves no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from zb.metrics import read_metrics
from zb.testing.cluster import PROFILE
from zb.testing.procs import REPO, subprocess_env, wait_until

SCRIPT = str(REPO / "scripts" / "simulate_multi_node_diloco.sh")
SHORT = ["--model.name", "debug", "--data.seq_length", "32", "--optim.batch_size", "4", "--train.micro_bs", "2",
         "--optim.warmup_steps", "2", "--diloco.inner_steps", "4", "--eval.interval", "-1", "--train.device", "cpu"]


def _env(tmp_path):
    return subprocess_env(PYTHON=sys.executable, ZB_SIM_LOGDIR=str(tmp_path), **PROFILE)


# Prime's debug DiLoCo config, shortened: a Prime user's file and launch line
# (`simulate_multi_node_diloco.sh 2 1 src/zeroband/train.py @file`) work unchanged.
PRIME_DEBUG = """name_model = "debugmodel"
type_model = "llama2"
project = "/tmp/debug"
metric_logger_type = "dummy"

[train]
micro_bs = 2

[optim]
batch_size = 4
warmup_steps = 2
total_steps = 8

[data]
fake = true
seq_length = 32

[diloco]
inner_steps = 4
"""


def test_two_nodes_finish_from_prime_s_launch_line(tmp_path):
    config = tmp_path / "diloco.toml"
    config.write_text(PRIME_DEBUG)
    proc = subprocess.run(["bash", SCRIPT, "2", "1", "src/zeroband/train.py", f"@{config}", "--train.device", "cpu"],
                          capture_output=True, text=True, timeout=170, env=_env(tmp_path), cwd=REPO)
    assert proc.returncode == 0, proc.stderr + (tmp_path / "node0.log").read_text()[-2000:]
    assert "src/zeroband/train.py ignored" in proc.stderr
    # The cores are split between the nodes, and the run ends with a summary that checks agreement.
    assert "thread(s) each on" in proc.stderr
    assert "agreement at outer step 2: all nodes hold the same params" in proc.stderr, proc.stderr[-2000:]
    for i in range(2):
        outer = read_metrics(tmp_path / f"node{i}" / "metrics.jsonl", "outer_step")
        assert [e["outer_step"] for e in outer] == [1, 2]
        assert all(e["global_world_size"] == 2 for e in outer)


def test_a_python_that_cannot_import_zb_is_refused_with_one_line(tmp_path):
    """Without the venv active the simulator used to start nodes that failed with an import error
    visible only in their logs."""
    env = _env(tmp_path)
    env["PYTHON"] = "/bin/false"
    proc = subprocess.run(["bash", SCRIPT, "2", "1", "@configs/debug/diloco.toml"], capture_output=True, text=True,
                          timeout=60, env=env, cwd=REPO)
    assert proc.returncode == 2 and "no python that can import zb" in proc.stderr


def test_ctrl_c_stops_everything(tmp_path):
    proc = subprocess.Popen(["bash", SCRIPT, "2", "1", "@configs/debug/diloco.toml", *SHORT,
                             "--optim.total_steps", "100000"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=_env(tmp_path), cwd=REPO, start_new_session=True)
    try:
        metrics = tmp_path / "node1" / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and read_metrics(metrics, "outer_step"), 150, "node1's first outer step",
                   alive=[proc], details=lambda: proc.stderr.read() if proc.poll() is not None else "", poll=0.5)
        family = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        proc.wait(90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _, alive = psutil.wait_procs(family, timeout=30)
    assert not alive, f"orphans: {[p.cmdline() for p in alive]}"
    assert proc.returncode != 0


def test_the_summary_says_when_no_evaluation_ran(tmp_path):
    """"held-out nan" for a run without evals, as Prime's configs are (issue 30, minor)."""
    import json

    from conftest import load_script

    report = load_script("_sim_report")
    for i, evals in enumerate(([], [{"event": "eval", "step": 4, "loss": 1.25}])):
        node = tmp_path / f"node{i}"
        node.mkdir()
        events = [{"event": "step", "step": 4, "loss": 2.5, "tokens_per_s": 100.0},
                  {"event": "outer_step", "outer_step": 1, "params_hash": "abc"}, *evals]
        (node / "metrics.jsonl").write_text("".join(json.dumps({"time": 0, "node": f"n{i}", **e}) + "\n"
                                                    for e in events))
    rows = report.summary(tmp_path, 2).splitlines()
    assert "not run" in rows[1] and "nan" not in rows[1] and "1.2500" in rows[2]
    assert "all nodes hold the same params" in rows[-1]
