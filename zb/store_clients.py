"""Every client of a `zb store` that zb makes comes from here: one function per kind of caller.

A client is a torch TCPStore client, sealed with the run secret where there is one (zb.signed_store) and
put under a namespace where the caller has one. Three waits bound each kind, and each function's text
names its own:
- the connect wait: how long a port that does not accept yet is waited for (a plain TCP connect first:
  torch's client retries for its whole timeout, logging C++ stack frames, and a dead store must be one line);
- the answer wait: how long the TCPStore handshake may take once the port accepts (torch waits for the
  reply without end, in C++; `handshake` bounds it and keeps Ctrl-C working);
- the operation timeout: torch's timeout of every later get, wait and compare_set of the client.

| function            | who                                                    | wraps                                    |
|---------------------|--------------------------------------------------------|------------------------------------------|
| `run_client`        | a node (through zb.elastic.stores.StoreList.connect)   | the secret (writes the run marker), the namespace |
| `reading_client`    | `zb status`, the dashboard: one store                  | the secret, read only (never the marker)  |
| `asking_client`     | `zb status` asking several stores at once              | the secret, read only (never the marker)  |
| `listing_client`    | `zb status`, the dashboard: the store's list of runs   | nothing (the list is never sealed), read only |
| `rank_client`       | a multi-host command's ranks (iperf-mesh, bench-allreduce): rank 0 hosts | the secret (the host declares it) |
| `publishing_client` | `zb ckpt-serve --publish`: one record                  | the secret                               |
| `handshake`         | the plain client under all of them                     | nothing                                  |

A base module: `counters` (which keys pass unsealed, zb.elastic.keys.is_counter for a run's store) comes
from the caller.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from zb import stop_signals
from zb.dial import unresolvable, wait_listening
from zb.errors import EnvironmentFailure, InvalidInput, LeavingRun, ZbError
from zb.signed_store import authenticated, declare, for_reading, prefixed

if TYPE_CHECKING:
    from torch.distributed import Store, TCPStore

    class StoreClient(Store):
        """What every function here returns, for the type checker only: a torch Store as it is at runtime (a
        TCPStore, a PrefixStore, a SignedStore; the tests' HashStore). torch's stub lacks append and multi_set,
        and types every value as str where bytes are taken too."""

        def set(self, key: str, value: str | bytes) -> None: ...
        def append(self, key: str, value: str | bytes) -> None: ...
        def multi_set(self, keys: list[str], values: list[str | bytes]) -> None: ...
        def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes: ...

Counters = Callable[[str], bool]    # which full keys are counters, passed through unsealed (zb.signed_store)

STATUS_HINT = "check --store: it is the address of `zb store` (GLOBAL_ADDR:GLOBAL_PORT)"


class StoreUnreachable(EnvironmentFailure):
    """No store answers at the address (yet): at start a clear error, later a retry."""


def run_client(host: str, port: int, connect_s: float, op_s: float, *, counters: Counters, namespace: str = "",
               secret: bytes | None = None) -> StoreClient:
    """A node's client of the run's store at host:port (zb.elastic.stores.StoreList.connect picks the address).

    Waits: the connect wait and the answer wait are `connect_s` each (StoreUnreachable after them); the
    operation timeout is max(connect_s, op_s). An address that does not resolve is InvalidInput naming
    elastic.addr. Wraps: with a `secret` (elastic.secret_file) a SignedStore, writing the run marker when the
    store has none yet; InvalidInput when the run's secret is another, or the run has one and `secret` is None.
    With a `namespace` (elastic.namespace) every key goes under that prefix: runs in different namespaces never
    meet, so one store can hold several runs (each stage of a DiLoCo-SWARM run is one)."""
    _wait_reachable(host, port, connect_s)
    client = handshake(host, port, max(connect_s, op_s), connect_s,
                       "check elastic.addr/elastic.port (GLOBAL_ADDR/GLOBAL_PORT)", StoreUnreachable, use_libuv=True)
    store = authenticated(client, secret, f"{host}:{port}", counters)
    return prefixed(store, namespace) if namespace else store


def reading_client(host: str, port: int, timeout_s: float, *, counters: Counters,
                   secret: bytes | None = None) -> StoreClient:
    """A read-only client of the store at host:port, for a command that only reads (`zb status`, the dashboard).

    Waits: the connect wait is `timeout_s` (then one EnvironmentFailure line); the answer wait 2 * timeout_s + 2
    (torch's own retries can overrun `timeout_s`); the operation timeout `timeout_s`. An address that does not
    resolve is InvalidInput (exit 2). Wraps: zb.signed_store.for_reading, which never writes, not even the run
    marker (a reader that wrote it would lock the run's own nodes out); InvalidInput when the run has a
    secret and `secret` is None, or is another. No namespace: the reader reads the store's root."""
    failed = wait_listening(host, port, timeout_s, "--store")
    if failed is not None:
        raise EnvironmentFailure(f"store {host}:{port} unreachable after {timeout_s:g} s "
                                 f"({failed.strerror or failed}); is `zb store` running there? check --store")
    with quiet_stderr():   # torch's client logs C++ frames on its way to an error
        client = handshake(host, port, timeout_s, 2 * timeout_s + 2.0, STATUS_HINT, use_libuv=True,
                           wait_for_workers=False)
    return for_reading(client, secret, f"{host}:{port}", counters)


def asking_client(host: str, port: int, timeout_s: float, answer_s: float, *, counters: Counters,
                  secret: bytes | None = None) -> StoreClient:
    """A read-only client of host:port, as `reading_client` wraps it, for asking several stores at once
    (zb.status.reader.open_reader): no connect wait, one plain connect of at most min(2, answer_s) s (an OSError
    when the port refuses); the answer wait `answer_s` (EnvironmentFailure); the operation timeout `timeout_s`."""
    socket.create_connection((host, port), timeout=min(2.0, answer_s)).close()
    client = handshake(host, port, timeout_s, answer_s, STATUS_HINT, use_libuv=True, wait_for_workers=False)
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"   # as elastic.addr's list writes it
    return for_reading(client, secret, where, counters)


def listing_client(host: str, port: int, timeout_s: float) -> TCPStore:
    """A plain read-only client of the store at host:port, for reading the list of its runs (zb.elastic.runs:
    `zb status` with no namespace, the dashboard's list). The list is the one record at the store's root that
    no run seals, readable without any run's secret, so this client wraps nothing; its caller reads nothing
    else through it (each run is read through `reading_client` or `asking_client`, which check the secret).

    Waits: as `reading_client`'s (the connect wait `timeout_s`, then one EnvironmentFailure line; the answer wait
    2 * timeout_s + 2; the operation timeout `timeout_s`). It never writes."""
    failed = wait_listening(host, port, timeout_s, "--store")
    if failed is not None:
        raise EnvironmentFailure(f"store {host}:{port} unreachable after {timeout_s:g} s "
                                 f"({failed.strerror or failed}); is `zb store` running there? check --store")
    with quiet_stderr():   # torch's client logs C++ frames on its way to an error
        return handshake(host, port, timeout_s, 2 * timeout_s + 2.0, STATUS_HINT, use_libuv=True,
                         wait_for_workers=False)


def rank_client(host: str, port: int, rank: int, world: int, timeout_s: float, option: str = "--store",
                raise_hint: str = "", secret: bytes | None = None) -> StoreClient:
    """A store for a multi-host command's ranks (iperf-mesh, bench-allreduce): rank 0 hosts it, the others connect.

    Waits: `timeout_s` bounds each (the connect wait, the answer wait, the operation timeout, and rank 0's
    binding); one EnvironmentFailure line after it, `raise_hint` appended (what the command's user can raise),
    never torch's C++ frames. A host that does not resolve is zb.dial.unresolvable() of `option`. Wraps: with
    a run `secret` (--secret-file) every record is sealed; rank 0 declares whether the run has one and the others
    wait for that (these commands keep no counters, and use no namespace)."""
    store = _rank_store(host, port, rank, world, timeout_s, option, raise_hint)
    where = f"{host}:{port}"
    if rank == 0:
        declare(store, secret, where)
    return authenticated(store, secret, where, counters=lambda key: False, host_decides=rank != 0)


def publishing_client(host: str, port: int, wait_s: float, secret: bytes | None, where: str) -> StoreClient:
    """A client of the run's store for `zb ckpt-serve --publish`, which writes one record (its address).

    Waits: the connect wait is `wait_s` (one EnvironmentFailure line); the answer wait and the operation timeout
    max(wait_s, 1). Wraps: the secret as a node's client does (writing the run marker when there is none; it
    keeps no counters); no namespace."""
    failed = wait_listening(host, port, wait_s, "--publish")
    if failed is not None:
        raise EnvironmentFailure(f"cannot reach the global store at {host}:{port}: {failed.strerror or failed} "
                                 "(is `zb store` running there?)")
    bound = max(wait_s, 1.0)
    client = handshake(host, port, bound, bound, "check --store (the address of `zb store`)", wait_for_workers=False)
    return authenticated(client, secret, where, counters=lambda key: False)


_handshakes: dict[tuple[str, int], threading.Thread] = {}   # the newest handshake helper per address
_handshakes_lock = threading.Lock()


def handshake(host: str, port: int, timeout_s: float, answer_s: float, hint: str,
              failure: type[ZbError] = EnvironmentFailure, **options: Any) -> TCPStore:
    """A plain TCPStore client of host:port (`options` go to torch's constructor), or one `failure` line
    when what listens there does not answer as a TCPStore within `answer_s` s (the answer wait);
    `timeout_s` is its operation timeout. No connect wait: the callers above dial first.

    torch's client sends its handshake and waits without end for the reply, in C++, on the calling
    thread: against an HTTP server or a hung process that was a `zb train` ignoring Ctrl-C twice and
    SIGTERM, killable only by SIGKILL. So the client is built on a helper thread while this one waits
    in short slices, where signal handlers run; a stop signal (zb.stop_signals) ends the wait on the
    main thread at once with LeavingRun. A helper left waiting on a silent peer is a daemon thread."""
    import torch.distributed as dist

    result: dict[str, Any] = {}

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
        store: TCPStore = result["store"]
        bound_socket_waits(host, port, timeout_s)
        return store
    why = result.get("error") or f"no answer within {answer_s:g} s"
    raise failure(f"{host}:{port} accepts connections but does not answer as a TCPStore ({why}): is it a "
                  f"`zb store`? {hint}")


def bound_socket_waits(host: str, port: int, seconds: float) -> int:
    """Give every socket of this process connected to host:port a receive and send timeout of `seconds`;
    return how many it found.

    torch's client waits for a store's reply in a blocking recv with no timeout. A store whose machine went
    silent (stopped, or every packet dropped: no reset) then holds every operation until TCP gives up,
    minutes to never: its operation timeout bounds only the wait for a missing key. With the socket's own
    timeout the recv fails after `seconds` ("Socket Timeout", a DistNetworkError, which every caller treats
    as the store's silence and answers with a new client: the old one's replies are out of step). Every
    client of one address in a process wants the same bound, so finding them by address is enough."""
    import psutil

    try:
        ips = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
        # torch's client connects over IPv6 where it can: 127.0.0.1 is then ::ffff:127.0.0.1
        found = [c for c in psutil.Process().net_connections(kind="tcp")
                 if c.raddr and c.raddr.port == port and c.fd >= 0 and c.raddr.ip.removeprefix("::ffff:") in ips]
    except (OSError, psutil.Error):
        return 0
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    done = 0
    for conn in found:
        try:
            sock = socket.socket(fileno=os.dup(conn.fd))
        except OSError:
            continue   # closed meanwhile
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            done += 1
        except OSError:
            pass
        finally:
            sock.close()   # the duplicate only: the option belongs to the socket both descriptors share
    return done


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """torch's store client prints C++ stack frames to fd 2 while it retries: hide them (one line follows)."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _wait_reachable(host: str, port: int, timeout: float) -> None:
    """Poll a plain TCP connect until it works, so a dead store gives one clean error (no C++ noise)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout)):
                return
        except socket.gaierror as e:
            raise InvalidInput(f"store address {host!r} does not resolve ({e.strerror}); check elastic.addr "
                               "(GLOBAL_ADDR)") from None
        except OSError as e:
            last = e
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    reason = getattr(last, "strerror", None) or str(last) or "timed out"
    raise StoreUnreachable(f"store {host}:{port} unreachable after {timeout:g} s ({reason}); start it with "
                           "`zb store`, check elastic.addr/elastic.port (GLOBAL_ADDR/GLOBAL_PORT) or raise "
                           "elastic.connect_timeout")


def _rank_store(host: str, port: int, rank: int, world: int, timeout_s: float, option: str,
                raise_hint: str) -> TCPStore:
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
        return handshake(host, port, timeout_s, timeout_s, f"check the address{raise_hint}", world_size=world,
                         wait_for_workers=False)
    try:
        # wait_for_workers=False: the command's own start barrier waits instead, and names who is missing.
        return dist.TCPStore(host, port, world, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except Exception as e:  # noqa: BLE001 - DistNetworkError / RuntimeError, one line for the user
        raise EnvironmentFailure(f"cannot host the store on {host}:{port} within {timeout_s:g} s "
                                 f"({str(e).splitlines()[0]}); is the port free?") from None
