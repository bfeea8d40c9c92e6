"""Processes for scripts/bench_convergence.py: one `zb train`, or a `zb store` plus N DiLoCo nodes.

Every node is a real `zb train` process with its own --log.dir (as in
scripts/simulate_multi_node_diloco.sh); the elastic variant SIGKILLs one node after some outer
steps and starts a new one (a new unique id) that joins the running run. Every wait is bounded and
every process is killed (by its own process group) when a run ends or fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from zb.elastic.profiles import SHORT_TIMEOUTS as ELASTIC_PROFILE  # a SIGKILLed node is evicted in seconds
from zb.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]


HOSTILE = Path(__file__).resolve().parent / "_hostile_node.py"

def base_env(**extra: str) -> dict[str, str]:
    """The caller's env, the repo on PYTHONPATH, one torch thread per process (several processes
    share 2 cores: more threads only oversubscribe them, and made a run ~10x slower)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """The processes of one run; `close()` kills whatever is still alive."""

    def __init__(self, workdir: Path, env: dict[str, str], timeout: float):
        self.workdir, self.env = workdir, env
        self.deadline = time.monotonic() + timeout
        self.procs: dict[str, subprocess.Popen] = {}
        workdir.mkdir(parents=True, exist_ok=True)

    def spawn(self, name: str, argv: list[str], launcher: list[str] | None = None, **env: str) -> subprocess.Popen:
        """`python -m zb ARGV` (or `python LAUNCHER... ARGV`, e.g. the hostile node's driver)."""
        err = open(self.workdir / f"{name}.log", "w")
        proc = subprocess.Popen([sys.executable, *(launcher or ["-m", "zb"]), *argv], env=dict(self.env, **env), cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        err.close()
        self.procs[name] = proc
        return proc

    def train(self, name: str, args: list[str], launcher: list[str] | None = None, **env: str) -> subprocess.Popen:
        return self.spawn(name, ["train", *args, "--log.dir", str(self.workdir / name)], launcher, **env)

    def metrics(self, name: str, event: str) -> list[dict]:
        path = self.workdir / name / "metrics.jsonl"
        return read_metrics(path, event) if path.exists() else []

    def log_tail(self, name: str, n: int = 20) -> str:
        return "\n".join((self.workdir / f"{name}.log").read_text().splitlines()[-n:])

    def check_alive(self, name: str) -> None:
        code = self.procs[name].poll()
        if code is not None and code != 0:
            raise RuntimeError(f"{name} exited with {code}:\n{self.log_tail(name)}")

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("run did not finish in time; logs in " + str(self.workdir))
        return left

    def wait(self, names: list[str]) -> None:
        """Wait for every named process to exit 0 (bounded by the run's deadline)."""
        for name in names:
            try:
                code = self.procs[name].wait(self.remaining())
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{name} did not finish in time:\n{self.log_tail(name)}") from None
            if code != 0:
                raise RuntimeError(f"{name} exited with {code}:\n{self.log_tail(name)}")

    def wait_outer(self, name: str, outer_step: int) -> None:
        while not any(e["outer_step"] >= outer_step for e in self.metrics(name, "outer_step")):
            self.check_alive(name)
            if self.procs[name].poll() == 0:
                raise RuntimeError(f"{name} finished before outer step {outer_step}")
            self.remaining()
            time.sleep(0.2)

    def kill(self, name: str) -> None:
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait(10)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def start_store(procs: Procs) -> int:
    port = free_port()
    procs.spawn("store", ["store", "--port", str(port)])
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return port
        except OSError:
            procs.check_alive("store")
            if procs.deadline - time.monotonic() < 0:
                raise TimeoutError("zb store did not start listening") from None
            time.sleep(0.1)


def run_single(workdir: Path, args: list[str], timeout: float) -> dict[str, list[dict]]:
    """One `zb train` process without DiLoCo; returns {name: metrics records}."""
    procs = Procs(workdir, base_env(), timeout)
    try:
        procs.train("node0", args)
        procs.wait(["node0"])
        return {"node0": read_metrics(workdir / "node0" / "metrics.jsonl")}
    finally:
        procs.close()


def run_nodes(workdir: Path, args: list[str], nodes: int, timeout: float, kill_at: int | None = None,
              hostile: float | None = None) -> tuple[dict[str, list[dict]], list[str]]:
    """`zb store` plus `nodes` DiLoCo nodes. With `kill_at`, the last node is SIGKILLed once it has
    logged that outer step and a new node (another unique id, same preferred rank) joins at once. With
    `hostile`, the last node sends its pseudo-gradient times that factor (scripts/_hostile_node.py).
    Returns ({name: metrics records}, names of the nodes alive at the end)."""
    profile = ELASTIC_PROFILE if kill_at is not None else {}
    procs = Procs(workdir, base_env(**profile), timeout)
    try:
        port = start_store(procs)
        env = dict(GLOBAL_ADDR="127.0.0.1", GLOBAL_PORT=str(port), GLOBAL_WORLD_SIZE=str(nodes))
        names = [f"node{i}" for i in range(nodes)]
        for i, name in enumerate(names):
            launcher = [str(HOSTILE), str(hostile)] if hostile is not None and i == nodes - 1 else None
            procs.train(name, args, launcher, GLOBAL_RANK=str(i), GLOBAL_UNIQUE_ID=name, **env)
        if kill_at is not None:
            victim = names[-1]
            procs.wait_outer(victim, kill_at)
            procs.kill(victim)
            joiner = f"{victim}j"
            procs.train(joiner, args, GLOBAL_RANK=str(nodes - 1), GLOBAL_UNIQUE_ID=joiner, **env)
            names = [*names[:-1], joiner]
        procs.wait(names)
        records = {name: read_metrics(workdir / name / "metrics.jsonl") for name in procs.procs if name != "store"}
        return records, names
    finally:
        procs.close()
