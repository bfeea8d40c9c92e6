"""The first stage's side of the pipeline: send a micro-batch through the other stages and back.

A first-stage worker owns its micro-batches (SWARM's "trainer"): it keeps each hop's inputs until the
micro-batch's backward is done, so when a worker of a later stage dies or stalls past the hop's
deadline the same request goes to another worker of that stage (routing: zb.swarm.router) and
nothing is lost. Connections to each worker are pooled and reused.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable

import torch

from zb.errors import EnvironmentFailure
from zb.swarm import registry, wire
from zb.swarm.router import NoWorker, Router

log = logging.getLogger("zb.swarm")

BACKOFF_S = (0.002, 0.1)   # first and longest wait before asking a not-ready worker again


class Hops:
    """Requests to the workers of stages 1..S-1, each routed, deadline-bound and re-issued on failure."""

    def __init__(self, link: registry.StoreLink, stages: int, hop_timeout: float, stage_wait: float,
                 heartbeat_timeout: float, refresh_s: float = 2.0, run_over: Callable[[], None] = lambda: None):
        self.link, self.stages = link, stages
        # Raises when this worker's stage run ended without it: asked when a stage has no worker (a late worker of a
        # finished run finds every later stage gone), so it stops with that line, not after swarm.stage_wait.
        self.run_over = run_over
        # A worker that died without leaving stays registered: its stage's heartbeat tells (no notice, no routing).
        self.liveness = registry.Liveness(link, heartbeat_timeout)
        self.hop_timeout, self.stage_wait, self.refresh_s = hop_timeout, stage_wait, refresh_s
        self.routers = {j: Router(ban_s=max(5.0, 2 * hop_timeout)) for j in range(1, stages)}
        self.addresses: dict[str, str] = {}
        self.tokens: dict[str, str] = {}   # each worker's registration token: a new one is a restarted process
        self._pool: dict[str, list[socket.socket]] = defaultdict(list)
        self._lock = threading.Lock()
        self._refreshed = 0.0
        self.reissued = 0
        self.not_ready = 0
        self.bytes_out = self.bytes_in = 0
        self.done: Counter[str] = Counter()   # completed hops per worker
        self.registered: set[str] = set()

    # -- membership ---------------------------------------------------------------------------------
    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._refreshed < self.refresh_s:
            return
        with self._lock:
            if not force and now - self._refreshed < self.refresh_s:
                return
            stages = self.link.run(lambda store: {j: registry.workers(store, j) for j in self.routers})
            if stages is None:   # the store is down: route to the workers known so far
                return
            registered = set()
            for j, router in self.routers.items():
                alive = self.liveness.alive(j, list(stages[j]))
                ws = {uid: w for uid, w in stages[j].items() if uid in alive}
                registered |= set(ws)
                for uid, w in ws.items():
                    if self.tokens.get(uid, w.token) != w.token:
                        # Restarted: its ban, measurements and pooled connections were the dead process's.
                        router.renew(uid)
                        for sock in self._pool.pop(uid, []):
                            sock.close()
                    self.tokens[uid] = w.token
                    self.addresses[uid] = w.address
                router.set_workers(list(ws))
            self.registered = registered
            self._refreshed = now

    def workers(self) -> list[str]:
        """Every worker of stages 1.. currently routed to (the step notice goes to each)."""
        return sorted({u for r in self.routers.values() for u in r.live()})

    # -- one request ----------------------------------------------------------------------------------
    def call(self, stage: int, msg: wire.Message) -> wire.Message:
        """`msg` answered by some worker of `stage`; re-issued to another on failure or stall."""
        router, size = self.routers[stage], max(1.0, msg.nbytes / 1e6)
        avoid: set[str] = set()
        waited_since, backoff = None, BACKOFF_S[0]
        while True:
            self.refresh()
            try:
                uid = router.choose(size, avoid)
            except NoWorker:
                if waited_since is None:
                    self.run_over()
                waited_since = waited_since or time.monotonic()
                if time.monotonic() - waited_since > self.stage_wait:
                    self.run_over()
                    raise EnvironmentFailure(f"stage {stage} has had no live worker for {self.stage_wait:g} s; start "
                                             f"one (zb train ... --swarm.stage {stage}) or raise swarm.stage_wait") \
                        from None
                avoid.clear()
                time.sleep(0.2)
                self.refresh(force=True)
                continue
            waited_since = None
            started = time.monotonic()
            try:
                reply = self._exchange(uid, msg)
            except (wire.WireError, OSError) as e:
                log.warning("stage %d worker %s failed a %s (%s): dropped from routing, micro-batch %d re-issued",
                            stage, uid, wire.KIND_NAMES[msg.kind], e, msg.mb)
                router.drop(uid)
                avoid.add(uid)
                self.reissued += 1
                continue
            if reply.kind == wire.NOT_READY:
                # The worker has not applied the previous step yet (a slower first-stage worker is still in it).
                self.not_ready += 1
                time.sleep(backoff)
                backoff = min(BACKOFF_S[1], backoff * 2)
                continue
            if reply.kind == wire.ERROR:
                raise RuntimeError(f"stage {stage} worker {uid}: {reply.meta.get('error')}")
            router.done(uid, size, time.monotonic() - started)
            self.done[uid] += 1
            return reply

    def _exchange(self, uid: str, msg: wire.Message, timeout: float | None = None) -> wire.Message:
        deadline = wire.deadline_in(timeout or self.hop_timeout)
        sock = self._take(uid, deadline)
        try:
            self.bytes_out += wire.send(sock, msg, deadline)
            reply, size = wire.receive(sock, deadline)
        except BaseException:
            sock.close()
            raise
        self.bytes_in += size
        with self._lock:
            self._pool[uid].append(sock)
        return reply

    def _take(self, uid: str, deadline: float) -> socket.socket:
        with self._lock:
            if self._pool[uid]:
                return self._pool[uid].pop()
            address = self.addresses[uid]
        host, port = address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=max(0.1, deadline - time.monotonic()))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def notify_step(self, step: int, owner: str) -> None:
        """Tell every registered worker of stages 1.. that this first-stage worker finished `step` (also
        the ones routing dropped: a stalled worker that recovers must not wait for this notice)."""
        self.refresh(force=True)
        for uid in sorted(self.registered):
            try:
                notice = wire.Message(wire.STEP, step, 0, {"owner": owner})
                self._exchange(uid, notice, timeout=min(5.0, self.hop_timeout))
            except (wire.WireError, OSError) as e:
                log.debug("step notice to %s failed: %s", uid, e)

    def close(self) -> None:
        with self._lock:
            for socks in self._pool.values():
                for s in socks:
                    s.close()
            self._pool.clear()


def to_wire(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu")
