"""The swarm's keys in the global store: who serves which stage, where, from which step; who left.

Each stage's DiLoCo run lives in its own namespace (`<elastic.namespace>swarm/s<j>/`, see
zb.store_clients.run_client), so the elastic machinery needs no change; these keys sit beside them:

    swarm/workers/<j>   append-only, one line per registration: "<uid> <host:port> <first step> <token>"
    swarm/left          append-only, "<uid> <token> <steps done>" per line: left on purpose (routing drops it
                        at once; a later stage counts the steps it finished as finished by it)
    swarm/started       append-only, "<stage> <uid> <token>" per worker process, at its start
    swarm/arrivals      counter: the n-th worker to pick a stage (breaks ties between simultaneous starts)
    swarm/speed/<uid>   this worker's measured micro-batches per second (the stage choice reads them)
    swarm/resume/...    the whole-run agreement on the checkpoint step to resume (zb.swarm.checkpoints)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from zb.elastic import keys as elastic_keys
from zb.elastic.tcpstore import read_lines, read_many, store_errors
from zb.errors import EnvironmentFailure

log = logging.getLogger("zb.swarm")

ROOT = "swarm"


def stage_namespace(base: str, stage: int) -> str:
    """elastic.namespace of stage `stage`'s DiLoCo run, under the user's own namespace (if any)."""
    return f"{base.rstrip('/') + '/' if base else ''}{ROOT}/s{stage}"


def workers_key(stage: int) -> str:
    return f"{ROOT}/workers/{stage}"


LEFT = f"{ROOT}/left"
STARTED = f"{ROOT}/started"
ARRIVALS = f"{ROOT}/arrivals"


def speed_key(uid: str) -> str:
    return f"{ROOT}/speed/{uid}"



@dataclass(frozen=True)
class Worker:
    uid: str
    address: str   # host:port ("-" for first-stage workers: nobody sends them work)
    first_step: int
    token: str     # this registration's; a restart under the same uid registers a new one


def register(store, stage: int, worker: Worker) -> None:
    store.append(workers_key(stage), f"{worker.uid} {worker.address} {worker.first_step} {worker.token}\n")


def leave(store, worker: Worker, steps_done: int) -> None:
    store.append(LEFT, f"{worker.uid} {worker.token} {steps_done}\n")


def left_after(store) -> dict[str, int]:
    """uid -> steps it had finished when it left (the latest leave of each uid)."""
    out = {}
    for line in read_lines(store, LEFT):
        uid, _, steps = line.split()
        out[uid] = int(steps)
    return out


def registrations(store, stage: int) -> list[str]:
    """Every registration line of the stage, in order (left or not)."""
    return read_lines(store, workers_key(stage))


def workers(store, stage: int) -> dict[str, Worker]:
    """The stage's registered workers that have not left (the newest registration of a uid counts), without the
    registrations of a process whose uid started again since (it died; the new one registers once it is ready)."""
    gone = {" ".join(line.split()[:2]) for line in read_lines(store, LEFT)}
    out: dict[str, Worker] = {}
    for line in registrations(store, stage):
        uid, address, first, token = line.split()
        out[uid] = Worker(uid, address, int(first), token)
    started = started_tokens(store, stage)
    return {uid: w for uid, w in out.items() if f"{uid} {w.token}" not in gone and started.get(uid, w.token) == w.token}


def publish_stages(store, stages: int) -> None:
    store.compare_set(f"{ROOT}/stages", "", str(stages))


def publish_speed(store, uid: str, per_s: float) -> None:
    store.set(speed_key(uid), f"{per_s:.6g}")


def choose_stage(store, stages: int) -> int:
    """The stage with the least measured throughput (a worker without a measurement counts as the
    stage's mean, or 1); ties go round by arrival, so workers starting together spread out."""
    arrival = store.add(ARRIVALS, 1) - 1
    scores = []
    for j in range(stages):
        ws = list(workers(store, j))
        speeds = [float(v) for v in read_many(store, [speed_key(u) for u in ws]) if v] if ws else []
        mean = sum(speeds) / len(speeds) if speeds else 1.0
        scores.append(sum(speeds) + mean * (len(ws) - len(speeds)))
    low = min(scores)
    tied = [j for j, s in enumerate(scores) if s <= low * 1.0001]
    return tied[arrival % len(tied)]


def announce_start(store, stage: int, uid: str, token: str) -> None:
    """A worker process starts (before it joins its stage's run or resumes): a registration of the same uid under
    another token is then an earlier incarnation's, whatever heartbeat counter the uid still moves."""
    store.append(STARTED, f"{stage} {uid} {token}\n")


def started_tokens(store, stage: int) -> dict[str, str]:
    """uid -> the token of the latest process of that uid started on `stage`."""
    out = {}
    for line in read_lines(store, STARTED):
        j, uid, token = line.split()
        if int(j) == stage:
            out[uid] = token
    return out


def heartbeat_keys(stage: int, uids: list[str]) -> list[str]:
    """The heartbeat counters the stage's DiLoCo mesh bumps for `uids`, relative to the swarm's namespace."""
    prefix = stage_namespace("", stage)
    return [f"{prefix}/{elastic_keys.heartbeat(u)}" for u in uids]


def first_stage_training(link: StoreLink, window: float, poll_s: float = 0.2) -> bool:
    """Whether first-stage workers are training now: a registered one (see workers(): not one whose uid started
    again since, as in a whole run restarting under the same ids, whose new process bumps the same counter)
    moves its stage heartbeat within `window` seconds. False at once when there is none; registrations of a run
    that died under other ids hold this for the whole window."""
    uids = list(link.run(lambda store: workers(store, 0), fallback=None) or {})
    if not uids:
        return False
    keys = heartbeat_keys(0, uids)
    first = link.run(lambda store: read_many(store, keys))
    deadline = time.monotonic() + window
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        now = link.run(lambda store: read_many(store, keys))
        if first is not None and now is not None and now != first:
            return True
    return False


class StoreLink:
    """The swarm's client of the store, kept through an outage (a restarted store, a lost link): a call that
    fails returns the caller's fallback (what it knew before) and the next call reconnects. Training goes on
    meanwhile; only membership changes wait for the store."""

    def __init__(self, connect):
        self._connect, self.client, self._down = connect, None, False

    def run(self, fn, fallback=None):
        try:
            if self.client is None:
                self.client = self._connect()
            out = fn(self.client)
        except (*store_errors(), EnvironmentFailure) as e:
            self.client = None
            if not self._down:
                log.warning("store unreachable (%s): the swarm goes on with the workers it knew; retrying",
                            str(e).splitlines()[0])
            self._down = True
            return fallback
        if self._down:
            log.info("store reachable again")
        self._down = False
        return out


class Liveness:
    """Heartbeats of workers as their stage's elastic mesh writes them, judged on this observer's clock."""

    def __init__(self, link: StoreLink, timeout: float):
        # The link's store is already under elastic.namespace (if any): stage namespaces are relative to it here.
        self.link, self.timeout = link, timeout
        self._seen: dict[str, tuple[bytes, float]] = {}

    def alive(self, stage: int, uids: list[str]) -> set[str]:
        """Workers whose heartbeat moved within the timeout; with the store down, every worker last seen alive
        (no verdict without evidence)."""
        keys = heartbeat_keys(stage, uids)
        values = self.link.run(lambda store: read_many(store, keys))
        if values is None:
            return {u for u in uids if u in self._seen}
        now, out = time.monotonic(), set()
        for uid, value in zip(uids, values):
            last = self._seen.get(uid)
            if last is None or last[0] != value:
                self._seen[uid] = (value, now)
                out.add(uid)
            elif now - last[1] <= self.timeout:
                out.add(uid)
        return out
