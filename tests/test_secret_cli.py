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
