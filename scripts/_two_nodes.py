"""A `zb store` and two DiLoCo nodes of `zb train` on this machine, run to their end: what
scripts/gpu_smoke.py's diloco stage and scripts/bench_gpu.py's diloco part share."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def repo_env(**extra: str) -> dict[str, str]:
    """This environment with the checkout importable (no install needed) and `extra` set."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_nodes(work: Path, name: str, args_of: Callable[[int], list[str]], timeout: float,
                  env_of: Callable[[int], dict[str, str]] = lambda i: {},
                  shared_env: dict[str, str] | None = None) -> str | None:
    """Start the store and nodes `<name>0` and `<name>1` (`zb train` + args_of(i), extra environment
    env_of(i)), logs in work/<name>I.log; None when both exit 0, else which failed and the log to read.
    `shared_env` is set for the store and both nodes (a run secret: ZB_ELASTIC_SECRET_FILE).
    Whatever is still running at the end is killed."""
    port = free_port()
    shared_env = shared_env or {}
    store_log = (work / "store.log").open("w")
    store = subprocess.Popen([sys.executable, "-m", "zb", "store", "--port", str(port)], stdout=store_log,
                             stderr=subprocess.STDOUT, cwd=REPO, env=repo_env(**shared_env))
    nodes, failed = [], None
    try:
        for i in range(2):
            env = repo_env(GLOBAL_ADDR="127.0.0.1", GLOBAL_PORT=str(port), GLOBAL_WORLD_SIZE="2", GLOBAL_RANK=str(i),
                           GLOBAL_UNIQUE_ID=f"{name}{i}", **shared_env, **env_of(i))
            log = (work / f"{name}{i}.log").open("w")
            nodes.append((subprocess.Popen([sys.executable, "-m", "zb", "train", *args_of(i)], stdout=log,
                                           stderr=subprocess.STDOUT, cwd=REPO, env=env), log))
        for i, (proc, _) in enumerate(nodes):
            try:
                code: int | str = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = f"no exit within {timeout:.0f} s"
            if code != 0 and failed is None:
                failed = f"{name} node {i}: exit {code} (log: {work / f'{name}{i}.log'})"
    finally:
        for proc, log in nodes:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        store.terminate()
        store.wait(timeout=30)
        store_log.close()
    return failed
