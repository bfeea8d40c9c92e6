"""Harness for multi-node tests and scripts: a real `zb store` and real node processes, either the
membership driver (tests/elastic_node.py, Cluster) or whole `zb train` nodes (TrainCluster).

Every node writes JSON lines to its own file; the harness reads them to decide what the survivors
agree on. Every wait is bounded; `close()` kills whatever is left (callers call it in a finally).

Used only from a source checkout: the membership driver (tests/elastic_node.py) and the DiLoCo
reference (tests/drivers/diloco_reference.py) are files in tests/, addressed by path from the
checkout root (zb.testing.procs.REPO); a zb installed without its checkout fails naming the missing file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from zb.elastic.profiles import SHORT_TIMEOUTS
from zb.metrics import read_metrics
from zb.testing.procs import REPO, TINY, checkout_file, free_port, subprocess_env, wait_listening, wait_until

if TYPE_CHECKING:
    from torch.distributed import TCPStore

# The short-timeout test profile (docs/elastic.md): safe on 2 busy cores.
PROFILE = SHORT_TIMEOUTS
NODE = str(REPO / "tests" / "elastic_node.py")


class Node:
    def __init__(self, uid: str, proc: subprocess.Popen, out: Path, err: Path) -> None:
        self.uid, self.proc, self.out, self.err = uid, proc, out, err

    def events(self, kind: str | None = None) -> list[dict]:
        found = []
        for line in self.out.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if kind is None or event.get("event") == kind:
                found.append(event)
        return found

    def signal(self, sig: int) -> float:
        self.proc.send_signal(sig)
        return time.time()

    def log_tail(self, n: int = 15) -> str:
        return "\n".join(self.err.read_text().splitlines()[-n:])


class Cluster:
    def __init__(self, tmp: Path, **env: str) -> None:
        self.tmp, self.port = tmp, free_port()
        self.env = subprocess_env(GLOBAL_ADDR="127.0.0.1", GLOBAL_PORT=str(self.port), **PROFILE)
        self.env.update(env)
        self.nodes: dict[str, Node] = {}
        self.store: subprocess.Popen | None = None      # the `zb store` at self.port
        self.standby_ports: list[int] = []               # later addresses of elastic.addr (add_standby)
        self.standbys: dict[int, subprocess.Popen] = {}  # `zb store` processes at those
        self.hosted: TCPStore | None = None             # the store host_store hosts in this process

    # -- processes --------------------------------------------------------------------------
    def host_store(self) -> None:
        """The store in this process (saves a torch import per test); `zb store` is tested on its own."""
        from zb.elastic.tcpstore import host

        self.hosted = host("127.0.0.1", self.port)

    def add_standby(self) -> int:
        """One more store address after the others in GLOBAL_ADDR (elastic.addr's failover list); returns its
        port. Nothing listens there until start_store(port) or a node hosts it (elastic.host_store)."""
        self.standby_ports.append(free_port())
        self.env["GLOBAL_ADDR"] = ",".join(f"127.0.0.1:{p}" for p in [self.port, *self.standby_ports])
        return self.standby_ports[-1]

    def start_store(self, port: int | None = None) -> subprocess.Popen:
        """A `zb store` at self.port (or at a standby's `port`)."""
        port = port or self.port
        proc = subprocess.Popen([sys.executable, "-m", "zb", "store", "--port", str(port)], env=self.env,
                                stdout=subprocess.DEVNULL, stderr=open(self.tmp / f"store-{port}.err", "a"), cwd=REPO)
        wait_listening(port, 60)
        if port == self.port:
            self.store = proc
        else:
            self.standbys[port] = proc
        return proc

    def kill_store(self, port: int | None = None) -> None:
        """SIGKILL the `zb store` at self.port (or at a standby's `port`)."""
        store = self.store if port in (None, self.port) else self.standbys[port]
        assert store is not None, "start_store() first"
        store.kill()
        store.wait(10)

    def silence_store(self, port: int | None = None) -> None:
        """SIGSTOP the `zb store` at self.port (or at a standby's `port`): its sockets stay open and the kernel keeps
        accepting and acknowledging, but nothing answers and nothing is reset, as with a machine that vanished
        without a word. close() kills it (SIGKILL ends a stopped process too)."""
        store = self.store if port in (None, self.port) else self.standbys[port]
        assert store is not None, "start_store() first"
        store.send_signal(signal.SIGSTOP)

    def start(self, uid: str, rank: int = 0, world_size: int = 1, *args: str, nproc: int = 0, **env: str) -> Node:
        out, err = self.tmp / f"{uid}.{len(self.nodes)}.out", self.tmp / f"{uid}.{len(self.nodes)}.err"
        node_env = dict(self.env, GLOBAL_UNIQUE_ID=uid, GLOBAL_RANK=str(rank), GLOBAL_WORLD_SIZE=str(world_size), **env)
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                    if nproc else [sys.executable])
        proc = subprocess.Popen([*launcher, checkout_file(NODE), *args], env=node_env, stdout=open(out, "w"),
                                stderr=open(err, "w"))
        node = Node(uid, proc, out, err)
        self.nodes[f"{uid}.{len(self.nodes)}"] = node
        return node

    def start_world(self, n: int, *args: str, nproc: int = 0, **env: str) -> list[Node]:
        return [self.start(chr(ord("a") + i), i, n, *args, nproc=nproc, **env) for i in range(n)]

    def close(self) -> None:
        for node in self.nodes.values():
            kill_with_children(node.proc)
        self.hosted = None
        for store in [self.store, *self.standbys.values()]:
            if store is not None and store.poll() is None:
                store.kill()
                store.wait(10)

    # -- what the survivors agree on ----------------------------------------------------------
    def agreement(self, nodes: list[Node], size: int, after: float = 0.0, timeout: float = 60.0,
                  store_ok: bool = False) -> dict:
        """Wait until every node in `nodes` summed correctly over one world of `size` with the same
        mesh version, node list and distinct ranks; returns that view plus when it first happened."""
        def details() -> str:
            views = {n.uid: [(s["version"], s["size"], s["ok"]) for s in n.events("step")][-3:] for n in nodes}
            return f"last steps {views}\n" + "\n".join(f"--- {n.uid}\n{n.log_tail()}" for n in nodes)

        return wait_until(lambda: _common_view(nodes, size, after, store_ok), timeout,
                          f"agreement on a world of {size}", alive=[n.proc for n in nodes], details=details)


class TrainCluster(Cluster):
    """A `zb store` plus whole `zb train` nodes (torch's launcher for several local ranks), each
    with metrics in <tmp>/<uid>/metrics.jsonl and its log in <tmp>/<uid>.log. Node arguments are
    TINY plus DiLoCo every 5 steps with params hashes logged."""

    ARGS = [*TINY, "--model.name", "debug", "--diloco.inner_steps", "5", "--train.log_model_hash"]

    def __init__(self, tmp: Path, world_size: int, **env: str) -> None:
        # One thread per node, as torchrun gives each local rank: three nodes with two threads each on
        # 2 cores ran ~100x slower than one alone and missed the sync deadline (evicted, then rejoined).
        super().__init__(tmp, GLOBAL_WORLD_SIZE=str(world_size), **{"OMP_NUM_THREADS": "1", **env})
        self.procs: dict[str, subprocess.Popen] = {}
        self.start_store()

    def start_train(self, uid: str, *args: str, local_ranks: int = 1, rank: int = 0,
                    prefix: tuple[str, ...] = (), entry: tuple[str, ...] = ("-m", "zb"),
                    env: dict[str, str | None] | None = None) -> subprocess.Popen:
        """`prefix`: a command the node runs under, e.g. `ip netns exec NS` (it execs, so the pid stays).
        `entry`: what the interpreter runs in place of `-m zb` (a script and its own arguments, e.g. the
        hostile node's driver, scripts/_hostile_node.py FACTOR; one local rank only). `env`: variables
        changed for this node only (None removes one, e.g. the run secret's)."""
        node_env = dict(self.env, GLOBAL_UNIQUE_ID=uid, GLOBAL_RANK=str(rank))
        for name, value in (env or {}).items():
            if value is None:
                node_env.pop(name, None)
            else:
                node_env[name] = value
        launcher = [*prefix, sys.executable, *entry, "train"]
        if local_ranks > 1:
            assert entry == ("-m", "zb"), "entry: one local rank only"
            launcher = [*prefix, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                        str(local_ranks), "-m", "zb", "train"]
        proc = subprocess.Popen([*launcher, *self.ARGS, *args, "--log.dir", str(self.tmp / uid)], env=node_env,
                                stdout=subprocess.DEVNULL, stderr=open(self.tmp / f"{uid}.log", "w"), cwd=REPO,
                                start_new_session=True)
        self.procs[uid] = proc
        return proc

    def metrics(self, uid: str, event: str) -> list[dict]:
        path = self.tmp / uid / "metrics.jsonl"
        return read_metrics(path, event) if path.exists() else []

    def wait_for(self, uid: str, condition, what: str, timeout: float = 150) -> None:
        wait_until(condition, timeout, f"{uid}: {what}", alive=[self.procs[uid]], details=lambda: self.log(uid))

    def wait_outer(self, uid: str, n: int, timeout: float = 150) -> None:
        self.wait_for(uid, lambda: len(self.metrics(uid, "outer_step")) >= n, f"outer step {n}", timeout)

    def finish(self, uid: str, timeout: float = 200) -> int:
        try:
            return self.procs[uid].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{uid} did not finish:\n{self.log(uid)}") from None

    def log(self, uid: str) -> str:
        return "\n".join((self.tmp / f"{uid}.log").read_text().splitlines()[-25:])

    def hashes(self, uid: str) -> dict[int, str]:
        return {e["outer_step"]: e["params_hash"] for e in self.metrics(uid, "outer_step") if e["applied"]}

    def close(self) -> None:
        for proc in self.procs.values():
            kill_with_children(proc, group=True)
        super().close()


def _common_view(nodes: list[Node], size: int, after: float, store_ok: bool = False) -> dict | None:
    """`store_ok`: count only steps taken while the node reached the store (a node keeps its old
    world while the store is down, so without this an outage could pass for agreement)."""
    by_version: dict[int, list[dict]] = {}
    for node in nodes:
        for step in node.events("step"):
            if store_ok and not step.get("store_ok", True):
                continue
            if step["time"] >= after and step["size"] == size and step["ok"]:
                by_version.setdefault(step["version"], []).append(step)
    for version, steps in sorted(by_version.items()):
        firsts = {s["uid"]: s for s in reversed(steps)}     # first step of each node at this version
        if set(firsts) != {n.uid for n in nodes}:
            continue
        views = {(tuple(s["nodes"]), s["leader"]) for s in firsts.values()}
        ranks = sorted(s["rank"] for s in firsts.values())
        assert len(views) == 1, f"nodes disagree at mesh version {version}: {views}"
        assert ranks == list(range(size)), f"ranks not compact at mesh version {version}: {ranks}"
        assert all(s["nodes"][s["rank"]] == s["uid"] for s in firsts.values())
        times = [s["time"] for s in firsts.values()]
        return {"version": version, "nodes": list(views.pop()[0]), "time": min(times), "all_time": max(times)}
    return None


# -- what several DiLoCo test modules check the same way ------------------------------------
def hashes_by_mesh(run: TrainCluster, uid: str, world_size: int = 2) -> dict[tuple[int, int], str]:
    """params_hash of every all-reduce the node took in a world of `world_size` nodes, keyed by
    (mesh version, index within that version): the key the nodes share for one all-reduce,
    whatever their own counters say."""
    out: dict[tuple[int, int], str] = {}
    seen: dict[int, int] = {}
    for e in run.metrics(uid, "outer_step"):
        if e["global_world_size"] == world_size:
            k = seen[e["mesh_version"]] = seen.get(e["mesh_version"], -1) + 1
            out[(e["mesh_version"], k)] = e["params_hash"]
    return out


def join_late(run: TrainCluster, *args: str) -> None:
    """Two nodes train indefinitely; a third joins after outer step 2 and does 3 outer steps with
    them; then all stop (SIGTERM). Ending the run on our signal, not after a step count, makes sure
    the joiner meets the others however fast or slow the machine is."""
    for i in range(2):
        run.start_train(f"n{i}", "--optim.total_steps", "100000", *args, rank=i)
    run.wait_outer("n0", 2)
    run.start_train("late", "--optim.total_steps", "100000", *args, rank=2)
    run.wait_outer("late", 3)
    for uid in ("n0", "n1", "late"):
        run.procs[uid].send_signal(signal.SIGTERM)
    for uid in ("n0", "n1", "late"):
        assert run.finish(uid) == 128 + signal.SIGTERM, run.log(uid)


def agree_with_joiner(run: TrainCluster) -> None:
    """At every all-reduce the three nodes took together, the joining one included (a receiver
    logs the hash of the state it received), they hold identical outer params."""
    hashes = [hashes_by_mesh(run, uid, 3) for uid in ("n0", "n1", "late")]
    shared = sorted(set.intersection(*(set(h) for h in hashes)))
    assert len(shared) >= 2, f"the joiner did not train with the others: {hashes}"
    for k in shared:
        assert hashes[0][k] == hashes[1][k] == hashes[2][k], f"all-reduce {k} (mesh version, index)"


REFERENCE = str(REPO / "tests" / "drivers" / "diloco_reference.py")


def reference_losses(nodes: int | str, rule: str, flags: list[str]) -> list[list[float]]:
    """Each simulated node's step losses under `rule` (tests/drivers/diloco_reference.py)."""
    return reference_losses_of_rules(nodes, {rule: flags})[rule]


def reference_losses_of_rules(nodes: int | str, runs: dict[str, list[str]]) -> dict[str, list[list[float]]]:
    """reference_losses for each rule of `runs` (rule -> its flags), in one process: one start of torch for all."""
    out = subprocess.run([sys.executable, checkout_file(REFERENCE), "--rules", str(nodes), json.dumps(runs)],
                         capture_output=True, text=True, timeout=300 * len(runs),
                         env=subprocess_env(OMP_NUM_THREADS="1"), cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["losses"]


# The reference reads flag/value pairs; TrainCluster.ARGS adds the model, H = 5 and params hashes.
RUN_FLAGS = ["--optim.total_steps", "22", "--diloco.outer_lr", "0.7", "--diloco.outer_momentum", "0.9"]

# Streaming: 2 fragments (one block each, plus embeddings and output spread), each all-reduce behind
# 1 inner step, merge 0.5; H = 6 so that the fragments divide it.
STREAMING = ["--diloco.inner_steps", "6", "--diloco.fragments", "2", "--diloco.fragment_delay", "1",
             "--diloco.fragment_alpha", "0.5"]


def worst_relative(got: list[float], expected: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, expected))


def kill_with_children(proc: subprocess.Popen, group: bool = False) -> None:
    """SIGKILL a node (its process group when `group`: one started in a session of its own) and every process under
    it, stopped ones included. torch's launcher may start its ranks in sessions of their own: a SIGKILLed launcher
    left them running as orphans, which retried the test's dead store for half a minute into the next tests."""
    import psutil

    if proc.poll() is None:
        try:
            ranks = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            ranks = []
        if group:
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        for rank in ranks:
            try:
                rank.kill()
            except psutil.NoSuchProcess:
                pass
    proc.wait(10)
