"""The level of torch's C++ log (TORCH_CPP_LOG_LEVEL): read once, when torch loads, so set before that.

Why zb lowers it: torch's store client logs two warning lines at every `wait` that times out, and the roll call
waits with timeouts all the time (zb.elastic.membership). Formatting each line names the socket's two addresses
through getnameinfo, a reverse DNS lookup: with a resolver that is slow or unreachable (a machine with no
network but loopback, a home link) one timed-out wait of 20 ms took 5 s, the resolver's own timeout. zb says
itself what fails, in one line; TORCH_CPP_LOG_LEVEL=WARNING (set by the user, kept) shows torch's lines again."""

from __future__ import annotations

import os

VARIABLE = "TORCH_CPP_LOG_LEVEL"
_SET_BY_USER = VARIABLE in os.environ   # at import, before any call here could set it


def quiet_torch_log(level: str = "ERROR") -> None:
    """torch's C++ log at `level` (ERROR, or FATAL for a command that only reads), unless the user set one."""
    if not _SET_BY_USER:
        os.environ[VARIABLE] = level
