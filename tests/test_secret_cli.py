"""The run secret on the command line: `zb store --new-secret/--secret-file`, and the commands that reach a run's
store with it (`zb status`, `zb bench-allreduce --store`); wrong, missing and misplaced secrets are one line and
exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

from zb.secret import write_new_secret
from zb.testing.procs import REPO, free_port, subprocess_env, zb_process


def _store(*args: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-m", "zb", "store", "--port", str(free_port()), "--json", *args],
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    return proc, json.loads(line)


def _stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    proc.wait(30)
    return proc.stderr.read()


def test_zb_store_makes_a_secret_and_only_its_holders_read_the_run(tmp_path):
    secret = tmp_path / "run.secret"
    proc, info = _store("--new-secret", str(secret))
    try:
        assert info["env"]["ZB_ELASTIC_SECRET_FILE"] == str(secret) and (secret.stat().st_mode & 0o077) == 0
        where = f"127.0.0.1:{info['port']}"
        without = zb_process("status", "--store", where, "--timeout", "5", timeout=60)
        assert without.returncode == 2 and "admits only nodes that hold its secret" in without.stderr
        (tmp_path / "other").write_text("another secret of 32 characters!\n")
        other = zb_process("status", "--store", where, "--secret-file", str(tmp_path / "other"), timeout=60)
        assert other.returncode == 2 and "started with another secret" in other.stderr
        holder = zb_process("status", "--store", where, "--timeout", "5", timeout=60,
                            ZB_ELASTIC_SECRET_FILE=str(secret))
        assert holder.returncode != 2 and "secret" not in holder.stderr, holder.stderr
    finally:
        err = _stop(proc)
    assert "anyone who reaches" not in err          # loopback: no warning


def test_status_with_a_secret_never_marks_a_store_and_a_fresh_secret_store_has_no_node_yet(tmp_path):
    """Issue 37: `zb status --secret-file` wrote the run marker into a store without one (locking the run's own
    nodes out), and a fresh `zb store --new-secret` store read as 'another program's store?'; `zb store
    --http-port` with a secret failed to start its dashboard (it read the sealed store without the secret)."""
    from datetime import timedelta

    import torch.distributed as dist

    from zb.signed_store import MARKER

    secret = tmp_path / "run.secret"
    write_new_secret(secret)
    plain, info = _store()
    try:
        proc = zb_process("status", "--store", f"127.0.0.1:{info['port']}", "--secret-file", str(secret), "--timeout",
                          "5", timeout=60)
        client = dist.TCPStore("127.0.0.1", info["port"], is_master=False, use_libuv=True,
                               timeout=timedelta(seconds=30))
        assert not client.check([MARKER]) and client.num_keys() == 0, "a reader wrote to the store"
    finally:
        _stop(plain)
    assert proc.returncode == 1 and "no run on the store" in proc.stderr and "no node has joined it" in proc.stderr
    sealed, info = _store("--secret-file", str(secret), "--http-port", "0")
    try:
        proc = zb_process("status", "--store", f"127.0.0.1:{info['port']}", "--secret-file", str(secret), "--timeout",
                          "5", timeout=60)
        with urllib.request.urlopen(info["dashboard"] + "api/status", timeout=30) as r:
            board = json.loads(r.read())
    finally:
        _stop(sealed)
    assert proc.returncode == 1 and "no node has joined it" in proc.stderr, proc.stderr
    assert "no node has joined it" in board["error"], board


def _seal_a_run(port: int, secret: bytes) -> None:
    """A run as a node holding the secret leaves it in the store: the world and its status record sealed, its
    heartbeat counter, its line on the store's list of runs."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from zb.elastic import keys, runs
    from zb.elastic.world import World
    from zb.signed_store import authenticated, holds_secret
    from zb.status.record import encode

    client = dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=True, timeout=timedelta(seconds=30))
    store = authenticated(client, secret, f"127.0.0.1:{port}", keys.is_counter)
    store.set(keys.WORLD, World(version=2, resolution=1, nodes=["a"], tokens={"a": "t"}).encode())
    store.append(keys.STATUS_INDEX, "a\n")
    store.set(keys.status("a"), encode({"format": 1, "uid": "a", "state": "training", "step": 20, "outer_step": 4,
                                        "loss": 1.5, "tokens_per_s": 100.0, "total_steps": 40,
                                        "heartbeat_interval": 0.5, "heartbeat_timeout": 60.0}))
    store.add(keys.heartbeat("a"), 1)
    runs.root_of(store).append(keys.RUNS, runs.start_line("", secret=holds_secret(store), now=time.time()))


def _store_items(port: int) -> dict[str, bytes]:
    from datetime import timedelta

    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=True, timeout=timedelta(seconds=30))
    names = sorted(client.list_keys())
    return dict(zip(names, client.multi_get(names)))


def test_both_dashboards_read_a_sealed_run_with_the_secret_and_write_nothing(tmp_path):
    """Issue 40: `zb store --http-port N --secret-file F` was reported to exit 2 (its dashboard opened the store
    without the secret). With a run's records sealed in the store, `zb store`'s own dashboard and `zb status --serve
    --secret-file` both show the node from its sealed records, and every key and value is as it was."""
    from zb.secret import read_secret
    from zb.testing.procs import wait_until

    secret_file = tmp_path / "run.secret"
    write_new_secret(secret_file)
    store, info = _store("--secret-file", str(secret_file), "--http-port", "0")
    served = None
    try:
        _seal_a_run(info["port"], read_secret(str(secret_file)))
        before = _store_items(info["port"])
        served = subprocess.Popen([sys.executable, "-m", "zb", "status", "--serve", "--http-port", "0", "--json",
                                   "--store", f"127.0.0.1:{info['port']}", "--secret-file", str(secret_file)],
                                  env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=REPO)
        line = served.stdout.readline()
        assert line, served.stderr.read()
        for url in (info["dashboard"], json.loads(line)["url"]):
            def shown(url=url):
                with urllib.request.urlopen(url + "api/status", timeout=30) as r:
                    doc = json.loads(r.read())
                return doc if doc["nodes"] else None

            doc = wait_until(shown, 60, f"the node on the dashboard at {url}", alive=[store, served])
            assert [(n["uid"], n["step"], n["loss"]) for n in doc["nodes"]] == [("a", 20, 1.5)], doc
            assert not doc.get("error") and not doc.get("warning"), doc
        assert _store_items(info["port"]) == before, "a dashboard wrote to the store"
    finally:
        if served is not None:
            served.terminate()
            assert served.wait(30) == 0, served.stderr.read()
        _stop(store)
    assert store.returncode == 0


def test_zb_store_refuses_to_overwrite_a_secret_or_take_two(tmp_path):
    secret = tmp_path / "run.secret"
    write_new_secret(secret)
    before = secret.read_text()
    again = zb_process("store", "--port", str(free_port()), "--new-secret", str(secret), timeout=60)
    assert again.returncode == 2 and "never overwritten" in again.stderr and secret.read_text() == before
    both = zb_process("store", "--port", str(free_port()), "--new-secret", str(tmp_path / "n"), "--secret-file",
                      str(secret), timeout=60)
    assert both.returncode == 2 and "give one" in both.stderr
    missing = zb_process("store", "--port", str(free_port()), "--secret-file", str(tmp_path / "absent"), timeout=60)
    assert missing.returncode == 2 and "cannot read the run secret" in missing.stderr


def test_a_store_off_loopback_with_a_secret_warns_only_that_it_does_not_encrypt(tmp_path):
    proc, info = _store("--host", "0.0.0.0", "--new-secret", str(tmp_path / "s"))
    err = _stop(proc)
    assert "anyone who reaches" not in err and "does not encrypt" in err


def test_bench_allreduce_ranks_without_the_secret_are_refused(tmp_path):
    secret = tmp_path / "run.secret"
    write_new_secret(secret)
    port = free_port()
    rank0 = subprocess.Popen([sys.executable, "-m", "zb", "bench-allreduce", "--store", f"127.0.0.1:{port}", "--rank",
                              "0", "-w", "2", "--size-mb", "0.1", "--iterations", "1", "--compressions", "none",
                              "--timeout", "60", "--secret-file", str(secret)], env=subprocess_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        common = ("bench-allreduce", "--store", f"127.0.0.1:{port}", "--rank", "1", "-w", "2", "--size-mb", "0.1",
                  "--iterations", "1", "--compressions", "none", "--timeout", "60")
        refused = zb_process(*common, timeout=90)
        assert refused.returncode == 2 and "admits only nodes that hold its secret" in refused.stderr
        joined = zb_process(*common, "--secret-file", str(secret), timeout=90)
        assert joined.returncode == 0, joined.stderr
        assert rank0.wait(60) == 0, rank0.stderr.read()
    finally:
        rank0.kill()
        rank0.wait(10)
    local = zb_process("bench-allreduce", "-w", "2", "--secret-file", str(secret), timeout=60)
    assert local.returncode == 2 and "--secret-file goes with --store" in local.stderr
