"""`zb train` end to end: it learns, writes the metrics schema, and stops cleanly on SIGINT."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys

import psutil
import pytest

from zb.metrics import read_metrics
from zb.testing.procs import REPO, subprocess_env, wait_until, zb_process

FAST = ["--train.device", "cpu", "--log.progress", "plain", "--optim.warmup_steps", "5"]


def _zb(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return zb_process("train", *FAST, *args, timeout=timeout)


def test_default_source_learns_and_metrics_follow_the_schema(tmp_path):
    proc = _zb("--optim.total_steps", "60", "--eval.interval", "30", "--log.dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert all({"event", "time", "node"} <= set(r) for r in records)
    start = records[0]
    assert start["event"] == "run_start" and start["settings"]["optim.total_steps"] == 60 and start["version"]
    steps = [r for r in records if r["event"] == "step"]
    for field in ("step", "outer_step", "loss", "lr", "tokens", "tokens_per_s", "run_tokens", "run_tokens_per_s"):
        assert field in steps[0]
    evals = [r for r in records if r["event"] == "eval"]
    assert [e["step"] for e in evals] == [30, 60]
    uniform = math.log(320)
    assert evals[-1]["loss"] < 0.6 * uniform, f"held-out loss {evals[-1]['loss']} is not well below uniform {uniform}"
    assert "step 60/60" in proc.stderr


def test_fake_data_runs(tmp_path):
    proc = _zb("--data.fake", "--optim.total_steps", "5", "--log.dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(read_metrics(tmp_path / "metrics.jsonl", "step")) == 1  # log_interval 10: only the last step


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.soak)])   # 2 ranks: soak (suite time)
def test_verbose_shows_debug_lines_on_the_training_path(tmp_path, nproc):
    """-v gives per-step timings and the settings with their sources, also on the ranks that torch's
    launcher starts (they do not see the command line's -v); without it, none."""
    ranks = ["--nproc-per-node", "2", "--optim.batch_size", "4", "--train.micro_bs", "2"] if nproc == 2 else []
    args = ("train", *FAST, "--optim.total_steps", "3", "--log.dir", str(tmp_path), *ranks)
    loud = zb_process("-v", *args)
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert "zb.train: step 2: data " in loud.stderr and "compute " in loud.stderr
    assert "setting optim.total_steps = 3 (flag --optim.total_steps)" in loud.stderr
    quiet = zb_process(*args)
    assert " D [" not in quiet.stderr


def _wait_for_steps(path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    wait_until(lambda: path.exists() and len(read_metrics(path, "step")) >= n, timeout, f"{n} logged steps",
               alive=[proc], details=lambda: proc.communicate()[1][-3000:] if proc.poll() is not None else "")


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigint_stops_cleanly_without_orphans(tmp_path, nproc):
    args = [sys.executable, "-m", "zb", "train", *FAST, "--optim.total_steps", "100000", "--train.log_interval", "1",
            "--log.dir", str(tmp_path)]
    if nproc > 1:
        args += ["--nproc-per-node", str(nproc), "--optim.batch_size", "16"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                            cwd=REPO, start_new_session=True)
    try:
        _wait_for_steps(tmp_path / "metrics.jsonl", 2, proc)
        children = psutil.Process(proc.pid).children(recursive=True)
        # A terminal's Ctrl-C reaches the whole foreground process group.
        import os

        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "stopped at step" in err
    # zb owns the launcher here: its clean stop is the last word, not torch's traceback or its
    # "Received 2 death signal, shutting down workers" / "Sending process N closing signal" lines.
    assert "Traceback" not in err and "death signal" not in err and "closing signal" not in err, err[-3000:]
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"orphans left: {alive}"
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(line) for line in lines)


def test_activation_checkpointing_and_bf16_on_cpu(tmp_path):
    proc = _zb("--data.fake", "--optim.total_steps", "5", "--train.ac_ckpt", "--train.param_dtype", "bf16",
               "--log.dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "params computed in bf16" in proc.stderr
    assert all(math.isfinite(s["loss"]) for s in read_metrics(tmp_path / "metrics.jsonl", "step"))


def test_two_writers_of_one_metrics_file_are_warned_about(tmp_path, caplog):
    """Two nodes given one log.dir: their lines interleave in one file, which must not pass silently."""
    import logging

    from zb.metrics import MetricsSink

    first = MetricsSink(tmp_path, "a")
    with caplog.at_level(logging.WARNING, logger="zb.metrics"):
        second = MetricsSink(tmp_path, "b")
    assert "another running zb process writes" in caplog.text
    second.close()
    first.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zb.metrics"):
        MetricsSink(tmp_path, "c").close()  # the earlier writers are gone: nothing to say
    assert "another running" not in caplog.text



def test_the_launcher_gives_the_ranks_their_checkpoint_grace_before_killing_them(monkeypatch):
    """torch's launcher SIGKILLs ranks 30 s after it forwards a Ctrl-C, as long as ckpt.grace_period
    (30 s) allows the final checkpoint: the two raced. zb's launcher waits grace + STOP_MARGIN_S."""
    import torch.distributed.run as torchrun

    from zb.train.launch import STOP_MARGIN_S, launch_local_ranks

    if not any("--shutdown-timeout" in a.option_strings for a in torchrun.get_args_parser()._actions):
        pytest.skip("this torch's launcher has no --shutdown-timeout")
    seen = []
    monkeypatch.setattr(torchrun, "run", seen.append)
    launch_local_ranks(2, ["train", "--nproc-per-node", "2", "--optim.lr", "1e-3"], grace_period_s=44.5)
    args = seen[0]
    assert args.shutdown_timeout == 45 + STOP_MARGIN_S and str(args.nproc_per_node) == "2"
    assert args.training_script_args == ["train", "--optim.lr", "1e-3"]


def test_a_signal_during_a_step_stops_the_node_after_that_step():
    """The stop vote reads the request at the step's end: a signal landing mid-step ends the run after
    that step (read at the start, one more step ran after "stopping after this step": issue 30)."""
    import torch

    from zb.train.device import Placement
    from zb.train.step import Trainer

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    placement = Placement(torch.device("cpu"), "gloo", torch.float32, torch.float32)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model
            self.signalled = False

        def forward(self, inputs, cu_seqlens=None, labels=None, loss=None):
            self.signalled = True            # the signal lands while the step computes
            out = self.inner(inputs.float()).square().mean()
            return out, out.detach() * 0

    wrapped = Model()
    trainer = Trainer(wrapped, opt, sched, placement, grad_clip=1.0, z_loss_weight=0.0)
    batch = (torch.ones(2, 4), torch.zeros(2, 4, dtype=torch.long))
    assert trainer.train_step([batch], stop_requested=lambda: wrapped.signalled).stop
    assert not trainer.train_step([batch]).stop


def test_the_plain_step_line_has_step_time_and_eta_and_the_run_rate_only_with_other_nodes():
    """On one node `tok/s` and `run tok/s` repeated each other, and plain logs had no step time or ETA
    (issue 30, minor)."""
    from zb.train.progress import StepClock, format_step_line

    clock = StepClock()
    for seconds in (5.0, 0.5, 0.5, 0.5):     # a slow first step does not swing the ETA
        clock.add(seconds)
    alone = format_step_line(10, 100, 2.0, 1e-3, 0.5, 1000.0, 1000.0, 10_000, step_s=0.5, eta_s=clock.eta(90))
    assert "run tok/s" not in alone and "0.5 s/step" in alone and alone.endswith("ETA 0:00:45")
    pooled = format_step_line(10, 100, 2.0, 1e-3, 0.5, 1000.0, 3000.0, 30_000, step_s=0.5, eta_s=None)
    assert "run tok/s 3,000" in pooled and "ETA" not in pooled


def test_data_too_small_for_a_held_out_split_is_refused_before_training(tmp_path):
    """One document leaves no held-out one for the rank: said at the start, exit 2, not after
    eval.interval steps of training (it trained 50 steps, then stopped at the first evaluation)."""
    data = tmp_path / "a.txt"
    data.write_text("one document without a blank line in it, " * 200 + "\n")
    common = ("--data.dataset_name_or_paths", str(data), "--data.tokenizer", "bytes", "--data.seq_length", "64")
    proc = _zb(*common, "--optim.total_steps", "50", "--log.dir", str(tmp_path / "logs"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "step 1/" not in proc.stderr and not read_metrics(tmp_path / "logs" / "metrics.jsonl", "step")
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: data.dataset_name_or_paths = ") and "has too few documents to hold out an eval " \
        "split for every rank" in last and "(eval.interval = -1)" in last and "1 document in" in last, last
    # Without evaluation the one document trains: 10 steps of 16 x 64 bytes read past its 8,401, so the stream wraps.
    proc = _zb(*common, "--optim.total_steps", "10", "--eval.interval", "-1", "--log.dir", str(tmp_path / "off"))
    assert proc.returncode == 0, proc.stderr[-3000:]
