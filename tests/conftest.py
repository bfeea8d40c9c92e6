"""Shared fixtures: the CLI through its real command tree, free ports, a clean environment."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    """Tests must not inherit a developer's ZB_*/GLOBAL_* settings."""
    for name in list(os.environ):
        if name.startswith(("ZB_", "GLOBAL_", "ZERO_BAND_")) and name not in ("ZB_USE_CPP",):
            monkeypatch.delenv(name, raising=False)


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


def wait_listening(port: int, timeout: float = 60.0, what: str = "zb store") -> None:
    """Until something accepts connections on 127.0.0.1:port (importing torch is slow on a busy box)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{what} did not start listening on port {port} within {timeout:g} s")


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: the repo importable even without an editable install."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZB_", "GLOBAL_", "ZERO_BAND_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


PYTHON = sys.executable
