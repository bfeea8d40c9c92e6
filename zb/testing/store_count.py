"""A store client that counts what it asks of the store (scripts/bench_scale.py, tests/test_membership_scale.py):
requests, keys named, bytes each way, per operation."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

_LOCK = threading.Lock()   # the clients of many threads add to one tally


class Counting:
    """A store client that counts what it asks of the store: requests, keys named, bytes each way."""

    def __init__(self, inner: Any, tally: Counter) -> None:
        self._inner, self._tally = inner, tally

    def _count(self, op: str, keys: int, up: int, down: int) -> None:
        with _LOCK:
            self._tally.update({"requests": 1, f"op_{op}": 1, "keys": keys, "bytes_up": up, "bytes_down": down})

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
