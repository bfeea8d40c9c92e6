"""Store records sealed with the run secret (zb.signed_store, zb.secret): what opens, what is ignored, who is
refused, and that gloo's rendezvous runs over a sealed store."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from zb.errors import InvalidInput
from zb.secret import read_secret, sidecar_token, write_new_secret
from zb.signed_store import (
    MARKER,
    authenticated,
    declare,
    for_reading,
    holds_secret,
    keep_marker,
    prefixed,
    seal,
    unseal,
)

SECRET = b"0123456789abcdef0123456789abcdef"


def _counters(key: str) -> bool:
    return key.endswith("/hb")


@pytest.fixture
def host():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))


def _client(host, timeout_s: float = 30.0):
    return dist.TCPStore("127.0.0.1", host.port, is_master=False, use_libuv=True, timeout=timedelta(seconds=timeout_s))


def _node(host, secret=SECRET, timeout_s: float = 30.0):
    return authenticated(_client(host, timeout_s), secret, "test-store", _counters)


def test_a_record_opens_only_under_its_key_and_secret():
    key = b"k" * 32
    sealed = seal(key, "zb/world", b'{"v": 1}')
    assert unseal(key, "zb/world", sealed) == (b'{"v": 1}', False)
    assert unseal(key, "zb/other", sealed) == (None, True)           # copied to another key
    assert unseal(b"x" * 32, "zb/world", sealed) == (None, True)     # another secret
    tampered = sealed[:-1] + b"2"
    assert unseal(key, "zb/world", tampered) == (None, True)
    assert unseal(key, "zb/world", b'{"v": 1}') == (None, True)      # written without a seal
    assert unseal(key, "zb/world", seal(key, "zb/world", "")) == (b"", False)   # an empty record is one


def test_a_list_keeps_its_sealed_lines_and_drops_what_anyone_appended():
    key = b"k" * 32
    raw = (seal(key, "zb/joins", "a\n") + b"evil\n" + seal(b"x" * 32, "zb/joins", "forged\n")
           + seal(key, "zb/joins", "b\n")[:-1] + seal(key, "zb/joins", "c\n"))
    assert unseal(key, "zb/joins", raw) == (b"a\nc\n", True)         # b was truncated: it does not open


def test_nodes_with_the_secret_read_each_others_records(host):
    a, b = _node(host), _node(host)
    a.set("zb/world", "W1")
    a.append("zb/joins", "j1\n")
    a.append("zb/joins", "j2\n")
    assert b.get("zb/world") == b"W1" and b.check(["zb/world", "zb/joins"])
    assert b.multi_get(["zb/world", "zb/joins"]) == [b"W1", b"j1\nj2\n"]
    assert host.get("zb/world") != b"W1"                             # what the store holds is sealed


def test_a_forged_record_reads_as_absent_and_is_logged_once(host, caplog):
    a = _node(host, timeout_s=1.0)
    a.set("zb/world", "W1")
    host.set("zb/world", "forged")                                   # a raw client, no secret
    with caplog.at_level(logging.WARNING, logger="zb.elastic"):
        assert not a.check(["zb/world"])
        assert not a.check(["zb/world"])
        with pytest.raises(dist.DistStoreError):
            a.get("zb/world")                                        # as torch's get of a missing key: times out
    assert sum("zb/world" in r.getMessage() for r in caplog.records) == 1
    host.append("zb/joins", "evil\n")
    a.append("zb/joins", "honest\n")
    assert a.get("zb/joins") == b"honest\n"


def test_compare_set_replaces_a_forgery_expected_absent_and_fails_on_one_that_replaced_a_record(host):
    a, b = _node(host), _node(host)
    host.set("zb/fingerprint", "forged")
    assert a.compare_set("zb/fingerprint", "", "mine") == b"mine"
    assert b.compare_set("zb/fingerprint", "", "theirs") == b"mine"   # a real record: the usual answer
    host.set("zb/world", "forged")
    assert a.compare_set("zb/world", "W1", "W2") == b"W1"            # what torch answers for an absent key
    assert not a.check(["zb/world"])


def test_counters_pass_unsealed(host):
    a, b = _node(host), _node(host)
    a.add("n/hb", 1)
    host.add("n/hb", 1)
    assert b.add("n/hb", 0) == 2 and b.get("n/hb") == b"2" and b.check(["n/hb"])


def test_a_prefix_is_the_same_keys_as_dist_prefixstore(host):
    a = _node(host)
    prefixed(prefixed(a, "run"), "zb/mesh/1/r0").set("0/0", "addr")
    assert host.check(["run/zb/mesh/1/r0/0/0"])
    assert prefixed(_node(host), "run/zb/mesh/1/r0").get("0/0") == b"addr"
    assert isinstance(prefixed(host, "p"), dist.PrefixStore)          # a plain client: torch's own


def test_gloo_rendezvous_runs_over_sealed_records(host):
    stores, out, errors = [_node(host), _node(host)], {}, []

    def rank(r: int) -> None:
        try:
            group = dist.ProcessGroupGloo(prefixed(stores[r], "zb/mesh/1/r0"), r, 2, timedelta(seconds=30))
            t = torch.full((3,), float(r + 1))
            group.allreduce([t]).wait()
            out[r] = t.tolist()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and out == {0: [3.0] * 3, 1: [3.0] * 3}


def test_a_node_with_another_secret_or_none_is_refused_in_one_line(host):
    _node(host)                                                      # the first node marks the run
    with pytest.raises(InvalidInput, match="started with another secret"):
        _node(host, b"another secret of enough length!")
    with pytest.raises(InvalidInput, match="admits only nodes that hold its secret"):
        _node(host, None)


def test_a_store_without_a_marker_admits_nodes_without_a_secret(host):
    plain = authenticated(_client(host), None, "test-store", _counters)
    plain.set("k", "v")
    assert host.get("k") == b"v"


def test_a_reader_with_a_secret_never_marks_a_run_that_holds_none(host):
    """Issue 37: `zb status --secret-file` against a run without a secret wrote the marker, and from then on
    the run refused its own nodes. A reader never writes: it reads the run as it is, and says it has no secret."""
    reader = for_reading(_client(host), SECRET, "test-store", _counters)
    assert not holds_secret(reader) and not host.check([MARKER]) and host.num_keys() == 0
    authenticated(_client(host), None, "test-store", _counters).set("k", "v")    # the run's nodes still join
    declare(host, None, "bench")                                               # a host that declared no secret
    assert not holds_secret(for_reading(_client(host), SECRET, "test-store", _counters))


def test_a_reader_opens_the_runs_records_and_is_refused_as_a_node_is(host):
    _node(host).set("k", "v")                                                  # the first node marks the run
    assert for_reading(_client(host), SECRET, "test-store", _counters).get("k") == b"v"
    with pytest.raises(InvalidInput, match="started with another secret"):
        for_reading(_client(host), b"another secret of enough length!", "test-store", _counters)
    with pytest.raises(InvalidInput, match="admits only nodes that hold its secret"):
        for_reading(_client(host), None, "test-store", _counters)


def test_the_stores_own_marker_is_the_runs(host):
    declare(host, SECRET, "test-store")
    _node(host).set("k", "v")
    assert _node(host).get("k") == b"v"
    with pytest.raises(InvalidInput, match="another secret"):
        declare(host, b"another secret of enough length!", "test-store")


def test_records_of_another_store_do_not_open_here(host):
    a = _node(host)
    a.set("zb/world", "W1")
    sealed = host.get("zb/world")
    other = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
    b = authenticated(_client(other), SECRET, "other", _counters)   # the same secret, a new marker
    other.set("zb/world", sealed)                                   # replayed from the first store
    assert not b.check(["zb/world"])


def test_a_new_secret_is_written_once_and_read_back(tmp_path):
    path = tmp_path / "run.secret"
    secret = write_new_secret(path)
    assert read_secret(path) == secret and len(secret) == 64 and (path.stat().st_mode & 0o077) == 0
    with pytest.raises(InvalidInput, match="never overwritten"):
        write_new_secret(path)
    with pytest.raises(InvalidInput, match="cannot read the run secret"):
        read_secret(tmp_path / "missing")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(InvalidInput, match="is empty"):
        read_secret(tmp_path / "empty")
    assert sidecar_token(secret) != sidecar_token(b"other") and len(sidecar_token(secret)) == 64


def test_a_host_that_declares_no_secret_admits_only_clients_without_one(host):
    declare(host, None, "test-store")
    assert authenticated(_client(host), None, "test-store", _counters, host_decides=True) is not None
    with pytest.raises(InvalidInput, match="started without a secret"):
        authenticated(_client(host), SECRET, "test-store", _counters, host_decides=True)


def test_a_client_waits_for_the_hosts_decision(host):
    timer = threading.Timer(0.5, lambda: declare(host, SECRET, "test-store"))
    timer.start()
    with pytest.raises(InvalidInput, match="admits only nodes that hold its secret"):
        authenticated(_client(host), None, "test-store", _counters, host_decides=True)   # not admitted before it
    timer.join()


def test_a_node_without_the_secret_is_refused_by_a_failover_list_whose_first_store_is_gone(host):
    """With several stores a starting node asks each where the run is: a store that refuses it (the run has a
    secret) is an answer, not silence (chaos: it said 'unreachable', exit 1, after a store-loss)."""
    from zb.addresses import StoreAddress
    from zb.elastic.stores import StoreList
    from zb.testing.procs import free_port

    declare(host, SECRET, "test-store")
    stores = StoreList([StoreAddress("127.0.0.1", free_port()), StoreAddress("127.0.0.1", host.port)], 30.0)
    with pytest.raises(InvalidInput, match="admits only nodes that hold its secret"):
        stores.connect(5.0, 5.0)


def test_a_deleted_marker_is_written_back_as_it_was(host):
    """An outsider deleted the run marker (no secret needed); a node's client that connects again must not write a
    fresh one: that re-keyed this node alone, every record of the others read as forged, and the run split in two."""
    a = _node(host)
    a.set("zb/world", "W1")
    host.delete_key(MARKER)
    b = _node(host, timeout_s=2.0)              # a client of the run's process, made again after a store error
    assert b.get("zb/world") == b"W1"           # the same key: the others' records still open
    b.set("zb/world", "W2")
    assert a.get("zb/world") == b"W2"


def test_a_running_run_puts_a_deleted_or_replaced_marker_back(host):
    """Issue 40: a marker deleted while no client reconnects stayed deleted, so the next joiner wrote a fresh one
    (two keys, two runs). The leader's keep_marker at each resolution (one compare_set) writes it back as it was,
    and a replaced one too (with a warning); a store without a secret is left alone."""
    a = _node(host)
    marker = host.get(MARKER)
    host.delete_key(MARKER)
    assert keep_marker(a) is False and host.get(MARKER) == marker
    host.set(MARKER, b'{"nonce": "00", "proof": "junk"}')
    assert keep_marker(a) is True and host.get(MARKER) == marker
    assert keep_marker(a.under("ns")) is False and keep_marker(host) is False


def test_a_secret_shorter_than_16_bytes_is_refused(tmp_path):
    path = tmp_path / "short.secret"
    path.write_text("password-is\n")
    path.chmod(0o600)
    with pytest.raises(InvalidInput, match="has only 11 bytes: at least 16") as e:
        read_secret(path)
    assert "\n" not in str(e.value)


def test_a_guess_of_the_secret_costs_a_slow_derivation(host):
    """The marker is readable by anyone who reaches the store: testing a guess against it must cost scrypt, not
    one HMAC of the guess (a 16-byte human secret fell in 2 guesses, at ~528,000 a second)."""
    import hashlib
    import hmac
    import json

    from zb.secret import SCRYPT_N, stretched

    _node(host)
    doc = json.loads(host.get(MARKER))
    plain = hmac.new(SECRET, b"zb run marker\x00" + doc["nonce"].encode(), hashlib.sha256).hexdigest()
    assert doc["proof"] != plain
    slow = hashlib.scrypt(SECRET, salt=b"zb run secret v1", n=SCRYPT_N, r=8, p=1, maxmem=64 << 20, dklen=32)
    assert stretched(SECRET) == slow and SCRYPT_N >= 1 << 14
    assert doc["proof"] == hmac.new(slow, b"zb run marker\x00" + doc["nonce"].encode(), hashlib.sha256).hexdigest()


def test_an_empty_record_is_replaced_by_compare_set_expecting_nothing(host):
    """A seeded world makes every key a resolution reads exist (an empty record), so a snapshot is one round
    trip; the run's end record (keys.FINISHED) is still written once over it, first writer wins."""
    a, b = _node(host), _node(host)
    a.append("zb/finished", "")
    assert a.compare_set("zb/finished", "", "R1") == b"R1"
    assert b.compare_set("zb/finished", "", "R2") == b"R1"
    assert b.get("zb/finished") == b"R1"
