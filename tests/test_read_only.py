"""Commands that read never write (issue 37): after a real 2-node DiLoCo run without a secret (a `zb store` that
outlives it, checkpoints on disk and a remote copy, and RAM copies as a live node and a killed one leave them),
every read-only command leaves every store key and value and every file and directory of the run as it found
them: `zb status` (one-shot, --json, --secret-file, --watch, --serve and its page), `zb ckpt ls` and `zb ckpt
verify`, `zb generate`, `zb export` (its OUT aside) and `zb train --eval.only` (its own metrics aside). One run
serves the module (per pytest worker); each command is its own test, and the snapshot compares list_keys and
every value, and each entry's size, mtime_ns and sha256 (a directory's mtime catches a file made and removed)."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest

from zb.metrics import read_metrics
from zb.secret import write_new_secret
from zb.testing.cluster import TrainCluster
from zb.testing.procs import REPO, subprocess_env, zb_process

# The run is made once per pytest worker, inside the first test that worker takes.
pytestmark = pytest.mark.timeout(400)

NODES = ("n0", "n1")
# Two outer steps of 3 inner steps, a checkpoint and a held-out loss at each.
RUN = ["--optim.total_steps", "6", "--diloco.inner_steps", "3", "--ckpt.interval", "3", "--eval.interval", "3",
       "--eval.batches", "2"]


class Finished:
    """The run, ended: its store (still up), its directories, and what each node logged."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.run = tmp, TrainCluster(tmp, len(NODES))
        self.store = f"127.0.0.1:{self.run.port}"

    def train(self) -> None:
        for rank, uid in enumerate(NODES):
            self.run.start_train(uid, *RUN, *self.ckpt(uid), "--ckpt.remote.path", str(self.tmp / "remote"),
                                 rank=rank)
        for uid in NODES:
            assert self.run.finish(uid) == 0, self.run.log(uid)

    def plant_ram_copies(self) -> None:
        """What ckpt.ram_dir holds on a machine where n1 still trains (its RAM copy, owned by a live process) and
        a node that was killed left its copies (owned by a dead one): a command that reads touches neither."""
        import shutil
        import socket

        from zb.ckpt.durable.ramdir import claim, owner_file

        ram = self.tmp / "ram"
        shutil.copytree(self.step_dir("n1", 6), ram / "n1" / "step-000000006")
        claim(ram / "n1", self.ckpt_dir("n1"))
        shutil.copytree(self.step_dir("n0", 3), ram / "gone" / "step-000000003")
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
        owner_file(ram / "gone", int(dead.stdout)).write_text(json.dumps({"pid": int(dead.stdout), "start": "0",
                                                                          "host": socket.gethostname()}))

    def ckpt(self, uid: str) -> list[str]:
        return ["--ckpt.path", str(self.ckpt_dir(uid)), "--ckpt.ram_dir", str(self.tmp / "ram")]

    def ckpt_dir(self, uid: str) -> Path:
        return self.tmp / f"ck-{uid}"

    def step_dir(self, uid: str, step: int) -> Path:
        return self.ckpt_dir(uid) / f"step-{step:09d}"

    def snapshot(self) -> dict:
        """Every store key and value, and every file (size, mtime, sha256) and directory (mtime) of the run's."""
        return {"store": _store_items(self.run.port), "files": _tree(self.tmp)}


def _store_items(port: int) -> dict[str, bytes]:
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=True, timeout=timedelta(seconds=30))
    names = sorted(client.list_keys())
    return dict(zip(names, client.multi_get(names))) if names else {}


def _tree(root: Path) -> dict[str, tuple]:
    """Every entry under root: a directory's mtime changes when anything is created or removed in it, even a
    file removed again."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        st = path.lstat()
        if path.is_dir():
            out[str(rel)] = ("dir", st.st_mtime_ns)
        else:
            out[str(rel)] = ("file", st.st_size, st.st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def _changes(before: dict, after: dict) -> list[str]:
    lines = []
    for what in ("store", "files"):
        old, new = before[what], after[what]
        lines += [f"{what}: {k} added" for k in sorted(set(new) - set(old))]
        lines += [f"{what}: {k} removed" for k in sorted(set(old) - set(new))]
        lines += [f"{what}: {k} changed" for k in sorted(set(old) & set(new)) if old[k] != new[k]]
    return lines


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    run = Finished(tmp_path_factory.mktemp("read-only"))
    try:
        run.train()
        run.plant_ram_copies()
        write_new_secret(run.tmp / "run.secret")
        yield run
    finally:
        run.run.close()


@pytest.fixture
def unchanged(finished):
    """Fails the test if anything of the run's changed while it ran."""
    before = finished.snapshot()
    yield finished
    assert not _changes(before, finished.snapshot()), _changes(before, finished.snapshot())


def _ok(proc: subprocess.CompletedProcess, code: int = 0) -> str:
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("flags", [(), ("--json",), ("--secret-file", "SECRET"), ("--json", "--secret-file", "SECRET")],
                         ids=["table", "json", "secret-file", "json-secret-file"])
def test_status_reads_only(unchanged, flags):
    run = unchanged
    flags = tuple(str(run.tmp / "run.secret") if f == "SECRET" else f for f in flags)
    proc = zb_process("status", "--store", run.store, *flags, timeout=90)
    out = _ok(proc)
    if "--json" in flags:
        assert {n["uid"] for n in json.loads(out)["nodes"]} == set(NODES)
    if "--secret-file" in flags:
        assert "holds no secret" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def _until_signal(args: list[str], tmp: Path, ready) -> tuple[int, str, str]:
    """`zb ARGS` until `ready(its stdout so far)` holds, then SIGINT; (exit code, stdout, stderr)."""
    err = tmp / "cmd.err"
    proc = subprocess.Popen([sys.executable, "-m", "zb", *args], stdout=subprocess.PIPE, stderr=open(err, "w"),
                            text=True, env=subprocess_env(), cwd=REPO)
    lines: list[str] = []
    try:
        while not ready(lines):
            line = proc.stdout.readline()
            assert line, err.read_text()
            lines.append(line)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return proc.returncode, "".join(lines) + rest, err.read_text()


@pytest.mark.parametrize("secret", [False, True], ids=["plain", "secret-file"])
def test_status_watch_reads_only(unchanged, secret, tmp_path):
    run = unchanged
    flags = ["--secret-file", str(run.tmp / "run.secret")] if secret else []
    code, out, err = _until_signal(["status", "--store", run.store, "--watch", "--json", "--interval", "0.2", *flags],
                                   tmp_path, lambda lines: len(lines) >= 3)
    assert code == 0 and all(json.loads(line)["nodes"] for line in out.splitlines()[:3]), err
    assert ("holds no secret" in err) == secret and err.count("holds no secret") <= 1, err


@pytest.mark.parametrize("secret", [False, True], ids=["plain", "secret-file"])
def test_status_serve_reads_only(unchanged, secret, tmp_path):
    run = unchanged
    flags = ["--secret-file", str(run.tmp / "run.secret")] if secret else []
    pages = []

    def served(lines: list[str]) -> bool:
        if not lines:
            return False
        url = json.loads(lines[0])["url"]
        for path in ("", "api/status"):
            with urllib.request.urlopen(url + path, timeout=30) as r:
                pages.append(r.read())
        return True

    code, _, err = _until_signal(["status", "--store", run.store, "--serve", "--http-port", "0", "--interval", "0.2",
                                  "--json", *flags], tmp_path, served)
    doc = json.loads(pages[1])
    assert code == 0 and b"<html" in pages[0].lower() and {n["uid"] for n in doc["nodes"]} == set(NODES), err
    assert ("holds no secret" in (doc["warning"] or "")) == secret, doc["warning"]


@pytest.mark.parametrize("args", [["CK"], ["CK", "--json"], ["CK", "--remote", "REMOTE"], ["RAM"],
                                  ["--remote", "REMOTE", "--json"]],
                         ids=["plain", "json", "remote", "ram-dir", "remote-only"])
def test_ckpt_ls_reads_only(unchanged, args):
    run = unchanged
    where = {"CK": str(run.ckpt_dir("n1")), "REMOTE": str(run.tmp / "remote"), "RAM": str(run.tmp / "ram")}
    out = _ok(zb_process("ckpt", "ls", *[where.get(a, a) for a in args], timeout=90))
    if "--json" in args:
        json.loads(out)


@pytest.mark.parametrize("args", [["STEP"], ["STEP", "--json"], ["CK", "--step", "3"], ["STEP/rank-0"]],
                         ids=["plain", "json", "step", "part"])
def test_ckpt_verify_reads_only(unchanged, args):
    run = unchanged
    step = str(run.step_dir("n1", 6))
    where = {"STEP": step, "CK": str(run.ckpt_dir("n1")), "STEP/rank-0": f"{step}/rank-0"}
    _ok(zb_process("ckpt", "verify", *[where.get(a, a) for a in args], timeout=90))


@pytest.mark.parametrize("params", ["inner", "outer"])
def test_generate_reads_only(unchanged, params):
    run = unchanged
    out = _ok(zb_process("generate", str(run.ckpt_dir("n1")), "--prompt", "The", "--max-new-tokens", "4",
                         "--params", params, "--device", "cpu", "--json", timeout=120))
    assert json.loads(out)["step"] == 6


def test_export_writes_only_its_out(unchanged, tmp_path):
    run = unchanged
    _ok(zb_process("export", str(run.step_dir("n1", 6)), str(tmp_path / "hf"), timeout=120))
    assert (tmp_path / "hf" / "config.json").is_file()


def _eval_only(run: Finished, log_dir: Path, *args: str,
               launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`zb train --eval.only` with the run's flags, as node n1 on the run's machine (its store still up), its
    metrics in `log_dir`."""
    cmd = [*launcher, "train", *TrainCluster.ARGS, *RUN, *run.ckpt("n1"), "--eval.only", "--log.dir", str(log_dir),
           *args]
    env = subprocess_env(GLOBAL_ADDR="127.0.0.1", GLOBAL_PORT=str(run.run.port), GLOBAL_WORLD_SIZE="2",
                         GLOBAL_UNIQUE_ID="n1", OMP_NUM_THREADS="1")
    head = [sys.executable, "-m", "zb"] if not launcher else [sys.executable, "-m"]
    return subprocess.run([*head, *cmd], capture_output=True, text=True, timeout=170, env=env, cwd=REPO)


def test_eval_only_reads_only_and_takes_the_nodes_data_slot(unchanged, tmp_path):
    """Node n1's checkpoint of step 6, evaluated alone with the run's flags as node n1 (beside its RAM copy): the
    held-out loss n1 logged at step 6, on its own data slot, which the checkpoint records (no --data flags)."""
    run = unchanged
    logged = [e for e in run.run.metrics("n1", "eval") if e["step"] == 6]
    assert logged, run.run.metrics("n1", "eval")
    proc = _eval_only(run, tmp_path, "--ckpt.resume", "latest")
    _ok(proc)
    (event,) = read_metrics(tmp_path / "metrics.jsonl", "eval")
    assert event["step"] == 6 and event["loss"] == logged[-1]["loss"], (event, logged)
    assert "ignores" not in proc.stderr and "data slot 1 of 2" in proc.stderr, proc.stderr


def test_eval_only_of_a_remote_copy_reads_it_aside(unchanged, tmp_path):
    """A remote step directory is downloaded into a temporary directory, never into ckpt.path."""
    run = unchanged
    url = f"file://{run.tmp / 'remote' / 'n1' / 'step-000000006'}"
    proc = _eval_only(run, tmp_path, "--ckpt.resume", url)
    _ok(proc)
    logged = [e for e in run.run.metrics("n1", "eval") if e["step"] == 6][-1]
    assert read_metrics(tmp_path / "metrics.jsonl", "eval")[-1]["loss"] == logged["loss"]
    assert f"eval.only: checkpoint {url} (step 6)" in proc.stderr, proc.stderr


def test_eval_only_with_two_local_ranks_reshards_and_reads_only(unchanged, tmp_path):
    run = unchanged
    proc = _eval_only(run, tmp_path, "--ckpt.resume", "latest",
                      launcher=("torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "zb"))
    _ok(proc)
    assert "written by 1 local ranks and this node has 2: its model is resharded" in proc.stderr, proc.stderr


def test_eval_only_refuses_another_runs_checkpoint_in_one_line(unchanged, tmp_path):
    run = unchanged
    proc = _eval_only(run, tmp_path, "--ckpt.resume", "latest", "--model.n_layers", "3")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "was written by a different run: model.n_layers (checkpoint: unset, this node: 3)" in line, line


def test_eval_only_takes_the_remote_copy_of_a_step_whose_local_copy_is_damaged(unchanged, tmp_path):
    """As a resume does: `latest` reads the remote copy when the local one does not verify (downloaded aside)."""
    import shutil

    run = unchanged
    ckpt = tmp_path / "ck"
    shutil.copytree(run.ckpt_dir("n1"), ckpt)
    model = ckpt / "step-000000006" / "rank-0" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF
    model.write_bytes(bytes(data))
    proc = _eval_only(run, tmp_path / "log", "--ckpt.resume", "latest", "--ckpt.path", str(ckpt),
                      "--ckpt.remote.path", str(run.tmp / "remote"))
    _ok(proc)
    assert "skipping the local copy of checkpoint step 6" in proc.stderr, proc.stderr
    assert f"eval.only: checkpoint {run.tmp / 'remote' / 'n1' / 'step-000000006'} (step 6)" in proc.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000000003", "step-000000006"]
