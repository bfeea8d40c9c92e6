"""Stable integer hashing (never Python's salted hash()): document ids, eval split, per-document seeds."""

from __future__ import annotations

import hashlib

MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def mix64(*values: int) -> int:
    """One 64-bit hash of a tuple of non-negative ints."""
    h = 0x243F6A8885A308D3
    for v in values:
        h = splitmix64(h ^ (v & MASK))
    return h


def text_id(text: str) -> int:
    """A stable 64-bit id of a string (e.g. a file's name inside its dataset)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def unit(*values: int) -> float:
    """A uniform-looking number in [0, 1) determined by `values`."""
    return mix64(*values) / 2.0**64
