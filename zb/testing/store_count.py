"""A store client that counts what it asks of the store (scripts/bench_scale.py, tests/test_membership_scale.py):
requests, keys named, bytes each way, per operation."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any


class Tally:
    """What the clients it made asked of the store, summed when read. Each client counts into its own Counter,
    without a lock: one shared Counter behind a lock cost 1,000 members' threads more CPU than the requests
    themselves, and the benchmark measured its own accounting. A client is used by one thread at a time, and
    `clear` is for moments when the clients are quiet (between a benchmark's phases)."""

    def __init__(self) -> None:
        self._clients: list[Counting] = []
        self._lock = threading.Lock()   # clients are made from many threads at once

    def client(self, inner: Any) -> Counting:
        counting = Counting(inner)
        with self._lock:
            self._clients.append(counting)
        return counting

    def totals(self) -> Counter:
        out: Counter = Counter()
        with self._lock:
            for c in self._clients:
                out.update(c.counts)
        return out

    def clear(self) -> None:
        with self._lock:
            for c in self._clients:
                c.counts.clear()


class Counting:
    """A store client that counts what it asks of the store: requests, keys named, bytes each way."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.counts: Counter = Counter()

    def _count(self, op: str, keys: int, up: int, down: int) -> None:
        c = self.counts
        c["requests"] += 1
        c[f"op_{op}"] += 1
        c["keys"] += keys
        c["bytes_up"] += up
        c["bytes_down"] += down

    def check(self, keys):
        self._count("check", len(keys), sum(map(len, keys)), 1)
        return self._inner.check(keys)

    def get(self, key):
        value = self._inner.get(key)
        self._count("get", 1, len(key), len(value))
        return value

    def multi_get(self, keys):
        values = self._inner.multi_get(keys)
        self._count("multi_get", len(keys), sum(map(len, keys)), sum(map(len, values)))
        return values

    def set(self, key, value):
        self._count("set", 1, len(key) + len(value), 0)
        return self._inner.set(key, value)

    def append(self, key, value):
        self._count("append", 1, len(key) + len(value), 0)
        return self._inner.append(key, value)

    def add(self, key, amount):
        self._count("add", 1, len(key) + 8, 8)
        return self._inner.add(key, amount)

    def compare_set(self, key, expected, desired):
        out = self._inner.compare_set(key, expected, desired)
        self._count("compare_set", 1, len(key) + len(expected) + len(desired), len(out))
        return out

    def wait(self, keys, timeout=None):
        self._count("wait", len(keys), sum(map(len, keys)), 1)
        return self._inner.wait(keys, timeout) if timeout is not None else self._inner.wait(keys)

    def delete_key(self, key):
        self._count("delete_key", 1, len(key), 1)
        return self._inner.delete_key(key)
