"""Store records authenticated with the run secret (elastic.secret_file).

The store is a plain TCPStore: anyone who reaches its port can write any key. With a secret, a node
wraps its client in a SignedStore (`signed`): every value it writes is sealed (a MAC over the full key and the
value, keyed by the secret and the store's run marker), and every value it reads is opened; a value that
does not open is treated as absent and logged once with its key. Everything a node acts on goes through
it: membership, the world, check-in claims, addresses (gloo's rendezvous included: a ProcessGroupGloo
is built over this store), status. What cannot be sealed are counters (`add` needs the store to parse
an integer): the caller names them (zb.elastic.keys.is_counter), and they carry only liveness and
wake-ups, never a decision.

The run marker (MARKER, at the store's root) holds a random nonce and a proof that its writer held the
secret. `zb store --secret-file` writes it; else the first node that holds a secret does; a command that
only reads (`zb status`, the dashboard: `for_reading`) never does. A node whose store lost the marker it has
been using writes that same marker back, never a new one: a fresh nonce would re-key that node alone. A node with another secret, or with none,
is refused in one line (InvalidInput, exit 2) before it writes anything.
Records are keyed by the nonce too, so a record copied from another store (an old one, or a standby)
never opens here.

torch cannot build a ProcessGroupGloo over a PrefixStore whose inner store is written in Python, so a
SignedStore carries its own prefix: use `prefixed()` instead of dist.PrefixStore."""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import secrets
import struct
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from zb.errors import InvalidInput
from zb.secret import WHERE, derive

log = logging.getLogger("zb.elastic")

MARKER = "zb/secret"        # JSON {"nonce": hex, "proof": hex} at the store's root, written with compare_set
NO_SECRET = b"none"         # MARKER of a store whose host declared its run has no secret (`declare`)
MAGIC = b"zbS\x01"
_HEADER = struct.Struct(">4sI16s")   # magic, payload length, tag
_POLL_S = 0.05

_warned: set[str] = set()
_warned_lock = threading.Lock()
_used: dict[tuple[str, str], str] = {}   # the run marker this process's clients opened records with, per store
                                        # address and secret (its digest)
_used_lock = threading.Lock()


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _tag(key: bytes, full_key: str, payload: bytes) -> bytes:
    name = full_key.encode()
    return hmac.new(key, struct.pack(">I", len(name)) + name + payload, hashlib.sha256).digest()[:16]


def seal(key: bytes, full_key: str, value: str | bytes) -> bytes:
    """One sealed record: MAGIC, the payload's length, the tag, the payload."""
    payload = _as_bytes(value)
    return _HEADER.pack(MAGIC, len(payload), _tag(key, full_key, payload)) + payload


def unseal(key: bytes, full_key: str, raw: bytes) -> tuple[bytes | None, bool]:
    """The payloads of the records in `raw` that open under `key` and `full_key`, joined in order (an
    append-only key holds one record per append), or None when none opens; and whether any bytes did not
    open (a forged or truncated record, unsealed text appended by anyone: skipped up to the next MAGIC)."""
    out: list[bytes] = []
    opened, dropped, at = False, False, 0
    while at < len(raw):
        if raw.startswith(MAGIC, at) and at + _HEADER.size <= len(raw):
            _, length, tag = _HEADER.unpack_from(raw, at)
            end = at + _HEADER.size + length
            payload = raw[at + _HEADER.size:end]
            if end <= len(raw) and hmac.compare_digest(tag, _tag(key, full_key, payload)):
                out.append(payload)
                opened, at = True, end
                continue
        dropped = True
        following = raw.find(MAGIC, at + 1)
        if following < 0:
            break
        at = following
    return (b"".join(out) if opened else None), dropped


def _warn_once(full_key: str) -> None:
    with _warned_lock:
        if full_key in _warned:
            return
        _warned.add(full_key)
    log.warning("(part of) store record %s does not open with the run secret (written by someone without it, or "
                "tampered with): ignored", full_key)


class Forwarding:
    """What a Python torch Store over another one (`inner`) passes through as it is (zb.rendezvous_store too)."""

    inner: Any

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self.inner.timeout

    def has_extended_api(self) -> bool:
        return True


class SignedRecords(Forwarding):
    """What a SignedStore does (see the module's text); `signed()` makes one. `inner` is a plain client of the
    store; `key` the records' key (`record_key`); `counters(full_key)` says which keys are counters, passed
    through unsealed; `prefix` is what dist.PrefixStore would add."""

    def __init__(self, inner: Any, key: bytes, counters: Callable[[str], bool], prefix: str = "",
                 marker: bytes | None = None):
        super().__init__()
        self.inner, self.key, self.counters, self.prefix = inner, key, counters, prefix.rstrip("/")
        self.marker = marker   # the run marker the records' key comes from (`keep_marker` puts it back)

    # What dist.PrefixStore would do, kept here (see the module's text).
    def under(self, prefix: str) -> Any:
        return signed(self.inner, self.key, self.counters, self._full(prefix.rstrip("/")), self.marker)

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _open(self, full: str, raw: bytes) -> bytes | None:
        if self.counters(full):
            return raw
        payload, dropped = unseal(self.key, full, raw)
        if dropped:
            _warn_once(full)
        return payload

    def _deadline(self, timeout: timedelta | None = None) -> float:
        return time.monotonic() + (timeout or self.inner.timeout).total_seconds()

    def _opened(self, full: str, raw: bytes) -> bytes:
        """The payload of `raw`, or (a forgery) the sealed record waited for as torch waits for a missing key."""
        payload = self._open(full, raw)
        return payload if payload is not None else self._wait_open(full, self._deadline())

    def _wait_open(self, full: str, deadline: float) -> bytes:
        """A forged value reads as absent: wait, as torch's get does for a missing key, for a sealed one."""
        import torch.distributed as dist

        while True:
            payload = self._open(full, self.inner.get(full))
            if payload is not None:
                return payload
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"timed out waiting for a record of {full} sealed with the run secret")
            time.sleep(_POLL_S)

    # The Store interface.
    def set(self, key: str, value: str | bytes) -> None:
        full = self._full(key)
        self.inner.set(full, seal(self.key, full, value))

    def get(self, key: str) -> bytes:
        full = self._full(key)
        return self._opened(full, self.inner.get(full))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        fulls = [self._full(k) for k in keys]
        return [self._opened(full, raw) for full, raw in zip(fulls, self.inner.multi_get(fulls))]

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        fulls = [self._full(k) for k in keys]
        self.inner.multi_set(fulls, [seal(self.key, f, v) for f, v in zip(fulls, values)])

    def append(self, key: str, value: str | bytes) -> None:
        full = self._full(key)
        self.inner.append(full, seal(self.key, full, value))

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(self._full(key), amount)

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key holds a record that opens (or is a counter)."""
        fulls = [self._full(k) for k in keys]
        if not self.inner.check(fulls):
            return False
        sealed = [f for f in fulls if not self.counters(f)]
        return not sealed or all(self._open(f, raw) is not None for f, raw in zip(sealed, self.inner.multi_get(sealed)))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        fulls = [self._full(k) for k in keys]
        if timeout is None:
            self.inner.wait(fulls)
        else:
            self.inner.wait(fulls, timeout)
        deadline = self._deadline(timeout)
        for full in fulls:
            if not self.counters(full):
                self._wait_open(full, deadline)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """torch's compare_set over sealed records: a forged value is an absent one, so expecting "" replaces it
        and expecting a record that a forgery replaced fails (torch answers `expected` for an absent key). An empty
        record is no record either: expecting "" replaces it."""
        full = self._full(key)
        want = seal(self.key, full, desired)
        expect = seal(self.key, full, expected) if _as_bytes(expected) else b""
        against = expect
        for _ in range(8):
            current = self.inner.compare_set(full, against, want)
            if current == want:
                return _as_bytes(desired)
            payload = self._open(full, current)
            if payload == b"" and not expect:
                against = current   # an empty record stands for nothing yet (a key made to exist: zb.elastic.membership)
                continue
            if payload is not None:
                return payload
            if expect:
                return _as_bytes(expected)
            against = current       # a forgery where nothing was expected: replace it as if the key were absent
        raise InvalidInput(f"store record {full} keeps being forged: someone without the run secret writes it")

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(self._full(key))

    def clone(self) -> Any:
        return signed(self.inner.clone(), self.key, self.counters, self.prefix, self.marker)


@functools.cache
def _store_class() -> type:
    """SignedRecords as a torch Store (gloo's rendezvous calls it from C++), made on first use: zb imports torch
    only when it needs it."""
    import torch.distributed as dist

    return type("SignedStore", (SignedRecords, dist.Store), {"__module__": __name__})


def signed(inner: Any, key: bytes, counters: Callable[[str], bool], prefix: str = "",
           marker: bytes | None = None) -> Any:
    """A SignedStore (a torch Store) over `inner`; `marker`: the run marker its key comes from."""
    return _store_class()(inner, key, counters, prefix, marker)


def prefixed(store: Any, prefix: str) -> Any:
    """`store` under `prefix`: what dist.PrefixStore does, for a SignedStore too."""
    import torch.distributed as dist

    if isinstance(store, SignedRecords):
        return store.under(prefix)
    return dist.PrefixStore(prefix.rstrip("/"), store)


def _proof(secret: bytes, nonce: str) -> str:
    return derive(secret, "zb run marker", nonce.encode()).hex()


def marker_value(secret: bytes) -> str:
    """A new run marker: a random nonce and the proof of the secret."""
    nonce = secrets.token_hex(16)
    return json.dumps({"nonce": nonce, "proof": _proof(secret, nonce)})


def _nonce(marker: bytes, secret: bytes, where: str) -> str:
    """The marker's nonce when it was written with `secret`; InvalidInput when it was not."""
    try:
        doc = json.loads(marker)
        nonce, proof = str(doc["nonce"]), str(doc["proof"])
    except (ValueError, KeyError, TypeError):
        nonce, proof = "", ""
    if marker == NO_SECRET:
        raise InvalidInput(f"the store at {where} was started without a secret: give every rank the same "
                           "--secret-file, or none")
    if not nonce or not hmac.compare_digest(proof, _proof(secret, nonce)):
        raise InvalidInput(f"the run at {where} was started with another secret: this node's ({WHERE}) is not "
                           "the run's (a stale or wrong file); use the file the run's store was given")
    return nonce


def record_key(secret: bytes, nonce: str) -> bytes:
    return derive(secret, "zb store records", nonce.encode())


def authenticated(client: Any, secret: bytes | None, where: str, counters: Callable[[str], bool],
                  host_decides: bool = False) -> Any:
    """`client` of the store at `where`, checked against the run marker: a SignedStore when this node holds a
    secret (writing the marker when the store has none yet), the client itself when neither has one.
    InvalidInput (exit 2) when the secret is not the run's, or the run has one and this node none.

    `host_decides`: the store's host writes the marker (or NO_SECRET) as it starts (`declare`), and a client
    waits for it, up to the client's timeout: no client that starts with the host can slip in first."""
    if host_decides:
        client.wait([MARKER])
    if secret is None:
        _refuse_without_secret(read_marker(client), where)
        return client
    held = (where, hashlib.sha256(secret).hexdigest())
    with _used_lock:
        used = _used.get(held)
    if used is not None and read_marker(client) is None:
        # Gone while this process used it: an empty restarted store, or someone who reaches the store deleted it
        # (an outsider who cannot write a valid one). A fresh nonce here would re-key this node alone, and every
        # record of the others would read as forged: two runs. The marker goes back as it was, for every node.
        log.warning("the run marker of the store at %s is missing: writing back the one this node has been using "
                    "(the store restarted empty, or someone deleted it)", where)
    marker = client.compare_set(MARKER, "", used or marker_value(secret))   # the marker there, or ours if none was
    nonce = _nonce(marker, secret, where)
    with _used_lock:
        _used[held] = marker.decode()
    return signed(client, record_key(secret, nonce), counters, marker=marker)


def holds(store: Any, key: str) -> bool:
    """Whether `key` exists at the store, whatever it holds: a record that does not open with the run secret (which
    reads as absent) included. What tells a record someone forged from a key a restarted store lost."""
    if isinstance(store, SignedRecords):
        return bool(store.inner.check([store._full(key)]))
    return bool(store.check([key]))


def keep_marker(store: Any) -> bool:
    """While the run goes on, its marker stays what its records' key came from: one compare_set that writes it
    back when someone deleted it (a joiner then waits for it instead of writing a fresh one: two runs) and reads
    what is there; a marker someone replaced is put back too, with one warning. True when it had been replaced.
    Nothing for a store without a secret."""
    if not isinstance(store, SignedRecords) or store.marker is None:
        return False
    now = store.inner.compare_set(MARKER, "", store.marker)
    if now == store.marker:
        return False
    log.warning("the run marker in the store was replaced (someone who reaches the store, or a node started with "
                "the secret for another run): written back as it was")
    store.inner.compare_set(MARKER, now, store.marker)
    return True


def for_reading(client: Any, secret: bytes | None, where: str, counters: Callable[[str], bool]) -> Any:
    """`client` of the store at `where` as a command that only reads opens it (`zb status`, the dashboard): as
    `authenticated` does, but it never writes, not even the marker (a reader that wrote it would lock the run's
    own nodes out). With a secret, the client itself while the run holds none (no marker, or NO_SECRET):
    `holds_secret` tells the caller, who may look again later (nodes holding the secret write it as they start)."""
    marker = read_marker(client)
    if secret is None:
        _refuse_without_secret(marker, where)
        return client
    if marker is None or marker == NO_SECRET:
        return client
    return signed(client, record_key(secret, _nonce(marker, secret, where)), counters)


def read_marker(client: Any) -> bytes | None:
    """The run marker of the store behind the plain `client`, None when it has none; never waits, never writes."""
    return client.get(MARKER) if client.check([MARKER]) else None


def holds_secret(store: Any) -> bool:
    """Whether `store` (from `authenticated` or `for_reading`) seals and opens records with the run secret."""
    return isinstance(store, SignedRecords)


def _refuse_without_secret(marker: bytes | None, where: str) -> None:
    if marker is not None and marker != NO_SECRET:
        raise InvalidInput(f"the run at {where} admits only nodes that hold its secret: pass --secret-file FILE "
                           f"({WHERE}) with the file the run's store was given")


def declare(client: Any, secret: bytes | None, where: str) -> None:
    """The store's host says whether its run has a secret: the marker (`zb store --secret-file`; a store already
    holding another run's marker refuses), or NO_SECRET (multi-host commands' own stores, `host_decides`)."""
    if secret is None:
        client.compare_set(MARKER, "", NO_SECRET)
    else:
        _nonce(client.compare_set(MARKER, "", marker_value(secret)), secret, where)
