"""The store a gloo group is built on: waits long for a peer's key, never long for a silent store.

gloo's rendezvous reads every member's address with a blocking `get`, which a TCPStore client answers
after the key appears or after the client's operation timeout. One timeout then bounds two different
waits: a peer that is slow to arrive (legitimately up to elastic.store_timeout) and a store machine that
went silent (every packet dropped, no reset), which must be noticed within elastic.store_failover_s.

`patient(store, wait_s)` separates them. Its `get` and `wait` ask `check` in short polls, each one a
store operation bounded by the client's own (short) timeout, and give up after `wait_s` without the key.
Everything else passes through. So the run's clients keep an operation timeout short enough to notice a
silent store (zb.elastic.stores.StoreList.connect), while a group's members still wait for each other.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from zb.signed_store import Forwarding

POLL_S = 0.02       # between two checks for a key not there yet: a rendezvous reads one key per member


class PatientRecords(Forwarding):
    """What a PatientStore does over `inner` (any torch Store); `patient()` makes one."""

    def __init__(self, inner: Any, wait_s: float):
        super().__init__()
        self.inner, self.wait_s = inner, wait_s

    def _wait_for(self, keys: Sequence[str], wait_s: float) -> None:
        import torch.distributed as dist

        deadline = time.monotonic() + wait_s
        while not self.inner.check(list(keys)):
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"timed out after {wait_s:g} s waiting for {', '.join(keys)} "
                                          "(a member of the group did not arrive)")
            time.sleep(POLL_S)

    def get(self, key: str) -> bytes:
        self._wait_for([key], self.wait_s)
        return self.inner.get(key)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self._wait_for(keys, self.wait_s if timeout is None else timeout.total_seconds())

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def check(self, keys: Sequence[str]) -> bool:
        return self.inner.check(list(keys))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self._wait_for(keys, self.wait_s)
        return self.inner.multi_get(list(keys))

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self.inner.multi_set(list(keys), list(values))

    def append(self, key: str, value: str | bytes) -> None:
        self.inner.append(key, value)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def clone(self) -> Any:
        return patient(self.inner.clone(), self.wait_s)


@functools.cache
def _store_class() -> type:
    import torch.distributed as dist

    return type("PatientStore", (PatientRecords, dist.Store), {"__module__": __name__})


def patient(store: Any, wait_s: float) -> Any:
    """`store` for building a gloo group: `get` and `wait` wait up to `wait_s` for a missing key, in polls."""
    return _store_class()(store, wait_s)
