"""Shared test helpers: the CLI in-process (run_zb) and as a real process (zb_process), free ports,
a clean environment, one bounded wait (wait_until), the tiny-model arguments, and the loader of
benchmark scripts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest
from click.testing import CliRunner

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    """Tests must not inherit a developer's ZB_*/GLOBAL_* settings."""
    for name in list(os.environ):
        if name.startswith(("ZB_", "GLOBAL_", "ZERO_BAND_")) and name not in ("ZB_USE_CPP",):
            monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _no_stop_signal_yet(monkeypatch):
    """zb.stop_signals records a stop signal for the whole process; a test that sent one to this process
    (a `zb store` stopped in-process) must not leave it for the next test's waits."""
    from zb import stop_signals

    monkeypatch.setattr(stop_signals, "_received", None)


@pytest.fixture
def cli_runner():
    return CliRunner()


@pytest.fixture
def run_zb(cli_runner):
    """Invoke `zb ...` in-process through the real command tree; returns click's Result."""
    from zb.cli import cli

    def invoke(*args: str, **kwargs):
        return cli_runner.invoke(cli, list(args), catch_exceptions=False, **kwargs)

    return invoke


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition: Callable[[], Any], timeout: float, what: str, *, alive: Iterable[subprocess.Popen] = (),
               details: Callable[[], str] = lambda: "", poll: float = 0.2) -> Any:
    """Poll `condition` until it returns something truthy (returned); fail naming `what` after
    `timeout` s, or at once when one of the `alive` processes exited. `details` adds to the message."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        for proc in alive:
            assert proc.poll() is None, (f"a process exited (code {proc.returncode}) while waiting for {what}\n"
                                         f"{details()}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s\n{details()}")
        time.sleep(poll)


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def wait_listening(port: int, timeout: float = 60.0, what: str = "zb store") -> None:
    """Until something accepts connections on 127.0.0.1:port (importing torch is slow on a busy box)."""
    wait_until(lambda: _accepts(port), timeout, f"{what} listening on port {port}", poll=0.1)


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: the repo importable even without an editable install."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZB_", "GLOBAL_", "ZERO_BAND_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


PYTHON = sys.executable

# A model and batch small enough for a whole `zb train` process in a few seconds on 2 busy cores.
TINY = ["--data.seq_length", "32", "--optim.batch_size", "4", "--train.micro_bs", "2", "--optim.warmup_steps", "2",
        "--train.log_interval", "1", "--eval.interval", "-1", "--log.progress", "plain", "--train.device", "cpu"]


def zb_process(*args: str, timeout: float = 150, **env: str) -> subprocess.CompletedProcess:
    """`python -m zb ARGS` as a real process (exit codes, stderr), with output captured."""
    return subprocess.run([PYTHON, "-m", "zb", *args], capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env(**env), cwd=REPO)


def zb_train(tmp_path: Path, *args: str, timeout: float = 170) -> subprocess.CompletedProcess:
    """A tiny `zb train` run to its end, staging checkpoints under tmp_path/ram."""
    return zb_process("train", *TINY, "--ckpt.ram_dir", str(tmp_path / "ram"), *args, timeout=timeout)


def zb_train_until_sigterm(tmp_path: Path, event: str, count: int, *args: str) -> tuple[int, str]:
    """A tiny `zb train` run (metrics under tmp_path/log) sent SIGTERM once its metrics hold `count`
    `event` lines, as a spot preemption would; returns its exit code and stderr."""
    import signal

    from zb.metrics import read_metrics

    metrics = tmp_path / "log" / "metrics.jsonl"
    proc = subprocess.Popen([PYTHON, "-m", "zb", "train", *TINY, "--ckpt.ram_dir", str(tmp_path / "ram"), *args,
                             "--optim.total_steps", "100000", "--log.dir", str(tmp_path / "log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                            cwd=REPO)
    try:
        wait_until(lambda: metrics.exists() and len(read_metrics(metrics, event)) >= count, 120,
                   f"{count} {event} events", alive=[proc])
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return proc.returncode, err


def load_script(name: str):
    """scripts/<name>.py as a module: benchmarks are importable functions with a main(argv) (scripts/
    goes on sys.path too: some scripts import their siblings)."""
    import importlib.util

    if str(REPO / "scripts") not in sys.path:
        sys.path.insert(0, str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def peer(tmp_path):
    """A checkpoint sidecar in a thread over a snapshot root: peer(name) -> (root, handle); closed after
    the test (see ckpt_peers for the snapshot it serves)."""
    from ckpt_peers import TOKEN, write_sample

    from zb.ckpt.sidecar.server import serve_in_thread

    handles = []

    def start(name: str = "a", snapshot: bool = True, timeout: float = 30.0):
        root = tmp_path / name
        root.mkdir()
        if snapshot:
            write_sample(root, node=name)
        handle = serve_in_thread(root, TOKEN, "127.0.0.1", 0, client_timeout=timeout)
        handles.append(handle)
        return root, handle

    yield start
    for h in handles:
        h.close()


@pytest.fixture
def make_run(tmp_path):
    """make_run(world_size): whole `zb train` nodes around a real `zb store` (tests/elastic_cluster.py)."""
    from elastic_cluster import TrainCluster

    runs = []

    def make(world_size: int):
        runs.append(TrainCluster(tmp_path, world_size))
        return runs[-1]

    yield make
    for r in runs:
        r.close()


@pytest.fixture
def cluster(tmp_path):
    """Membership driver nodes around a store hosted in this process (tests/elastic_cluster.py)."""
    from elastic_cluster import Cluster

    c = Cluster(tmp_path)
    c.host_store()
    yield c
    c.close()


def same_batch(x, y) -> bool:
    """Equal inputs, labels and document boundaries (both None, or equal tensors)."""
    import torch

    return all(a is b is None or (a is not None and b is not None and torch.equal(a, b)) for a, b in zip(x, y))


# A 2-stage DiLoCo-SWARM run with short waits (tests/test_swarm_run.py, test_swarm_checkpoints.py).
SWARM = ["--swarm.stages", "2", "--swarm.hop_timeout", "5", "--swarm.stage_wait", "30"]
