"""Process helpers for tests and scripts: the checkout root (REPO), the CLI as a real process
(zb_process, zb_train), free ports, a clean environment for children, one bounded wait (wait_until),
and the tiny-model arguments (TINY).

Used from a source checkout (see zb.testing): REPO is the directory that holds the zb package this
module was imported from, so children started with subprocess_env import that same zb.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

# zb/testing/procs.py -> zb/testing -> zb -> the checkout root (symlinks resolved; whatever the cwd).
REPO = Path(__file__).resolve().parents[2]

PYTHON = sys.executable


def pyproject() -> dict[str, Any]:
    """The checkout's pyproject.toml, parsed (with the TOML reader zb's config uses on any Python)."""
    from zb.config import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())

# A model and batch small enough for a whole `zb train` process in a few seconds on 2 busy cores.
TINY = ["--data.seq_length", "32", "--optim.batch_size", "4", "--train.micro_bs", "2", "--optim.warmup_steps", "2",
        "--train.log_interval", "1", "--eval.interval", "-1", "--log.progress", "plain", "--train.device", "cpu"]


def checkout_file(path: str | Path) -> str:
    """A file of the checkout (`path` relative to REPO, or absolute) as a string, failing clearly when
    it is missing: an installed zb has no tests/ beside it."""
    path = REPO / path
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: zb.testing's harness runs from a source checkout "
                                f"(zb is imported from {REPO / 'zb'})")
    return str(path)


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


# The RAM staging directory of this test process's children (ckpt.ram_dir): one per process, so two
# pytest workers never share one (two tests' nodes named n0 would otherwise clear each other's copies).
# Removed when this process exits.
RAM_DIR = str(Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()) / f"zb-tests-{os.getpid()}")
atexit.register(shutil.rmtree, RAM_DIR, ignore_errors=True)


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: the repo importable even without an editable install, and
    this test process's own ckpt.ram_dir (a test's --ckpt.ram_dir still wins)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZB_", "GLOBAL_", "ZERO_BAND_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["ZB_CKPT_RAM_DIR"] = RAM_DIR
    env.update(extra)
    return env


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
