"""Chaos harness: DiLoCo nodes around a real `zb store`, on loopback or each on an emulated host of its
own (--netns), hit by a seeded random schedule of failures; after every event the survivors must keep
training, no running node may be declared dead, no two runs may exist at once, and at every outer step
the nodes that applied it must hold the same params.

    PYTHONPATH=$PWD .venv/bin/python scripts/chaos.py --seed 7 --events 6      # replay seed 7
    PYTHONPATH=$PWD .venv/bin/python scripts/chaos.py --nodes 6 --keep logs/chaos
    sudo PYTHONPATH=$PWD .venv/bin/python scripts/chaos.py --netns --seed 1 --events 5
    PYTHONPATH=$PWD .venv/bin/python scripts/chaos.py --seed 2 --events 3 --kinds donor-leave

Events: sigkill, sigterm, sigstop (frozen past the heartbeat timeout, then SIGCONT), join (blocking),
join-live (live recovery, non-blocking), kill-leader (SIGKILL of the lowest live rank during an outer
step), store-restart (the current store SIGKILLed and started again on its port), store-loss (the current
store SIGKILLed for good: every node must move to the next store of elastic.addr, where a standby `zb
store` waits, and re-form the run there; loopback only), donor-leave (a live-recovery
joiner's donor frozen as the joiner asks it for the outer state, then SIGKILLed or SIGTERMed: the
joiner must recover from the other peers and agree with the survivors), rogue-join (nodes without the
run secret: a `zb train` with the cluster's arguments but no secret, and one with another secret, must
each exit 2 with the one-line refusal; then a raw store client, holding no secret, appends a join request
for a made-up node and sets its address: no membership may ever name any of the three, the survivors keep
stepping and agree), poison (a joiner whose pseudo-gradient is multiplied by 1000 or by -1, the seed
picks, through scripts/_hostile_node.py, SIGKILLed once it contributed to 3 outer steps: the survivors
keep agreeing, their loss stays finite, and for x1000 every survivor's log reports it clipped; blocking
DiLoCo only), liar (a joiner that lies in its check-in, the seed picks how: 1000 outer steps ahead, 30x its
update under its honest norm, or NaN under a small one; SIGKILLed after 3 check-ins: the survivors must apply
every outer step meanwhile and each log its claim as not holding; blocking DiLoCo only), store-tamper (a raw
store client without the secret deletes the run marker, writes junk into roll-call counters, bumps the next
ones by 10**9 and writes junk into a node's heartbeat counter: every node stays alive in one run and the marker
is back as it was), flood (20,000 connect-and-reset loops against every port a node listens on, from a host
that is not a member: the node stays alive with its descriptor count flat). With --netns (root, iproute2, nft; zb.net.netns builds one namespace and veth per node and
one for the store) also: link-down (a node's link down for a while, then up: past the heartbeat timeout it is
evicted and must rejoin with the run's state), partition (every packet between two nodes dropped both ways while
both reach the store: one of them is dropped, the others keep applying outer steps, both are back in one world
after the heal), store-cut (nft drops every packet, no reset, between one to all but one nodes and the store,
while they still reach each other) and three silent failures, nft dropping every packet with no reset:
host-silent (a node's host silent to everyone, store and peers, for less than the heartbeat timeout, then back
in one world; or for good: the others must form a world without it within SILENT_BOUND, then the harness
SIGKILLs it, lifts its host's rules and starts a replacement; the row gives the others' longest gap without
an applied outer step), group-partition (the live nodes split into two groups of drawn sizes that drop every
packet between them while both reach the store, short or past PARTITION_BOUND: at most one side may apply outer
steps in a world of its own at a time, then one world of all) and store-silent (the current store's host silent
for good: every node moves to the standby `zb store`, on a host of its own and second in every node's
elastic.addr, with elastic.store_failover_s 10 s, and the run re-forms there; the row gives the time from the
silence to the first outer step on the standby; the standby is there only when the kinds include store-silent,
default included). After every network event the sides it cut must not have applied outer steps in worlds of
their own at the same time. Killed nodes are replaced by joiners so the run keeps `--nodes` nodes. At the end
every node gets SIGTERM, no child process and no partition rule may be left, and a survivor's newest checkpoint
must resume. Prints a table of events and one JSON line {seed, events, survived, failures}; exits 1 on
any failed check (the seed and the replay command are in the message), 2 on a bad invocation.
Nodes are `zb/testing/cluster.py`'s TrainCluster (tiny debug model, short-timeout profile). Every run has a
run secret (elastic.secret_file, a new one in the run's directory, given to the stores and every node as
ZB_ELASTIC_SECRET_FILE). With --overlap none every node also runs with diloco.clip 2 (robust aggregation), so
a poisoned node cannot wreck the model; with eager or streaming overlap it is off, and poison is never drawn:
zb refuses diloco.clip with an overlapped all-reduce (the norms are compared in the check-in, which that
all-reduce has already left behind).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil
from _chaos_checks import (
    Failure,
    Tail,
    agreement_failures,
    false_evictions,
    forge_join,
    non_finite_losses,
    one_world,
    orphans,
    refusal_problem,
    resume_check,
    rogues_admitted,
    split_runs,
    split_sides,
    tcp_sockets,
)

from zb.collectives import COMPRESSIONS
from zb.secret import SECRET_ENV, write_new_secret
from zb.testing.cluster import PROFILE, TrainCluster
from zb.testing.procs import REPO

KINDS = ["sigkill", "sigterm", "sigstop", "join", "join-live", "kill-leader", "store-restart", "store-loss",
         "donor-leave", "rogue-join", "poison", "liar", "store-tamper", "flood"]
BLOCKING_KINDS = ["poison", "liar"]        # only with --overlap none: diloco.clip is what they test
LOOPBACK_KINDS = ["store-loss"]            # the namespaced cluster has one store, on a host of its own
# elastic.store_failover_s of every node: longer than most store-restarts take (down 0.5-4 s, then `zb store`
# starts), so a restart mostly keeps the run where it is; one that takes longer moves it on, which is fine too.
FAILOVER_S = 10.0
STANDBYS = 3                               # stores after the first in elastic.addr: at most this many store-losses
# Only with --netns: faults of the network between hosts. The last three drop packets with no reset, as a machine
# that vanishes does (a reclaimed spot instance, a closed laptop lid): nothing tells the others, only deadlines do.
NETNS_KINDS = ["link-down", "partition", "store-cut", "host-silent", "group-partition", "store-silent"]
# Kinds that need a standby store in every node's elastic.addr: the namespaced cluster gets one (on a host of
# its own) and every node elastic.store_failover_s FAILOVER_S when the run may draw them.
STANDBY_KINDS = ["store-silent"]
# diloco.clip of every node with --overlap none. Not 1: the round's median is a contributor's own norm, so at 1
# every honest node above it (about half of them, every outer step) is scaled down and reported as "clipped in
# N outer steps in a row" (honest norms here lie within a few % of the median); 2 leaves honest nodes alone
# and still bounds a x1000 node's update to twice a typical one.
CLIP = "2"
HOSTILE = Path(__file__).resolve().parent / "_hostile_node.py"
HOSTILE_FACTORS = (1000.0, -1.0)           # poison: an outsized update, or a sign flip
POISON_ROUNDS = 3                          # outer steps the poisoner contributes to before it is killed
LIES = ("ahead", "quiet:30", "nan")        # liar: what it claims (scripts/_hostile_node.py)
LIAR_ROUNDS = 3                            # outer steps the liar checks in at before it is killed
# What every survivor logs of a liar (zb.diloco.trust, zb.diloco.blocking), per lie; {uid}: the liar's id
LIAR_LINES = {"ahead": "node {uid} claims a position past the one", "quiet:30": "{uid} left out", "nan": "{uid} left out"}
FLOOD_CONNECTIONS = 20_000                 # flood: connect-and-reset loops against each port of the node
FLOOD_DESCRIPTORS = 500                    # the most a flooded node's descriptor count may grow
INNER = 5
HEARTBEAT_TIMEOUT = float(PROFILE["ZERO_BAND_EDM_HEARTBEAT_TIMEOUT_SECONDS"])
# The longest a healthy survivor may take for one more outer step after an event: a dead peer is
# found within the heartbeat timeout, a late one after the sync deadline, each failed attempt costs a
# gloo timeout, a joiner waits at most the store timeout for admission; plus 30 s of slack for 2 busy
# cores. A joiner also has to start (import torch, build the model): 60 s more.
HANG_BOUND = (HEARTBEAT_TIMEOUT + float(PROFILE["ZB_ELASTIC_SYNC_DEADLINE"])
              + 4 * float(PROFILE["ZERO_BAND_GLOBAL_PG_TIMEOUT_SECONDS"])
              + float(PROFILE["ZERO_BAND_GLOBAL_STORE_TIMEOUT_SECONDS"]) + 30)
START_BOUND = 60.0
# How long a node refused for its secret may take to exit: start (import torch, build the model), then one
# look at the store's run marker; 30 s of slack for busy cores.
REFUSE_BOUND = START_BOUND + 30
STORE_TIMEOUT = float(PROFILE["ZERO_BAND_GLOBAL_STORE_TIMEOUT_SECONDS"])
# How long a two-way partition may stall the run's outer steps: one failed attempt (pg timeout) and the
# rebuild without one of the two (pg timeout), the blamed node's grace, and 10 s of slack for busy cores.
PARTITION_BOUND = (2 * float(PROFILE["ZERO_BAND_GLOBAL_PG_TIMEOUT_SECONDS"])
                   + float(PROFILE["ZERO_BAND_EDM_HEARTBEAT_INTERVAL_SECONDS"]) + 10)
# How long the others may take to form a world without a node whose host went silent for good: the silence
# found by the heartbeat timeout (between outer steps) or after the sync deadline (mid all-reduce), a failed
# attempt and the rebuild without it (two pg timeouts), a silent leader passed over by the judge's stuck rule
# (two sync deadlines and the heartbeat timeout), a round of inner steps, and 30 s of slack for 2 busy cores.
SILENT_BOUND = (2 * HEARTBEAT_TIMEOUT + 3 * float(PROFILE["ZB_ELASTIC_SYNC_DEADLINE"])
                + 2 * float(PROFILE["ZERO_BAND_GLOBAL_PG_TIMEOUT_SECONDS"]) + 30)
GRACE = 30


def needs_standby(kinds: list[str] | None) -> bool:
    """Whether a --netns run with these --kinds (None: all) hosts a standby store."""
    return kinds is None or bool(set(kinds) & set(STANDBY_KINDS))


class Chaos:
    def __init__(self, tmp: Path, seed: int, nodes: int, max_nodes: int, overlap: str = "none", net=None,
                 kinds: list[str] | None = None, compression: str = "none") -> None:
        self.rng, self.seed, self.nodes, self.max_nodes = random.Random(seed), seed, nodes, max_nodes
        self.net, self.overlap = net, overlap
        self.settings = ("--diloco.overlap", overlap, "--diloco.compression", compression,   # every node's
                         *(("--diloco.clip", CLIP) if overlap == "none" else ()))
        secret = tmp / "run.secret"             # the run's: the stores and every node hold it
        secret.unlink(missing_ok=True)          # a --keep directory used before holds an old one
        write_new_secret(secret)
        if net is None:
            self.cluster = TrainCluster(tmp, nodes, ZB_ELASTIC_STORE_FAILOVER_S=str(FAILOVER_S),
                                        **{SECRET_ENV: str(secret)})
            for _ in range(STANDBYS):     # idle `zb store`s the run fails over to, in elastic.addr's order
                self.cluster.start_store(self.cluster.add_standby())
        else:
            from _chaos_netns import NetnsCluster

            standby = needs_standby(kinds)
            failover = {"ZB_ELASTIC_STORE_FAILOVER_S": str(FAILOVER_S)} if standby else {}
            self.cluster = NetnsCluster(tmp, nodes, net, standby=standby, **failover, **{SECRET_ENV: str(secret)})
        self.store_port = self.cluster.port   # the run's current store
        self.kinds = kinds or [k for k in KINDS if (net is None or k not in LOOPBACK_KINDS)
                               and (overlap == "none" or k not in BLOCKING_KINDS)] + \
            (NETNS_KINDS if net is not None else [])
        self.silent_hosts: list = []         # --netns: hosts silent for good (store-silent), lifted at the end
        self.tails: dict[str, Tail] = {}
        self.live: list[str] = []
        self.gone: dict[str, int] = {}       # uid -> expected exit code (None: any)
        self.signalled: set[str] = set()     # nodes the schedule hit: only these may be declared dead
        self.rogues: set[str] = set()        # node ids without the run secret: no world may ever name one
        self.rows: list[tuple[float, str, str, str]] = []
        self.t0 = time.monotonic()
        self.count = 0

    # -- nodes -------------------------------------------------------------------------------
    def start(self, live_recovery: bool = False, entry: tuple[str, ...] = ("-m", "zb")) -> str:
        """A node of the run (`entry`: what runs in place of `python -m zb`, e.g. the hostile node's driver)."""
        uid = f"n{self.count}"
        self.count += 1
        self.cluster.start_train(uid, *self.node_args(uid, live_recovery), rank=len(self.live), entry=entry)
        self.tails[uid] = Tail(self.cluster.tmp / uid / "metrics.jsonl")
        self.live.append(uid)
        return uid

    def node_args(self, uid: str, live_recovery: bool = False) -> list[str]:
        tmp = self.cluster.tmp
        extra = ["--diloco.blocking_join", "false"] if live_recovery else []
        return ["--optim.total_steps", "100000", "--ckpt.path", str(tmp / "ckpt" / uid),
                "--ckpt.interval", str(2 * INNER), "--ckpt.ram_dir", str(tmp / "shm"),
                "--ckpt.grace_period", str(GRACE), "--ckpt.live_recovery",
                "--data.data_world_size", "16", *self.settings, *extra]

    def signal(self, uid: str, sig: int) -> None:
        if sig != signal.SIGCONT:
            self.signalled.add(uid)
        os.killpg(self.cluster.procs[uid].pid, sig)

    def remove(self, uid: str, code: int | None) -> None:
        self.live.remove(uid)
        self.gone[uid] = code

    def outer_counts(self, uids) -> dict[str, int]:
        return {u: len(self.tails[u].events("outer_step")) for u in uids}

    def leader(self) -> str:
        latest = max((e for u in self.live for e in self.tails[u].events("membership")),
                     key=lambda e: e["mesh_version"], default=None)
        return latest["leader"] if latest and latest["leader"] in self.live else min(self.live)

    def log(self, event: str, node: str, outcome: str) -> None:
        self.rows.append((time.monotonic() - self.t0, event, node, outcome))
        print(f"[chaos seed {self.seed}] {time.monotonic() - self.t0:6.1f}s {event:15s} {node:8s} {outcome}",
              file=sys.stderr, flush=True)

    # -- waits ---------------------------------------------------------------------------------
    def wait_progress(self, before: dict[str, int], what: str, bound: float = HANG_BOUND) -> float:
        """Until each node in `before` logged two more outer steps than it had (the second one began
        after the event), a new node (0 before) its first; a node exiting or the bound passing is a
        failure (a hang)."""
        start = time.monotonic()
        while True:
            behind = [u for u, n in before.items() if len(self.tails[u].events("outer_step")) < (n + 2 if n else 1)]
            if not behind:
                return time.monotonic() - start
            for u in behind:
                code = self.cluster.procs[u].poll()
                if code is not None:
                    raise Failure(f"{u} exited with {code} after {what}:\n{self.cluster.log(u)}")
            if time.monotonic() - start > bound:
                raise Failure(f"hang: {behind} took no outer step within {bound:.0f} s after {what}:\n"
                              + "\n".join(f"--- {u}\n{self.cluster.log(u)}" for u in behind))
            time.sleep(0.2)

    def reap(self, uid: str, expected: int | None, timeout: float = GRACE + 30) -> str:
        proc = self.cluster.procs[uid]
        try:
            code = proc.wait(timeout)
        except Exception:
            raise Failure(f"hang: {uid} did not exit within {timeout:.0f} s after its signal:\n{self.cluster.log(uid)}") \
                from None
        if expected is not None and code != expected:
            raise Failure(f"{uid} exited with {code}, expected {expected}:\n{self.cluster.log(uid)}")
        return f"exit {code}"

    def check_agreement(self) -> int:
        outer = {u: t.events("outer_step") for u, t in self.tails.items()}
        split = split_runs(outer)           # first: two runs also differ in params_hash, their cause is the split
        if split:
            raise Failure(f"two runs at once: {split[:3]}")
        compared, bad = agreement_failures(outer)
        if bad:
            raise Failure(f"params_hash differs at {len(bad)} outer step(s): {bad[:3]}")
        membership = {u: t.events("membership") for u, t in self.tails.items()}
        wrong = false_evictions(membership, self.signalled)
        if wrong:
            raise Failure(f"false eviction of a running node: {wrong[:3]}")
        admitted = rogues_admitted(membership, self.rogues)
        if admitted:
            raise Failure(f"a node without the run secret in a world: {admitted[:3]}")
        return compared

    # -- events --------------------------------------------------------------------------------
    def wait_one_world(self, what: str, bound: float = HANG_BOUND, nodes: list[str] | None = None,
                       since: float | None = None) -> int:
        """Until every one of `nodes` (default: the live nodes) applied an outer step in one world of exactly
        them (a cut-off node back in the run, not training apart; or the others without a node gone silent),
        from `since` (unix time; default now) on; returns that mesh version."""
        nodes = self.live if nodes is None else nodes
        start, now = time.monotonic(), time.time() if since is None else since
        while True:
            version = one_world({u: self.tails[u].events("outer_step") for u in nodes}, nodes, now)
            if version is not None:
                return version
            for u in nodes:
                code = self.cluster.procs[u].poll()
                if code is not None:
                    raise Failure(f"{u} exited with {code} after {what}:\n{self.cluster.log(u)}")
            if time.monotonic() - start > bound:
                sizes = {u: [(e["mesh_version"], e["global_world_size"])
                             for e in self.tails[u].events("outer_step")][-3:] for u in nodes}
                raise Failure(f"hang: {nodes} not in one world of {len(nodes)} within {bound:.0f} s after "
                              f"{what} (last (mesh version, world size) per node: {sizes})")
            time.sleep(0.2)

    def choose(self) -> str:
        # donor-leave starts a joiner before a donor leaves, poison a joiner it kills later
        joins = ("join", "join-live", "donor-leave", "poison", "liar")
        allowed = [k for k in self.kinds if not (k in joins and len(self.live) >= self.max_nodes)
                   and not (k == "store-loss" and self.store_port == self.cluster.standby_ports[-1])
                   and not (k == "store-silent" and self.store_port != self.cluster.port)
                   and not (k in BLOCKING_KINDS and self.overlap != "none")]
        return self.rng.choice(allowed)

    def inject(self, kind: str) -> None:
        getattr(self, "ev_" + kind.replace("-", "_"))()
        self.log("agreement", "-", f"{self.check_agreement()} outer steps compared")

    def _kill(self, kind: str, uid: str, sig: int) -> None:
        others = self.outer_counts(u for u in self.live if u != uid)
        self.signal(uid, sig)
        self.remove(uid, 128 + sig if sig == signal.SIGTERM else -sig)
        outcome = self.reap(uid, self.gone[uid])
        took = self.wait_progress(others, f"{kind} of {uid}")    # before a replacement: the survivors alone
        replaced = self.replace()
        self.log(kind, uid, f"{outcome}; survivors stepped in {took:.1f} s" + replaced)

    def replace(self) -> str:
        if len(self.live) >= self.nodes:
            return ""
        live = self.rng.random() < 0.5
        uid = self.start(live_recovery=live)
        took = self.wait_progress({uid: 0}, f"the start of {uid}", HANG_BOUND + START_BOUND)
        return f"; replaced by {uid} ({'live recovery' if live else 'blocking'} join, stepping after {took:.1f} s)"

    def ev_sigkill(self) -> None:
        self._kill("sigkill", self.rng.choice(self.live), signal.SIGKILL)

    def ev_sigterm(self) -> None:
        self._kill("sigterm", self.rng.choice(self.live), signal.SIGTERM)

    def ev_sigstop(self) -> None:
        uid = self.rng.choice(self.live)
        pause = self.rng.uniform(HEARTBEAT_TIMEOUT + 1, HEARTBEAT_TIMEOUT + 5)
        self.signal(uid, signal.SIGSTOP)
        try:
            time.sleep(pause)
        finally:
            self.signal(uid, signal.SIGCONT)
        took = self.wait_progress(self.outer_counts(self.live), f"sigstop of {uid} for {pause:.1f} s")
        self.log("sigstop", uid, f"frozen {pause:.1f} s; all (thawed included) stepped in {took:.1f} s")

    def _join(self, kind: str, live: bool) -> None:
        before = self.outer_counts(self.live)
        uid = self.start(live_recovery=live)
        took = self.wait_progress({**before, uid: 0}, f"{kind} of {uid}", HANG_BOUND + START_BOUND)
        how = ""
        if live:
            got = self.tails[uid].events("recovery")
            how = f"; downloaded {got[0].get('bytes')} bytes" if got else "; fell back to the blocking transfer"
        self.log(kind, uid, f"stepping after {took:.1f} s{how}")

    def ev_join(self) -> None:
        self._join("join", False)

    def ev_join_live(self) -> None:
        self._join("join-live", True)

    def ev_kill_leader(self) -> None:
        uid, deadline = self.leader(), time.monotonic() + 60
        tail = self.tails[uid]
        while time.monotonic() < deadline:      # the last step ends an inner loop, its outer step not logged
            steps, outer = tail.events("step"), tail.events("outer_step")
            if steps and steps[-1]["step"] % INNER == 0 and (not outer or outer[-1]["step"] < steps[-1]["step"]):
                break
            time.sleep(0.01)
        when = "in outer step" if time.monotonic() < deadline else "not caught in an outer step"
        step = tail.events("step")[-1]["step"] if tail.events("step") else 0
        self._kill("kill-leader", uid, signal.SIGKILL)
        self.rows[-1] = (*self.rows[-1][:3], f"{when} at step {step}; {self.rows[-1][3]}")

    def ev_store_restart(self) -> None:
        before_version = self._newest_version()
        self.cluster.kill_store(self.store_port)
        down = self.rng.uniform(0.5, 4.0)
        time.sleep(down)
        self.cluster.start_store(self.store_port)
        took, formed = self._wait_reformed(before_version, "the store restart", HANG_BOUND + FAILOVER_S)
        moved = self._store_now()
        where = f"; the run moved on to :{moved}" if moved != self.store_port else ""
        self.store_port = moved
        self.log("store-restart", "store", f"down {down:.1f} s; stepped in {took:.1f} s, new mesh after {formed:.1f} s"
                 f"{where}")

    def _store_now(self) -> int:
        """The port of the store the run is on: where most live nodes' logs last moved to (a failover, following the
        run, or a minority mover going back, which has no store_failover event)."""
        moved = re.compile(r"(?:moving the run to the next store, |moved on from store \S+ to |going back from store "
                           r"\S+ to )\S+:(\d+) \(")
        ports = []
        for u in self.live:   # a node that never moved is on the first store of elastic.addr
            found = moved.findall((self.cluster.tmp / f"{u}.log").read_text())
            ports.append(int(found[-1]) if found else self.cluster.port)
        return max(sorted(set(ports)), key=ports.count) if ports else self.store_port

    def ev_store_loss(self) -> None:
        """The current store SIGKILLed and never started again: every node moves to the next store of the list
        (within elastic.store_failover_s and one outer step) and the run re-forms there."""
        before_version = self._newest_version()
        lost = self.store_port
        self.cluster.kill_store(lost)
        self.store_port = self.cluster.standby_ports[[self.cluster.port, *self.cluster.standby_ports].index(lost)]
        there = self.live[:]
        took, formed = self._wait_reformed(before_version, "the store loss", HANG_BOUND + FAILOVER_S)
        silent = [u for u in there if not any(e["to_store"].endswith(f":{self.store_port}")
                                             for e in self.tails[u].events("store_failover"))]
        if [u for u in silent if u in self.live]:
            raise Failure(f"{silent} re-formed without a store_failover event to port {self.store_port}")
        self.log("store-loss", "store", f"lost :{lost}, run on :{self.store_port}; stepped in {took:.1f} s, "
                 f"new mesh after {formed:.1f} s")

    def _newest_version(self) -> int:
        return max((e["mesh_version"] for u in self.live for e in self.tails[u].events("outer_step")), default=0)

    def _wait_reformed(self, before_version: int, what: str, bound: float) -> tuple[float, float]:
        """(seconds until every live node stepped again, until every one reached a mesh version above
        `before_version`): the run re-formed on a store that starts empty."""
        started = time.monotonic()
        took = self.wait_progress(self.outer_counts(self.live), what, bound)
        deadline = started + bound
        while not all(self._reseeded(u, before_version) for u in self.live):
            if time.monotonic() > deadline:
                raise Failure(f"hang: not all of {self.live} reached a mesh version above {before_version} "
                              f"within {bound:.0f} s of {what}")
            time.sleep(0.2)
        return took, time.monotonic() - started

    def _reseeded(self, uid: str, version: int) -> bool:
        return any(e["mesh_version"] > version for e in self.tails[uid].events("outer_step"))

    def ev_donor_leave(self) -> None:
        """A live-recovery joiner starts; the moment it is connected to a donor's sidecar (fetching the
        outer state), the donor is frozen, then SIGKILLed or SIGTERMed (the seed picks). The joiner
        must get the state from the other peers or fall back to the blocking transfer, and then agree
        with the survivors: never train on a partial state."""
        donor = self.rng.choice(self.live)
        sig = self.rng.choice([signal.SIGKILL, signal.SIGTERM])
        others = self.outer_counts(u for u in self.live if u != donor)
        joiner = self.start(live_recovery=True)
        caught = self._catch_fetch(joiner, donor, HANG_BOUND + START_BOUND)
        self.signal(donor, sig)
        if sig == signal.SIGTERM:
            self.signal(donor, signal.SIGCONT)      # a frozen process handles its SIGTERM once thawed
        self.remove(donor, 128 + sig if sig == signal.SIGTERM else -sig)
        outcome = self.reap(donor, self.gone[donor])
        took = self.wait_progress({**others, joiner: 0}, f"donor-leave ({signal.Signals(sig).name} of {donor} "
                                  f"{caught})", HANG_BOUND + START_BOUND)
        got = self.tails[joiner].events("recovery")
        how = (f"downloaded {got[0].get('bytes')} bytes from {got[0].get('peers')}" if got
               else "fell back to the blocking transfer")
        self._wait_joiner_agrees(joiner)
        replaced = self.replace()
        self.log("donor-leave", donor, f"{signal.Signals(sig).name} {caught}: {outcome}; joiner {joiner} {how}, "
                 f"stepping after {took:.1f} s, agrees with the survivors" + replaced)

    def _catch_fetch(self, joiner: str, donor: str, bound: float) -> str:
        """Freeze the donor just before the joiner asks its peers for the outer state (when the joiner logs
        its model, the last line before its live recovery), so the joiner's request to the donor hangs;
        confirm the joiner is connected to one of the donor's ports, then hold 0.5-2 s. Returns where the
        donor was caught. (The fetch of this model takes ~0.1 s: catching it by watching alone misses.)"""
        log, deadline = self.cluster.tmp / f"{joiner}.log", time.monotonic() + bound
        while " zb.train: model " not in (log.read_text() if log.exists() else ""):
            if self.cluster.procs[joiner].poll() is not None:
                raise Failure(f"{joiner} exited during its start:\n{self.cluster.log(joiner)}")
            if time.monotonic() > deadline:
                raise Failure(f"hang: {joiner} did not build its model within {bound:.0f} s")
            time.sleep(0.005)
        self.signal(donor, signal.SIGSTOP)
        dpid, jpid = self.cluster.procs[donor].pid, self.cluster.procs[joiner].pid
        caught, deadline = "", time.monotonic() + 5
        try:
            ports = {local for state, local, _ in tcp_sockets(dpid) if state == "0A"}
            while not caught and time.monotonic() < deadline:
                if self.tails[joiner].events("recovery"):
                    caught = "after the download (the joiner did not wait on the donor)"
                    break
                if any(state == "01" and remote in ports for state, _, remote in tcp_sockets(jpid)):
                    caught = "mid-fetch (the joiner waits on the frozen donor)"
                time.sleep(0.02)
        except OSError:                     # the joiner exited: wait_progress reports it
            pass
        time.sleep(self.rng.uniform(0.5, 2.0))
        return caught or "frozen, but the joiner never connected to it"

    def _wait_joiner_agrees(self, joiner: str, bound: float = HANG_BOUND) -> None:
        """Until one of the joiner's applied outer steps is also applied by a survivor, with equal hashes
        (agreement_failures raises on unequal ones)."""
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            self.check_agreement()
            mine = {(e["mesh_version"], e["outer_step"]) for e in self.tails[joiner].events("outer_step")
                    if e.get("applied")}
            theirs = {(e["mesh_version"], e["outer_step"]) for u in self.live if u != joiner
                      for e in self.tails[u].events("outer_step") if e.get("applied")}
            if mine & theirs:
                return
            time.sleep(0.2)
        raise Failure(f"hang: {joiner} applied no outer step together with a survivor within {bound:.0f} s")

    def ev_rogue_join(self) -> None:
        """Nodes without the run secret try to join. Two `zb train` nodes with the cluster's arguments, one
        holding no secret and one another secret, must each exit 2 within REFUSE_BOUND with the one-line
        refusal, having written nothing to the store (no heartbeat counter, no join request). Then a raw store
        client (no secret) appends a join request for a made-up node, bumps its heartbeat counter and sets its
        address: every node must ignore it (a node logs the join list as not opening). No world may ever name
        any of the three (check_agreement), and the survivors must keep stepping after the forgery."""
        i = len(self.rogues) // 3
        other = self.cluster.tmp / f"other-{i}.secret"
        other.unlink(missing_ok=True)
        write_new_secret(other)
        # Without a secret the sidecar's token (ckpt.live_recovery) is ZB_CKPT_TOKEN's: the node is given one, so
        # that what refuses it is the store's run marker, not its own missing token.
        refused = {f"rogue{i}-nosecret": ({SECRET_ENV: None, "ZB_CKPT_TOKEN": "rogue-token-0123456789abcdef"},
                                          "admits only nodes that hold its secret"),
                   f"rogue{i}-othersecret": ({SECRET_ENV: str(other)}, "started with another secret")}
        forged = f"rogue{i}-forged"
        self.rogues.update([*refused, forged])
        started = time.monotonic()
        for uid, (env, _) in refused.items():
            self._start_outsider(uid, env)
        took: dict[str, float] = {}
        while len(took) < len(refused):
            for uid in refused:
                if uid not in took and self.cluster.procs[uid].poll() is not None:
                    took[uid] = time.monotonic() - started
            if time.monotonic() - started > REFUSE_BOUND:
                raise Failure(f"hang: {sorted(set(refused) - set(took))} not refused within {REFUSE_BOUND:.0f} s:\n"
                              + "\n".join(f"--- {u}\n{self.cluster.log(u)}" for u in refused if u not in took))
            time.sleep(0.1)
        for uid, (_, phrase) in refused.items():
            code = self.cluster.procs[uid].poll()
            problem = f"exit {code}, expected 2" if code != 2 else \
                refusal_problem((self.cluster.tmp / f"{uid}.log").read_text(), phrase)
            if problem:
                raise Failure(f"{uid} was not refused with the one-line refusal ({problem}):\n{self.cluster.log(uid)}")
        before = self.outer_counts(self.live)
        left = self._forge(forged, list(refused))
        if left:
            raise Failure(f"nodes refused for their secret left records in the store: {left}")
        stepped = self.wait_progress(before, f"rogue-join ({', '.join(refused)} refused, {forged} forged)")
        seen = self._wait_logged("store record zb/joins does not open", HANG_BOUND)
        if not seen:
            raise Failure(f"no node logged the forged join request of {forged} as not opening within "
                          f"{HANG_BOUND:.0f} s (the join list unread?)")
        self.log("rogue-join", f"rogue{i}", f"no secret and another secret: exit 2 in "
                 f"{' and '.join(f'{t:.1f}' for t in took.values())} s, one line, nothing written; forged join of {forged} ignored ({seen} of "
                 f"{len(self.live)} logged it not opening); survivors stepped in {stepped:.1f} s")

    def _wait_logged(self, text: str, bound: float) -> int:
        """Until a live node's log holds `text` (each node logs a record that does not open once); returns how
        many do, 0 when none did within `bound`."""
        deadline = time.monotonic() + bound
        while True:
            seen = sum(text in (self.cluster.tmp / f"{u}.log").read_text() for u in self.live)
            if seen or time.monotonic() > deadline:
                return seen
            time.sleep(0.2)

    def _start_outsider(self, uid: str, env: dict[str, str | None]) -> None:
        """A `zb train` with the run's arguments but `env` changed (the secret), never one of the run's nodes.
        With --netns it runs on the current store's host: it only has to reach the store, and every node host may
        be busy."""
        args, rank = self.node_args(uid), len(self.live)
        if self.net is None:
            self.cluster.start_train(uid, *args, rank=rank, env=env)
        else:
            TrainCluster.start_train(self.cluster, uid, *args, rank=rank, env=env,
                                     prefix=tuple(self.cluster.store_host_at(self.store_port).command([])))

    def _forge(self, uid: str, refused: list[str]) -> list[str]:
        """forge_join on the run's current store: in this process, or with --netns from the store's host (this
        process's namespace has no route to the emulated hosts). Returns what the refused nodes left there."""
        if self.net is None:
            return forge_join("127.0.0.1", self.store_port, uid, refused)["left_by_refused"]
        host = self.cluster.store_host_at(self.store_port)
        done = host.run([sys.executable, str(Path(__file__).resolve().parent / "_chaos_checks.py"), "forge",
                         host.addr, str(self.store_port), uid, *refused], env=self.cluster.env, cwd=REPO)
        if done.returncode != 0:
            raise Failure(f"the raw store client failed on the store's host:\n{done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])["left_by_refused"]

    def ev_poison(self) -> None:
        """A joiner that sends its pseudo-gradient times 1000 or times -1 (the seed picks; through
        scripts/_hostile_node.py) contributes to POISON_ROUNDS outer steps, then is SIGKILLed. The nodes run
        with diloco.clip: the survivors must keep agreeing at every outer step (check_agreement), keep a finite
        loss, and, for x1000, every survivor's log must report the poisoner clipped."""
        factor = self.rng.choice(HOSTILE_FACTORS)
        survivors, since = list(self.live), time.time()
        uid = self.start(entry=(str(HOSTILE), str(factor)))
        self.log("poison", uid, f"joins, sending its pseudo-gradient x{factor:g}")
        bound, started = HANG_BOUND + START_BOUND + POISON_ROUNDS * 30, time.monotonic()
        while len(rounds := self._contributed(uid)) < POISON_ROUNDS:
            if self.cluster.procs[uid].poll() is not None:
                raise Failure(f"poisoner {uid} exited with {self.cluster.procs[uid].poll()}:\n{self.cluster.log(uid)}")
            if time.monotonic() - started > bound:
                raise Failure(f"hang: poisoner {uid} contributed to {len(rounds)} outer steps within {bound:.0f} s")
            time.sleep(0.2)
        outcome, took = self._end_hostile(uid, f"poisoner {uid} (x{factor:g})", since)
        line = f"diloco.clip: node {uid}"
        silent = [u for u in survivors if u in self.live and line not in (self.cluster.tmp / f"{u}.log").read_text()]
        if factor > 1 and silent:
            raise Failure(f"poisoner {uid} (x{factor:g}) contributed to {len(rounds)} outer steps, but {silent} "
                          f"never logged '{line}'")
        clipped = {(e["mesh_version"], e["outer_step"]) for u in self.live for e in self.tails[u].events("outer_step")
                   if uid in (e.get("clipped") or ())}
        loss = [e["loss"] for u in self.live for e in self.tails[u].events("step")[-1:]]
        self.log("poison", uid, f"x{factor:g}: contributed to {len(rounds)} outer steps, clipped in {len(clipped)}; "
                 f"{outcome}; survivors stepped in {took:.1f} s, loss finite (last {min(loss):.3f}-{max(loss):.3f})")

    def _end_hostile(self, uid: str, who: str, since: float) -> tuple[str, float]:
        """SIGKILL a hostile node; the survivors must step on with a finite loss since `since` (unix time).
        Returns its exit and the survivors' time to two more outer steps."""
        others = self.outer_counts(u for u in self.live if u != uid)
        self.signal(uid, signal.SIGKILL)
        self.remove(uid, -signal.SIGKILL)
        outcome = self.reap(uid, -signal.SIGKILL)
        took = self.wait_progress(others, f"the SIGKILL of {who}")
        bad = non_finite_losses({u: self.tails[u].events("step") for u in self.live}, since)
        if bad:
            raise Failure(f"non-finite loss after {who}: {bad[:3]}")
        return outcome, took

    def ev_liar(self) -> None:
        """A joiner that lies in its check-in (scripts/_hostile_node.py; the seed picks): 1000 outer steps ahead,
        30x its pseudo-gradient under its honest norm, or NaN under a small norm. It checks in at LIAR_ROUNDS
        outer steps, then is SIGKILLed. The survivors must apply every outer step meanwhile (the run moves: the
        liar is neither their donor nor does it make them skip), agree, keep a finite loss, and each log the
        liar's claim as not holding."""
        lie = self.rng.choice(LIES)
        survivors, since = list(self.live), time.time()
        uid = self.start(entry=(str(HOSTILE), lie))
        self.log("liar", uid, f"joins, lying: {lie}")
        bound, started = HANG_BOUND + START_BOUND + LIAR_ROUNDS * 30, time.monotonic()
        while len(self.tails[uid].events("outer_step")) < LIAR_ROUNDS + 1:   # its first one received the state
            if self.cluster.procs[uid].poll() is not None:
                raise Failure(f"liar {uid} exited with {self.cluster.procs[uid].poll()}:\n{self.cluster.log(uid)}")
            if time.monotonic() - started > bound:
                raise Failure(f"hang: liar {uid} checked in at {len(self.tails[uid].events('outer_step'))} outer "
                              f"steps within {bound:.0f} s")
            time.sleep(0.2)
        lied_since, killed_at = self.tails[uid].events("outer_step")[1]["time"], time.time()
        outcome, took = self._end_hostile(uid, f"liar {uid} ({lie})", since)
        # While it lied: the SIGKILL itself may land mid all-reduce, after which a node that lost its attempt while
        # others applied receives the state at the next outer step, as after any peer's death.
        skipped = [(u, e["outer_step"]) for u in survivors if u in self.live for e in self.tails[u].events("outer_step")
                   if lied_since <= e["time"] < killed_at and not e["applied"] and e["global_world_size"] > 1]
        if skipped:
            raise Failure(f"liar {uid} ({lie}) made survivors skip or take its state: {skipped[:4]}")
        line = LIAR_LINES[lie].format(uid=uid)
        silent = [u for u in survivors if u in self.live and line not in (self.cluster.tmp / f"{u}.log").read_text()]
        if silent:
            raise Failure(f"liar {uid} ({lie}) checked in at {LIAR_ROUNDS} outer steps, but {silent} never logged "
                          f"'{line}'")
        self.log("liar", uid, f"{lie}: outweighed at every outer step, survivors applied them all; {outcome}; "
                 f"survivors stepped in {took:.1f} s")

    def ev_store_tamper(self) -> None:
        """Issue 40's outsider at the store, without the run secret (a raw client; with --netns on the store's
        host): the run marker deleted, junk in the last two roll calls' counters, the next two bumped by 10**9,
        junk in a live node's heartbeat counter. Every node must stay alive and keep stepping in one run
        (check_agreement), and the marker must be back as it was."""
        victim = self.rng.choice(self.live)
        before = self.outer_counts(self.live)
        done = self._raw_store("tamper", victim)
        took = self.wait_progress(before, f"store-tamper (victim {victim})")
        marker = self._raw_store("marker")["marker"]
        if marker != done["marker"]:
            raise Failure(f"the run marker was not written back as it was after store-tamper: {done['marker'][:32]}... "
                          f"became {marker[:32] or 'nothing'}...")
        self.log("store-tamper", victim, f"marker deleted, counters of resolution {done['resolution']} +-2 junk and "
                 f"+10**9, {victim}'s heartbeat junk: marker back as it was, every node stepped in {took:.1f} s")

    def _raw_store(self, what: str, *args: str) -> dict:
        """A _chaos_checks.py store command against the run's current store: in this process, or with --netns
        from the store's host."""
        if self.net is None:
            from _chaos_checks import marker_now, tamper

            if what == "marker":
                return {"marker": marker_now("127.0.0.1", self.store_port)}
            return tamper("127.0.0.1", self.store_port, *args)
        host = self.cluster.store_host_at(self.store_port)
        done = host.run([sys.executable, str(Path(__file__).resolve().parent / "_chaos_checks.py"), what,
                         host.addr, str(self.store_port), *args], env=self.cluster.env, cwd=REPO)
        if done.returncode != 0:
            raise Failure(f"the raw store client failed on the store's host:\n{done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def ev_flood(self) -> None:
        """FLOOD_CONNECTIONS connect-and-reset loops against every port a live node listens on, from a host that is
        not a member (loopback: 127.0.0.2; --netns: the store's host). The node must stay alive and keep stepping,
        its descriptor count grow by at most FLOOD_DESCRIPTORS, and the run stay one (elastic.peer_filter)."""
        from _chaos_checks import flood, tcp_sockets

        uid = self.rng.choice(self.live)
        pid = self.cluster.procs[uid].pid
        node = psutil.Process(pid)
        ports = sorted({port for state, port, _ in tcp_sockets(pid) if state == "0A"})   # listening
        held = node.num_fds()
        before = self.outer_counts(self.live)
        if self.net is None:
            done = flood("127.0.0.1", ports, FLOOD_CONNECTIONS, source="127.0.0.2")
        else:
            host = self.cluster.store_host_at(self.store_port)
            run = host.run([sys.executable, str(Path(__file__).resolve().parent / "_chaos_checks.py"), "flood",
                            self.cluster.host_of[uid].addr, str(FLOOD_CONNECTIONS), *map(str, ports)],
                           env=self.cluster.env, cwd=REPO)
            if run.returncode != 0:
                raise Failure(f"the flood failed on the store's host:\n{run.stderr[-2000:]}")
            done = json.loads(run.stdout.strip().splitlines()[-1])
        if self.cluster.procs[uid].poll() is not None:
            raise Failure(f"{uid} exited with {self.cluster.procs[uid].poll()} under a connection flood:\n"
                          f"{self.cluster.log(uid)}")
        grown = node.num_fds() - held
        if grown > FLOOD_DESCRIPTORS:
            raise Failure(f"a connection flood from a non-member left {grown} more descriptors open in {uid} "
                          f"(ports {ports})")
        took = self.wait_progress(before, f"a connection flood against {uid}")
        self.log("flood", uid, f"{FLOOD_CONNECTIONS} junk connects to each of ports {ports} in {done['seconds']} s: "
                 f"{grown:+d} descriptors; every node stepped in {took:.1f} s")

    def _contributed(self, uid: str) -> list[tuple[int, int]]:
        """(mesh version, outer step) of the outer steps `uid` applied together with another node: steps it
        contributed its pseudo-gradient to (a joiner that received the state applied nothing at that step)."""
        return [(e["mesh_version"], e["outer_step"]) for e in self.tails[uid].events("outer_step")
                if e.get("applied") and e.get("num_peers", 0) >= 2]

    def ev_link_down(self) -> None:
        """A node's link (its veth port on the bridge) down for a while, then up: cut off from the store
        and from every peer. Short cuts (below the heartbeat timeout) may pass unnoticed; past it the node
        is evicted and must come back by rejoining with the run's state, never training apart."""
        uid = self.rng.choice(self.live)
        short = self.rng.random() < 0.5
        down = self.rng.uniform(1.0, HEARTBEAT_TIMEOUT - 1) if short else \
            self.rng.uniform(HEARTBEAT_TIMEOUT + 1, HEARTBEAT_TIMEOUT + 8)
        counts, since = self.outer_counts(self.live), time.time()
        self.signalled.add(uid)                 # it may rightly be declared dead
        host = self.cluster.host_of[uid]
        host.set_link(up=False)
        try:
            time.sleep(down)
        finally:
            host.set_link(up=True)
        self._after_network_event(f"link-down of {uid} for {down:.1f} s", counts, "link-down", uid,
                                  f"down {down:.1f} s", since, sides=[[uid], [u for u in self.live if u != uid]])

    def ev_partition(self) -> None:
        """Two nodes stop hearing each other (every packet between their hosts dropped, both ways) while
        both still reach the store and the others; then it heals. The run may drop one of them or retry
        its outer steps, but must stay one run and take both back after the heal."""
        from _chaos_netns import set_partition

        a, b = self.rng.sample(self.live, 2)
        long = self.rng.random() < 0.5
        # Long cuts outlast PARTITION_BOUND but not the store timeout: past it the node dropped gives up
        # rejoining and exits 1 ("cannot reach peer ..."), which is the documented end of a lasting cut.
        cut = self.rng.uniform(PARTITION_BOUND + 2, STORE_TIMEOUT - 4) if long else self.rng.uniform(2.0, 8.0)
        counts, since = self.outer_counts(self.live), time.time()
        self.signalled.update((a, b))
        ha, hb = self.cluster.host_of[a], self.cluster.host_of[b]
        set_partition(ha, hb, True)
        try:
            time.sleep(cut)
            during = self._synced_during(since + PARTITION_BOUND, len(self.live) - 1)
        finally:
            set_partition(ha, hb, False)
        if long and not during:
            raise Failure(f"stalled: partition {a}|{b} for {cut:.1f} s and no outer step applied by "
                          f"{len(self.live) - 1} nodes after its first {PARTITION_BOUND:.0f} s "
                          f"(a node that cannot reach a peer must be dropped, not retried forever)")
        self._after_network_event(f"partition {a}|{b} for {cut:.1f} s", counts, "partition", f"{a}|{b}",
                                  f"cut {cut:.1f} s" + (f", {during} outer steps applied during it" if long else ""),
                                  since, sides=[[a], [b]])

    def ev_store_cut(self) -> None:
        """Some nodes (one to all but one) stop hearing the store: every packet between their hosts and the
        current store's host dropped, no reset, while they still reach each other; then it heals. The side that
        keeps the store goes on; the cut nodes must not train apart (issue 39: without the store only the whole world
        trains on) and come back as one run with the others. Long cuts outlast the heartbeat timeout, so the
        store's side drops them and they return as joiners; none outlasts the store timeout."""
        from _chaos_netns import set_partition

        cut = self.rng.sample(self.live, self.rng.randint(1, len(self.live) - 1))
        long = self.rng.random() < 0.5
        held = self.rng.uniform(HEARTBEAT_TIMEOUT + 2, STORE_TIMEOUT - 4) if long else self.rng.uniform(2.0, 8.0)
        counts, since = self.outer_counts(self.live), time.time()
        self.signalled.update(cut)               # they may rightly be declared dead
        hosts, store = [self.cluster.host_of[u] for u in cut], self.cluster.store_host_at(self.store_port)
        for host in hosts:
            set_partition(host, store, True)
        try:
            time.sleep(held)
        finally:
            for host in hosts:
                set_partition(host, store, False)
        self._after_network_event(f"store-cut of {sorted(cut)} for {held:.1f} s", counts, "store-cut",
                                  "|".join(sorted(cut)), f"cut {held:.1f} s", since,
                                  sides=[sorted(cut), sorted(set(self.live) - set(cut))])

    def ev_host_silent(self) -> None:
        """A node's host drops every packet, to and from everyone (store and peers), with no reset: a reclaimed
        spot instance, a closed laptop lid. Short (below the heartbeat timeout), then it speaks again and must be
        back in one world with the others; or for good: the others must drop it and form a world of their own
        within the run's deadlines, and the harness then takes the node for dead (SIGKILL, its host's rules
        lifted as for a new machine at that address, a replacement joins). The row gives the others' longest
        gap without an applied outer step."""
        from _chaos_netns import set_silent

        uid = self.rng.choice(self.live)
        for_good = self.rng.random() < 0.5
        held = self.rng.uniform(1.0, HEARTBEAT_TIMEOUT - 1)
        others = [u for u in self.live if u != uid]
        counts, since = self.outer_counts(self.live), time.time()
        self.signalled.add(uid)                 # it may rightly be declared dead
        host = self.cluster.host_of[uid]
        set_silent(host, True)
        if not for_good:
            try:
                time.sleep(held)
            finally:
                set_silent(host, False)
            self._after_network_event(f"host-silent of {uid} for {held:.1f} s", counts, "host-silent", uid,
                                      f"silent {held:.1f} s", since, sides=[[uid], others], gap_of=others)
            return
        try:
            what = f"host-silent of {uid} for good"
            version = self.wait_one_world(what, SILENT_BOUND, nodes=others, since=since)
            dropped = time.time() - since
            self.wait_progress({u: counts[u] for u in others}, what)
            apart = self._apart([[uid], others], since, what)
            gap = self._gap(others, since)
            if self.cluster.procs[uid].poll() is None:
                self.signal(uid, signal.SIGKILL)
            self.remove(uid, None)
            outcome = self.reap(uid, None)
        finally:
            set_silent(host, False)
        replaced = self.replace()
        self.log("host-silent", uid, f"for good: the others formed a world of {len(others)} without it at mesh "
                 f"v{version} {dropped:.1f} s after the silence, their longest gap without an applied outer step "
                 f"{gap:.1f} s; {apart}; taken for dead: {outcome}" + replaced)

    def ev_group_partition(self) -> None:
        """The live nodes split into two groups (sizes drawn, each at least one node) that drop every packet
        between them, no reset, while both still reach the store; short (2-8 s) or long (past PARTITION_BOUND,
        below the store timeout, as partition's long cuts). At most one side may apply outer steps in a world
        of its own while they are cut (two would be two runs); after the heal all are one world again."""
        from _chaos_netns import set_partition

        nodes = self.rng.sample(self.live, len(self.live))
        k = self.rng.randint(1, len(nodes) - 1)
        sides = [sorted(nodes[:k]), sorted(nodes[k:])]
        long = self.rng.random() < 0.5
        held = self.rng.uniform(PARTITION_BOUND + 2, STORE_TIMEOUT - 4) if long else self.rng.uniform(2.0, 8.0)
        counts, since = self.outer_counts(self.live), time.time()
        self.signalled.update(self.live)         # either side may rightly be dropped
        near, far = [self.cluster.host_of[u] for u in sides[0]], [self.cluster.host_of[u] for u in sides[1]]
        try:
            for host in near:
                set_partition(host, far, True)
            time.sleep(held)
        finally:
            for host in near:
                set_partition(host, far, False)
        name = f"{','.join(sides[0])}|{','.join(sides[1])}"
        self._after_network_event(f"group-partition {name} for {held:.1f} s", counts, "group-partition",
                                  name, f"{'long' if long else 'short'} cut {held:.1f} s",
                                  since, sides=sides)

    def ev_store_silent(self) -> None:
        """The current store's host drops every packet for good, no reset (only with the standby store in every
        node's elastic.addr, on a host of its own): every node must notice the silence within
        elastic.store_failover_s, move to the standby and re-form the run there. The row gives the time from
        the silence to the first outer step applied on the standby. The host stays silent until the run ends."""
        from _chaos_netns import set_silent

        before_version, lost = self._newest_version(), self.store_port
        host, since = self.cluster.store_host_at(lost), time.time()
        set_silent(host, True)
        self.silent_hosts.append(host)
        self.store_port = self.cluster.standby_ports[0]
        there = self.live[:]
        took, formed = self._wait_reformed(before_version, "the store's host going silent", HANG_BOUND + FAILOVER_S)
        to = f":{self.store_port}"
        moves = {u: [e for e in self.tails[u].events("store_failover") if e["to_store"].endswith(to)]
                 for u in there if u in self.live}
        silent = [u for u, m in moves.items() if not m]
        if silent:
            raise Failure(f"{silent} re-formed without a store_failover event to port {self.store_port}")
        first = min((e["time"] for u, m in moves.items() for e in self.tails[u].events("outer_step")
                     if e.get("applied") and e["mesh_version"] >= m[0]["mesh_version"] and e["time"] >= since),
                    default=None)
        if first is None:
            raise Failure(f"no outer step applied on the standby :{self.store_port} after the silence of :{lost}")
        waited = sorted(m[0]["silent_s"] for m in moves.values())
        self.log("store-silent", "store", f"host of :{lost} silent for good, run on :{self.store_port}: nodes moved "
                 f"after {waited[0]:.1f}-{waited[-1]:.1f} s of silence, first outer step on the standby "
                 f"{first - since:.1f} s after it; every node stepped in {took:.1f} s, new mesh after {formed:.1f} s")

    def _synced_during(self, after: float, size: int) -> int:
        """Outer steps applied since `after` (unix time) in a world of at least `size` nodes."""
        return len({(e["mesh_version"], e["outer_step"]) for u in self.live for e in self.tails[u].events("outer_step")
                    if e.get("applied") and e["time"] >= after and e["global_world_size"] >= size})

    def _after_network_event(self, what: str, counts: dict[str, int], kind: str, node: str, detail: str,
                             since: float, sides: list[list[str]], gap_of: list[str] | None = None) -> None:
        """After the heal: the whole run in one world again, everyone stepping, and the two `sides` of the cut
        never applying outer steps in worlds of their own at the same time. `gap_of`: nodes whose longest time
        without an applied outer step (since the event began) the row gives."""
        healed = time.monotonic()
        version = self.wait_one_world(what)
        took = time.monotonic() - healed
        self.wait_progress(counts, what)
        apart = self._apart(sides, since, what)
        evicted = sorted({d for u in self.live for e in self.tails[u].events("membership") for d in e.get("died", [])
                          if d in node.replace(",", "|").split("|") and e["time"] >= since})
        gap = f"; the others' longest gap without an applied outer step {self._gap(gap_of, since):.1f} s" \
            if gap_of else ""
        moved, self.store_port = self.store_port, self._store_now()   # a cut past elastic.store_failover_s moves it
        where = f"; the run moved on to the store at :{self.store_port}" if moved != self.store_port else ""
        self.log(kind, node, f"{detail}{gap}; {apart}; one world of all {len(self.live)} at mesh v{version} "
                 f"{took:.1f} s after the heal" + (f" (evicted and rejoined: {evicted})" if evicted else "") + where)

    def _apart(self, sides: list[list[str]], since: float, what: str) -> str:
        """Raises Failure when the sides of a cut applied outer steps in worlds of their own at the same time (two
        runs); else says which side applied outer steps in a world of its own since `since`."""
        outer = {u: self.tails[u].events("outer_step") for side in sides for u in side}
        split, own = split_sides(outer, sides, since, time.time())
        if split:
            raise Failure(f"two runs at once during {what}: {split[:3]}")
        went_on = [f"{','.join(side)} {n}" for side, n in zip(sides, own) if n]
        return f"outer steps in worlds without the other side: {'; '.join(went_on) if went_on else 'none'}"

    def _gap(self, uids: list[str], since: float) -> float:
        """The longest any of `uids` went without applying an outer step, from its last one before `since` (unix
        time) to now."""
        worst, now = 0.0, time.time()
        for u in uids:
            times = sorted(e["time"] for e in self.tails[u].events("outer_step") if e.get("applied"))
            before = [t for t in times if t <= since]
            prev = before[-1] if before else since
            for t in [t for t in times if t > since] + [now]:
                worst, prev = max(worst, t - prev), t
        return worst

    # -- the end -------------------------------------------------------------------------------
    def finish(self) -> None:
        for uid in self.live:
            os.killpg(self.cluster.procs[uid].pid, signal.SIGTERM)
        for uid in list(self.live):
            self.log("stop", uid, self.reap(uid, 128 + signal.SIGTERM))
        self.log("agreement", "-", f"{self.check_agreement()} outer steps compared")
        survivors = list(self.live)
        self.live.clear()
        self.cluster.close()
        left = orphans()
        if left:
            raise Failure(f"orphan processes after the run: {left}")
        self.log("orphans", "-", "none")
        if self.net is not None:
            from _chaos_netns import partitioned, set_silent

            for host in self.silent_hosts:       # silent for good (store-silent) until the run ended
                set_silent(host, False)
            left = [h.name for h in self.net.hosts if partitioned(h)]
            if left:
                raise Failure(f"partition rules left behind in {left}")
            self.log("network", "-", "no partition rule left; namespaces go with the run")
        self.log("resume", *resume_check(self.cluster.tmp, survivors, extra=self.settings))


def run(seed: int, events: int, nodes: int, max_nodes: int, tmp: Path, overlap: str = "none",
        netns: bool = False, kinds: list[str] | None = None, compression: str = "none") -> dict:
    if not netns:
        return _run(seed, events, nodes, max_nodes, tmp, overlap, None, kinds, compression)
    from zb.net.netns import emulated_hosts

    # the store's host, the standby store's when the kinds need one, and one per node at most
    with emulated_hosts(max_nodes + 1 + needs_standby(kinds)) as net:
        return _run(seed, events, nodes, max_nodes, tmp, overlap, net, kinds, compression)


def _run(seed: int, events: int, nodes: int, max_nodes: int, tmp: Path, overlap: str, net, kinds,
         compression: str) -> dict:
    chaos = Chaos(tmp, seed, nodes, max_nodes, overlap, net, kinds, compression)
    failures, survived = [], 0
    try:
        for _ in range(nodes):
            chaos.start()
        chaos.wait_progress({u: 0 for u in chaos.live}, "the start", HANG_BOUND + START_BOUND)
        chaos.log("start", ",".join(chaos.live), "all stepping")
        for _ in range(events):
            kind = chaos.choose()
            chaos.inject(kind)
            survived += 1
        chaos.finish()
    except Failure as e:
        failures.append(str(e))
        chaos.log("FAILED", "-", str(e).splitlines()[0])
    finally:
        chaos.cluster.close()
        left = orphans()
        if left and not failures:
            failures.append(f"orphan processes: {left}")
    print_table(chaos.rows)
    return {"seed": seed, "events": events, "survived": survived, "failures": failures}


def print_table(rows) -> None:
    print(f"{'time':>7}  {'event':15s} {'node':10s} outcome")
    for t, event, node, outcome in rows:
        print(f"{t:6.1f}s  {event:15s} {node:10s} {outcome}")


def main(argv: list[str] | None = None) -> int:
    # SIGTERM (a CI timeout, a pkill) must still run the cleanup that kills the nodes: without this the
    # interpreter dies at once and leaves them training, loading the machine for every later job.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--seed", type=int, default=None, help="schedule seed (random if unset; printed)")
    p.add_argument("--events", type=int, default=6)
    p.add_argument("--nodes", type=int, default=4, choices=range(2, 7))
    p.add_argument("--max-nodes", type=int, default=None,
                   help="joins stop at this many nodes (default nodes+1, at most 6)")
    p.add_argument("--keep", type=Path, default=None, help="keep node logs and metrics in this directory")
    p.add_argument("--overlap", default="none", choices=("none", "eager", "streaming"),
                   help=f"diloco.overlap of every node (streaming: 1 fragment, tau 1; none: with diloco.clip {CLIP})")
    p.add_argument("--compression", default="none", choices=COMPRESSIONS,
                   help="diloco.compression of every node (int4 and int2 with error feedback, their default)")
    p.add_argument("--netns", action="store_true",
                   help="every node on an emulated host of its own (network namespaces; root and nft), the store "
                        f"on another (and a standby store on a third when {', '.join(STANDBY_KINDS)} may be drawn); "
                        f"adds the {', '.join(NETNS_KINDS)} events")
    p.add_argument("--kinds", default=None, metavar="K1,K2",
                   help=f"draw events only from these, comma-separated (default: all; {', '.join(NETNS_KINDS)} with "
                        f"--netns only, {', '.join(LOOPBACK_KINDS)} without it, {', '.join(BLOCKING_KINDS)} with "
                        f"--overlap none only); of {', '.join(KINDS + NETNS_KINDS)}")
    args = p.parse_args(argv)
    kinds = args.kinds.split(",") if args.kinds else None
    unknown = sorted(set(kinds or ()) - set(KINDS + NETNS_KINDS))
    if unknown:
        p.error(f"--kinds: unknown event(s) {', '.join(unknown)}; known: {', '.join(KINDS + NETNS_KINDS)}")
    if not args.netns and set(kinds or ()) & set(NETNS_KINDS):
        p.error(f"--kinds: {', '.join(NETNS_KINDS)} need --netns (hosts with links to cut)")
    if args.overlap != "none" and set(kinds or ()) & set(BLOCKING_KINDS):
        p.error(f"--kinds: {', '.join(BLOCKING_KINDS)} needs --overlap none (diloco.clip, which zb refuses with an "
                f"overlapped all-reduce)")
    if kinds and set(kinds) <= set(STANDBY_KINDS) and args.events > 1:
        p.error(f"--kinds: {', '.join(STANDBY_KINDS)} can happen once a run (one standby store); pass --events 1 or "
                f"more kinds")
    if args.netns and set(kinds or ()) & set(LOOPBACK_KINDS):
        p.error(f"--kinds: {', '.join(LOOPBACK_KINDS)} cannot run with --netns (one store there)")
    if args.netns:
        from _chaos_netns import unavailable

        reason = unavailable()
        if reason:
            print(f"chaos: --netns cannot run here: {reason}", file=sys.stderr)
            return 2
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    max_nodes = min(6, args.max_nodes or args.nodes + 1)
    print(f"chaos: seed {seed}, {args.events} events, {args.nodes} nodes (up to {max_nodes})", file=sys.stderr,
          flush=True)
    tmp = args.keep or Path(tempfile.mkdtemp(prefix=f"zb-chaos-{seed}-"))
    tmp.mkdir(parents=True, exist_ok=True)
    summary = run(seed, args.events, args.nodes, max_nodes, tmp, args.overlap, args.netns, kinds, args.compression)
    for failure in summary["failures"]:
        print(failure, file=sys.stderr)          # with the nodes' log tails; the JSON line keeps the first line
    print(json.dumps({**summary, "failures": [f.splitlines()[0] for f in summary["failures"]]}))
    if summary["failures"]:
        print(f"chaos: FAILED with seed {seed} (replay: scripts/chaos.py --seed {seed} --events {args.events} "
              f"--nodes {args.nodes} --overlap {args.overlap} --compression {args.compression}"
              f"{' --netns' if args.netns else ''}"
              f"{' --kinds ' + args.kinds if args.kinds else ''}); logs kept in {tmp}", file=sys.stderr)
        return 1
    if args.keep is None:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
