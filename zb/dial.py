"""Host names given on the command line: a name that does not resolve, and dialing a TCP address
before torch does.

A name that does not resolve is a mistake in the invocation (exit 2), wherever it is given; only a
resolver that failed for now (EAI_AGAIN: no DNS server reachable) is the environment (exit 1).
torch's TCPStore logs about 40 lines of C++ stack frames when it cannot connect: a plain TCP connect
first turns that into one line, and bounds the wait.
"""

from __future__ import annotations

import socket
import threading
import time

from zb import stop_signals
from zb.errors import EnvironmentFailure, InvalidInput, LeavingRun, ZbError
from zb.signed_store import authenticated, declare


def unresolvable(option: str, host: str, error: socket.gaierror) -> ZbError:
    """The error for `host`, given as `option`, that getaddrinfo refused."""
    if error.errno == socket.EAI_AGAIN:
        return EnvironmentFailure(f"{option} {host!r}: cannot resolve it now ({error.strerror}); check this "
                                  "machine's DNS, or give an IP address")
    return InvalidInput(f"{option} {host!r} is not a valid address ({error.strerror}); give an IP address or a "
                        "host name that resolves")


def wait_listening(host: str, port: int, timeout_s: float, option: str) -> OSError | None:
    """Poll a plain TCP connect to host:port until it is accepted (None) or `timeout_s` passes (the last
    error); a host that does not resolve raises unresolvable() at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))).close()
            return None
        except socket.gaierror as e:
            raise unresolvable(option, host, e) from None
        except OSError as e:
            if time.monotonic() >= deadline:
                return e
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


_handshakes: dict[tuple[str, int], threading.Thread] = {}   # the newest handshake helper per address
_handshakes_lock = threading.Lock()


def store_client(host: str, port: int, timeout_s: float, answer_s: float, hint: str,
                 failure: type[ZbError] = EnvironmentFailure, **options):
    """A TCPStore client of host:port (`options` go to torch's constructor), or one `failure` line
    when what listens there does not answer as a TCPStore within `answer_s` s.

    torch's client sends its handshake and waits without end for the reply, in C++, on the calling
    thread: against an HTTP server or a hung process that was a `zb train` ignoring Ctrl-C twice and
    SIGTERM, killable only by SIGKILL. So the client is built on a helper thread while this one waits
    in short slices, where signal handlers run; a stop signal (zb.stop_signals) ends the wait on the
    main thread at once with LeavingRun. A helper left waiting on a silent peer is a daemon thread."""
    from datetime import timedelta

    import torch.distributed as dist

    result: dict = {}

    def build() -> None:
        try:
            result["store"] = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                                            **options)
        except Exception as e:  # noqa: BLE001 - DistNetworkError / RuntimeError, one line for the user
            result["error"] = str(e).splitlines()[0][:160]

    deadline = time.monotonic() + answer_s
    on_main = threading.current_thread() is threading.main_thread()

    def wait_for(thread: threading.Thread) -> None:
        while thread.is_alive() and time.monotonic() < deadline:
            thread.join(0.1)
            if on_main and thread.is_alive() and stop_signals.requested():
                raise LeavingRun(f"{stop_signals.requested()} received while connecting to the store at "
                                 f"{host}:{port}")

    # At most one handshake per address in flight: a store that hangs (SIGSTOPped, say) would otherwise
    # leave a helper thread behind for every retry of every caller (heartbeats retry each interval).
    with _handshakes_lock:
        earlier = _handshakes.get((host, port))
    if earlier is not None:
        wait_for(earlier)
        if earlier.is_alive():
            raise failure(f"{host}:{port} accepts connections but does not answer as a TCPStore (an earlier "
                          f"handshake is still waiting after {answer_s:g} s): is it a `zb store`? {hint}")
    helper = threading.Thread(target=build, name="zb-store-handshake", daemon=True)
    with _handshakes_lock:
        _handshakes[(host, port)] = helper
    helper.start()
    wait_for(helper)
    if "store" in result:
        return result["store"]
    why = result.get("error") or f"no answer within {answer_s:g} s"
    raise failure(f"{host}:{port} accepts connections but does not answer as a TCPStore ({why}): is it a "
                  f"`zb store`? {hint}")


def connect_store(host: str, port: int, rank: int, world: int, timeout_s: float, option: str = "--store",
                  raise_hint: str = "", secret: bytes | None = None):
    """A TCPStore for a command's ranks: rank 0 hosts it, the others connect. An unresolvable host is
    unresolvable(); a store not reachable (or not hostable) within timeout_s is one EnvironmentFailure
    line, `raise_hint` appended (what the command's user can raise), never torch's C++ frames. With a run
    `secret` (--secret-file) every record is sealed (zb.signed_store; these commands keep no counters)."""
    store = _connect_store(host, port, rank, world, timeout_s, option, raise_hint)
    where = f"{host}:{port}"
    if rank == 0:
        declare(store, secret, where)
    return authenticated(store, secret, where, counters=lambda key: False, host_decides=rank != 0)


def _connect_store(host: str, port: int, rank: int, world: int, timeout_s: float, option: str, raise_hint: str):
    from datetime import timedelta

    import torch.distributed as dist

    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise unresolvable(option, host, e) from None
    if rank != 0:
        # A plain connect first: torch's client retries for its whole timeout, logging C++ frames.
        failed = wait_listening(host, port, timeout_s, option)
        if failed is not None:
            raise EnvironmentFailure(f"cannot reach the store at {host}:{port} within {timeout_s:g} s "
                                     f"({failed.strerror or failed}); check the address and that rank 0 is "
                                     f"running{raise_hint}")
        return store_client(host, port, timeout_s, timeout_s, f"check the address{raise_hint}", world_size=world,
                            wait_for_workers=False)
    try:
        # wait_for_workers=False: the command's own start barrier waits instead, and names who is missing.
        return dist.TCPStore(host, port, world, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except Exception as e:  # noqa: BLE001 - DistNetworkError / RuntimeError, one line for the user
        raise EnvironmentFailure(f"cannot host the store on {host}:{port} within {timeout_s:g} s "
                                 f"({str(e).splitlines()[0]}); is the port free?") from None

