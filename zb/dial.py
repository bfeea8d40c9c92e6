"""Host names given on the command line: a name that does not resolve, and dialing a TCP address
before torch does.

A name that does not resolve is a mistake in the invocation (exit 2), wherever it is given; only a
resolver that failed for now (EAI_AGAIN: no DNS server reachable) is the environment (exit 1).
torch's TCPStore logs about 40 lines of C++ stack frames when it cannot connect: a plain TCP connect
first turns that into one line, and bounds the wait (zb.store_clients dials with it).
"""

from __future__ import annotations

import socket
import time

from zb.errors import EnvironmentFailure, InvalidInput, ZbError


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
