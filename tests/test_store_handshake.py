"""A store address where something listens that is not a TCPStore (an HTTP server, a hung process):
one line and exit 1 within the connect timeout, and a stop signal ends the wait at once (issue 30,
defect 1: `zb train` hung there with no deadline and ignored SIGINT twice and SIGTERM)."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading

import pytest

from zb import stop_signals
from zb.errors import EnvironmentFailure, LeavingRun
from zb.store_clients import handshake
from zb.testing.procs import PYTHON, REPO, TINY, free_port, subprocess_env, wait_until


class SilentServer:
    """Accepts connections and reads what comes, never answering: what torch's client meets at an HTTP
    server (it waits for the end of a request line that the handshake never sends) or a hung store."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


@pytest.fixture
def silent():
    server = SilentServer()
    yield server
    server.close()


def test_a_peer_that_never_answers_is_one_error_within_the_bound(silent):
    with pytest.raises(EnvironmentFailure, match="accepts connections but does not answer as a TCPStore"):
        handshake("127.0.0.1", silent.port, 30.0, 1.0, "check the address", use_libuv=True)


def test_a_stop_signal_ends_the_wait_on_the_main_thread(silent, monkeypatch):
    threading.Timer(0.5, stop_signals.note, args=("SIGINT",)).start()
    with pytest.raises(LeavingRun, match="SIGINT received while connecting"):
        handshake("127.0.0.1", silent.port, 30.0, 60.0, "check the address", use_libuv=True)


def test_a_real_store_still_answers():
    from zb.elastic.tcpstore import host

    port = free_port()
    server = host("127.0.0.1", port)
    client = handshake("127.0.0.1", port, 10.0, 10.0, "", use_libuv=True)
    client.set("k", "v")
    assert server.get("k") == b"v"


def _train_against(port: int, *args: str) -> subprocess.Popen:
    env = subprocess_env(GLOBAL_ADDR="127.0.0.1", GLOBAL_PORT=str(port), GLOBAL_WORLD_SIZE="2", GLOBAL_UNIQUE_ID="n0")
    return subprocess.Popen([PYTHON, "-m", "zb", "train", "@configs/debug/diloco.toml", *TINY, *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def test_train_against_something_that_is_not_a_store_exits_1_in_one_line(silent):
    proc = _train_against(silent.port, "--elastic.connect_timeout", "3")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "does not answer as a TCPStore" in errors[0] and "GLOBAL_PORT" in errors[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_train_while_it_waits_for_the_handshake(silent, tmp_path, sig, code):
    proc = _train_against(silent.port, "--elastic.connect_timeout", "600", "--log.dir", str(tmp_path))
    try:
        # The node is connecting once something dialed the silent server (the plain probe, then the client).
        wait_until(lambda: len(silent.conns) >= 2, 120, "the node dialing the store", alive=[proc])
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)   # before the fix: never (only SIGKILL ended it)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == code, err
    assert f"{sig.name} received" in err and "Traceback" not in err


def test_retries_against_a_hung_peer_leave_one_waiting_thread_not_one_per_try(silent):
    """A store that hangs is retried every heartbeat interval: each try must not leave a thread behind."""
    def waiting() -> int:
        return sum(t.name == "zb-store-handshake" and t.is_alive() for t in threading.enumerate())

    before = waiting()
    for _ in range(4):
        with pytest.raises(EnvironmentFailure, match="does not answer as a TCPStore"):
            handshake("127.0.0.1", silent.port, 30.0, 0.3, "check the address", use_libuv=True)
    assert waiting() - before == 1
