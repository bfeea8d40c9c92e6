"""Every command stopped by SIGINT or SIGTERM at a point of its life, for tests/test_stops.py (one
signal per command, generous bounds) and scripts/stop_table.py (both signals, timed).

    with Stage(tmp) as stage:                 # a tiny checkpoint, a silent port, an in-process store
        for stop in stops(stage):
            outcome = stop.run(signal.SIGTERM)  # Outcome: code, seconds from the signal to the exit, the lines
            assert not outcome.problems(signal.SIGTERM)

A stop is a command line, a test of "it is at its point now" (a stderr line; a pause of
zb.testing.pause, which holds a function until the signal; or a child or connection that exists),
what its last stderr line must say, its exit codes, and what must not be left behind (temporary
directories, a checkpoint, child processes).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zb.testing.pause import PAUSED
from zb.testing.procs import PYTHON, REPO, TINY, free_port, subprocess_env

INTERRUPTED = {signal.SIGINT: 130, signal.SIGTERM: 143}   # 128 + the signal: a command that was cut short
SERVED = {signal.SIGINT: 0, signal.SIGTERM: 0}             # commands that run until a signal: that is their end


class Silent:
    """A port that accepts connections and never answers (a hung hub or store); counts what it accepted."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[tuple[float, socket.socket]] = []   # (time.monotonic(), the connection)
        threading.Thread(target=self._accept, name="silent-port", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.accepted.append((time.monotonic(), self.sock.accept()[0]))
            except OSError:
                return

    def reached_by(self, running: Running) -> bool:
        """A connection came after `running` started (its command is waiting for an answer)."""
        return any(at > running.started for at, _ in list(self.accepted))

    def close(self) -> None:
        self.sock.close()
        for _, conn in self.accepted:
            conn.close()


class Stage:
    """What the stops need: a tiny trained checkpoint, a token file, silent ports, a store (in-process)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = Path(tmp)
        self.ckpt = self.tmp / "ckpt"
        self.token = self.tmp / "token"
        self.silents: list[Silent] = []
        self.store: Any = None

    def __enter__(self) -> Stage:
        from zb.elastic.tcpstore import host

        train = subprocess.run([PYTHON, "-m", "zb", "train", *TINY, "--optim.total_steps", "2", "--ckpt.interval", "2",
                                "--ckpt.path", str(self.ckpt), "--ckpt.ram_dir", str(self.tmp / "ram"),
                                "--log.dir", str(self.tmp / "train-log")],
                               capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=REPO)
        if train.returncode:
            raise RuntimeError(f"the stage's checkpoint: zb train exited {train.returncode}: {train.stderr[-2000:]}")
        self.token.write_text("0" * 64)
        self.store = host("127.0.0.1", 0)
        return self

    def __exit__(self, *exc) -> None:
        for silent in self.silents:
            silent.close()
        self.store = None

    def silent(self) -> Silent:
        """A silent port of its own (its connections say that this stop's command reached it)."""
        self.silents.append(Silent())
        return self.silents[-1]

    @property
    def store_port(self) -> int:
        return self.store.port

    def fresh(self, name: str) -> Path:
        """An empty directory for one run of a stop."""
        path = self.tmp / "runs" / f"{name}-{time.monotonic_ns()}"
        path.mkdir(parents=True)
        return path


@dataclass
class Outcome:
    code: int | None           # None: still running after the bound (then killed)
    seconds: float             # from the signal to the exit
    lines: list[str]           # stderr, every line
    left: list[str]            # what it left that it must not (temporary files, a checkpoint, child processes)
    expected_code: int
    expected_line: str

    def line(self) -> str:
        """The line that says what the stop did (the last one when none does)."""
        return next((line for line in reversed(self.lines) if re.search(self.expected_line, line)),
                    next((line for line in reversed(self.lines) if line.strip()), ""))

    def problems(self) -> list[str]:
        found = []
        if self.code != self.expected_code:
            found.append(f"exit code {self.code}, expected {self.expected_code}")
        if not re.search(self.expected_line, self.line()):
            found.append(f"no line matches {self.expected_line!r} (the last: {self.line()!r})")
        if any("Traceback" in line for line in self.lines):
            found.append("a traceback")
        found += [f"left behind: {what}" for what in self.left]
        return found


@dataclass
class Stop:
    name: str                                  # "export (hashing the checkpoint)"
    argv: list[str]                            # after `python`
    ready: Callable[[Running], bool]         # the command is at its point now
    line: dict[signal.Signals, str]            # signal -> what its line says (a regex): the one line of the stop
    codes: dict[signal.Signals, int] = field(default_factory=lambda: dict(INTERRUPTED))
    env: dict[str, str] = field(default_factory=dict)
    leftovers: Callable[[], list[str]] = lambda: []   # called after the exit

    def run(self, sig: signal.Signals, *, ready_s: float = 120.0, bound_s: float = 30.0) -> Outcome:
        """Start it, wait until it is at its point, send `sig`, wait up to bound_s for the exit."""
        running = Running(subprocess.Popen([PYTHON, *self.argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                           text=True, env=subprocess_env(**self.env), cwd=REPO,
                                           start_new_session=True))
        try:
            running.wait_for(self.ready, ready_s, self.name)
            children = running.children()
            sent = time.monotonic()
            running.proc.send_signal(sig)
            try:
                running.proc.wait(bound_s)
                code: int | None = running.proc.returncode
            except subprocess.TimeoutExpired:
                code = None
            seconds = time.monotonic() - sent
        finally:
            running.kill_group()
        left = self.leftovers() + running.survivors(children)
        return Outcome(code, seconds, running.lines(), left, self.codes[sig], self.line[sig])


class Running:
    """A started command: its stderr as it comes, its children."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.started = time.monotonic()
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read, name="stop-stderr", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._lines.append(line.rstrip("\n"))

    def lines(self) -> list[str]:
        self._reader.join(5)
        return list(self._lines)

    def said(self, pattern: str) -> bool:
        return any(re.search(pattern, line) for line in list(self._lines))

    def children(self) -> list[int]:
        try:
            text = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except OSError:
            return []
        return [int(pid) for pid in text.split()]

    def wait_for(self, ready: Callable[[Running], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready(self):
            if self.proc.poll() is not None:
                raise AssertionError(f"{what}: exited ({self.proc.returncode}) before its point:\n"
                                     + "\n".join(self.lines()[-20:]))
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not at its point within {timeout:g} s:\n" + "\n".join(self._lines[-20:]))
            time.sleep(0.02)

    def survivors(self, children: list[int], grace_s: float = 5.0) -> list[str]:
        """The children (at the signal) still alive a moment after the command's exit."""
        deadline = time.monotonic() + grace_s
        alive = children
        while alive and time.monotonic() < deadline:
            alive = [pid for pid in alive if _alive(pid)]
            time.sleep(0.05)
        return [f"child process {pid}" for pid in alive]

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def paused(running: Running) -> bool:
    return running.said(re.escape(PAUSED))


def saying(pattern: str) -> Callable[[Running], bool]:
    return lambda running: running.said(pattern)


def zb(*args: str) -> list[str]:
    return ["-m", "zb", *args]


def pause(target: str, *args: str) -> list[str]:
    return ["-m", "zb.testing.pause", target, "--", *args]


def _temporaries(directory: Path, out: Path | None = None) -> Callable[[], list[str]]:
    """What an interrupted writer must not leave in `directory`: hidden temporaries, or OUT itself."""
    def left() -> list[str]:
        found = [str(p) for p in directory.iterdir() if p.name.startswith(".")]
        return found + ([str(out)] if out is not None and out.exists() else [])
    return left


def _no_checkpoint(ckpt: Path) -> Callable[[], list[str]]:
    return lambda: [str(p) for p in ckpt.glob("step-*")]


def stops(stage: Stage) -> list[Stop]:
    """One stop per command (two where a command has two lives), each at its point."""
    return [*_training(stage), *_checkpoint_readers(stage), *_services(stage), *_benchmarks(stage)]


def _training(stage: Stage) -> list[Stop]:
    setup, running = stage.fresh("train-setup"), stage.fresh("train-running")
    silent = stage.silent()
    joining = stage.fresh("train-joining")
    before = r"error: interrupted by {} before training started: no step was taken and no checkpoint written"
    return [
        Stop("zb train (building the model)",
             pause("zb.train.run:build_model", "train", *TINY, "--log.dir", str(setup / "log"), "--ckpt.path",
                   str(setup / "ckpt"), "--ckpt.ram_dir", str(setup / "ram")),
             paused, {s: before.format(s.name) for s in INTERRUPTED}, leftovers=_no_checkpoint(setup / "ckpt")),
        Stop("zb train (joining a store that does not answer)",
             zb("train", *TINY, "--diloco.inner_steps", "2", "--elastic.addr", "127.0.0.1", "--elastic.port",
                str(silent.port), "--log.dir", str(joining / "log"), "--ckpt.path", str(joining / "ckpt"),
                "--ckpt.ram_dir", str(joining / "ram")),
             # The join's own line comes after the loop's stop is installed (the status publisher may reach the
             # silent store earlier, while a signal still means "before training started").
             lambda r: r.said(r"zb\.train: joining the DiLoCo run at") and silent.reached_by(r),
             {s: "stopped at step 0 on request" for s in INTERRUPTED}, leftovers=_no_checkpoint(joining / "ckpt")),
        Stop("zb train (training)",
             zb("train", *TINY, "--optim.total_steps", "100000", "--log.dir", str(running / "log"), "--ckpt.path",
                str(running / "ckpt"), "--ckpt.ram_dir", str(running / "ram"), "--ckpt.interval", "1000"),
             saying(r"step 3\b"), {s: r"stopped at step \d+ on request" for s in INTERRUPTED}),
    ]


def _checkpoint_readers(stage: Stage) -> list[Stop]:
    hashing, writing = stage.fresh("export-hashing"), stage.fresh("export-writing")
    kept = r"error: interrupted by {} before the export was complete: .* is as it was and nothing was left behind"
    return [
        Stop("zb export (checking the checkpoint's sha256)",
             pause("zb.export.source:verify_snapshot", "export", str(stage.ckpt), str(hashing / "out")),
             paused, {s: kept.format(s.name) for s in INTERRUPTED}, leftovers=_temporaries(hashing, hashing / "out")),
        Stop("zb export (writing the weights)",
             pause("zb.export.writer:write_tensor_file", "export", str(stage.ckpt), str(writing / "out")),
             paused, {s: kept.format(s.name) for s in INTERRUPTED}, leftovers=_temporaries(writing, writing / "out")),
        Stop("zb generate (sampling)",
             pause("zb.generate:generate", "generate", str(stage.ckpt), "--prompt", "the"),
             paused, {s: f"error: interrupted by {s.name}$" for s in INTERRUPTED}),
        Stop("zb ckpt verify (hashing)",
             pause("zb.ckpt.durable.inventory:verify_snapshot", "ckpt", "verify", str(stage.ckpt / "step-000000002")),
             paused, {s: f"error: interrupted by {s.name}$" for s in INTERRUPTED}),
        Stop("zb ckpt ls (listing)",
             pause("zb.ckpt.durable.inventory:list_checkpoints", "ckpt", "ls", str(stage.ckpt)),
             paused, {s: f"error: interrupted by {s.name}$" for s in INTERRUPTED}),
    ]


def _services(stage: Stage) -> list[Stop]:
    silent, hub_port = stage.silent(), stage.silent()
    hub = stage.fresh("subset-data")
    store = f"127.0.0.1:{stage.store_port}"
    return [
        Stop("zb store (serving)", zb("store", "--port", str(free_port())), saying("zb store listening"),
             {s: r"store on .* stopped" for s in SERVED}, codes=dict(SERVED)),
        Stop("zb status --watch", zb("status", "--store", store, "--watch", "--interval", "0.5"),
             saying("no run on the store"), {s: f"zb status: stopped \\({s.name}\\)" for s in SERVED},
             codes=dict(SERVED)),
        Stop("zb status --serve", zb("status", "--store", store, "--serve", "--http-port", "0"),
             saying("zb status: dashboard"), {s: f"zb status: dashboard stopped \\({s.name}\\)" for s in SERVED},
             codes=dict(SERVED)),
        Stop("zb status (a store that does not answer)",
             zb("status", "--store", f"127.0.0.1:{silent.port}", "--timeout", "60"),
             silent.reached_by, {s: f"error: interrupted by {s.name}$" for s in INTERRUPTED}),
        Stop("zb ckpt-serve (serving)",
             zb("ckpt-serve", "--dir", str(stage.ckpt), "--token-file", str(stage.token)),
             saying("zb ckpt-serve: serving"), {s: "stopping the sidecar" for s in SERVED}, codes=dict(SERVED)),
        Stop("zb subset-data (a hub that does not answer)",
             zb("subset-data", "--dataset", "someone/data", "--out", str(hub / "cache")),
             hub_port.reached_by, {s: f"error: interrupted by {s.name}$" for s in INTERRUPTED},
             env={"HF_ENDPOINT": f"http://127.0.0.1:{hub_port.port}", "HF_HUB_OFFLINE": "0"}),
    ]


def _benchmarks(stage: Stage) -> list[Stop]:
    return [
        Stop("zb bench-allreduce (2 local ranks)",
             zb("bench-allreduce", "--world-size", "2", "--size-mb", "1", "--iterations", "1000000",
                "--compressions", "none"),
             lambda r: len(r.children()) == 2, {s: f"error: interrupted by {s.name}$" for s in INTERRUPTED}),
        Stop("zb iperf-mesh (2 local ranks)",
             zb("iperf-mesh", "--world-size", "2", "--duration", "60"),
             lambda r: len(r.children()) == 1, {s: f"error: interrupted by {s.name}$" for s in INTERRUPTED}),
    ]
