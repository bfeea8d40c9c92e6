"""Several in-process nodes doing one thing at once, each in a thread of its own (the membership tests)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any


def each_at_once(members: dict[str, Any], uids: Iterable[str], fn: Callable[[Any], Any],
                 timeout: float) -> dict[str, Any]:
    """`fn(members[uid])` for every uid at once; uid -> what it returned or the exception it raised. Fails when
    one has not finished within `timeout` seconds (a wait that never ends is the bug such tests look for)."""
    out: dict[str, Any] = {}

    def run(uid: str) -> None:
        try:
            out[uid] = fn(members[uid])
        except BaseException as e:  # noqa: BLE001 - returned to the caller
            out[uid] = e

    threads = [threading.Thread(target=run, args=(u,), daemon=True) for u in uids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a member did not finish"
    return out
