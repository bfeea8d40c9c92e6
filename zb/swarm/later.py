"""A worker of a later stage (1..S-1): serves forward, backward and loss requests for its stage, takes
an inner step when every live first-stage worker has finished the step, and every diloco.inner_steps
steps the stage's outer step with the other workers of the stage.

A step ends for this worker when each first-stage worker that is alive (its heartbeat moves, on this
worker's clock, within elastic.heartbeat_timeout) and started at or before the step has sent its step
notice. A dead first-stage worker is waited for at most elastic.heartbeat_timeout; with no live
first-stage worker for swarm.stage_wait seconds the worker gives up (exit 1). After the last step it
serves evaluations until every first-stage worker has left.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from zb.errors import EnvironmentFailure
from zb.events import Swarm, emit
from zb.swarm import registry
from zb.swarm.server import StageServer
from zb.swarm.worker import StageWorker
from zb.train.signals import Ended

log = logging.getLogger("zb.swarm")

POLL_S = 0.05


class LaterStage(StageWorker):
    def __init__(self, cfg, stage_index: int, bounds, args, sink, uid: str):
        super().__init__(cfg, stage_index, bounds, args, sink, uid)
        self.server = StageServer(self.stage, self.sw.host, self.sw.port, self.sw.hop_timeout, self.loss, self.device)
        self.liveness: registry.Liveness | None = None
        self._owners_seen = time.monotonic()
        self._stepped_at = time.monotonic()
        self._first_stage: dict[str, registry.Worker] = {}
        self.resumed = False

    def execute(self, vocab_size: int) -> Ended:
        from zb.train.signals import StopRequest

        stop = StopRequest().install()
        me = None
        try:
            self.link = self.store_link()
            registry.announce_start(self.link.client, self.index, self.uid, self.token)
            self.join_stage(vocab_size)
            self.liveness = registry.Liveness(self.link, self.cfg.elastic.heartbeat_timeout)
            self.resumed = self.resume()
            self.server.open(self.ledger.position.step)
            # Alone in its stage: if the run is further on, this worker restarts a stage that lost every worker
            # (from its checkpoint or the initial weights), and takes the run's step from the first request (with
            # workers beside it, it catches up through the step notices instead).
            self.server.adopt = self.diloco.mesh.view is not None and self.diloco.mesh.view.global_world_size == 1
            self.server.start()
            me = registry.Worker(self.uid, self.server.address, self.ledger.position.step, self.token)
            registry.register(self.link.client, self.index, me)
            log.info("stage %d worker serving on %s from step %d", self.index, self.server.address,
                     self.ledger.position.step)
            while self.ledger.position.step < self.total and not stop.requested:
                self._await_step_end(self.ledger.position.step, stop)
                if stop.requested:
                    break
                self._step(stop)
            self.checkpoints.final(self.ledger.position.step)
            if stop.requested:
                return Ended(stop.signum, self.ledger.position.step)
            self.diloco.finished(self.ledger.position)   # `zb status` and late workers of the stage see it
            self._serve_until_owners_leave(stop)
            return Ended(None, self.ledger.position.step)
        finally:
            if me is not None:
                self.link.run(lambda store: registry.leave(store, me, self.ledger.position.step))
            self.server.close()
            self.shutdown()
            stop.restore()

    def _owners(self, step: int) -> set[str]:
        """First-stage workers that take part in `step` and are alive."""
        known = self.link.run(lambda store: registry.workers(store, 0), fallback=None)
        if known is not None:
            self._first_stage = known
        owners = [w.uid for w in self._first_stage.values() if w.first_step <= step]
        assert self.liveness is not None, "made at the start of execute()"
        return self.liveness.alive(0, owners) if owners else set()

    def _await_step_end(self, step: int, stop) -> None:
        while not stop.requested:
            if self.server.adopted is not None and self.server.adopted > self.ledger.position.step:
                self._adopt(self.server.adopted)
                step = self.ledger.position.step
            owners = self._owners(step)
            now = time.monotonic()
            done = self.server.finished_by(step)
            # A first-stage worker that left after finishing this step (the run's end, or it stopped on a signal)
            # sends no more notices: its leave record says how far it got. One that left before this step is
            # waited for no more either: it is not registered any longer.
            left = self.link.run(lambda store: registry.left_after(store), fallback={})
            done |= {uid for uid, steps in left.items() if steps > step}
            if owners:
                self._owners_seen = now
                if owners <= done:
                    return
            elif done:
                return
            elif now - self._owners_seen > self.sw.stage_wait:
                raise EnvironmentFailure(f"no live first-stage worker for {self.sw.stage_wait:g} s (the run's data "
                                         "comes from them): start one (--swarm.stage 0) or raise swarm.stage_wait")
            self.server.wait_change(POLL_S)

    def _adopt(self, step: int) -> None:
        if self.resumed:
            log.warning("stage %d had no worker holding its state: this worker continues it from its checkpoint of "
                        "step %d at the run's step %d; what the stage learned in between is lost", self.index,
                        self.ledger.position.step, step)
        else:
            log.warning("stage %d had no worker holding its state: this worker starts it afresh (initial weights) at "
                        "the run's step %d; what the stage had learned is lost", self.index, step)
        self.ledger.move_to(dataclasses.replace(self.ledger.position, step=step))
        self.server.adopted = None

    def _step(self, stop) -> None:
        with self.server.compute:
            count = self.server.backward_count
            losses, self.server.losses = self.server.losses, []
            self.server.backward_count = 0
            lr = self.optimizer.param_groups[0]["lr"]
            norm = self.inner_step(count)
            if self.outer_due():
                self.outer_step_unless_stopping(stop, None)
            self.checkpoints.maybe_save(self.ledger.position.step)
        self.server.open(self.ledger.position.step)
        now = time.monotonic()
        dt, self._stepped_at = now - self._stepped_at, now
        p = self.ledger.position
        if count:
            speed = count / max(dt, 1e-9)
            self.link.run(lambda store: registry.publish_speed(store, self.uid, speed))
        if p.step % self.cfg.train.log_interval == 0 or p.step == self.total:
            c = self.server.counts
            emit(self.sink, Swarm(step=p.step, outer_step=p.outer_step, stage=self.index, micro_batches=count,
                                  forward=c["forward"], backward=c["backward"] + c["loss"], eval=c["eval"],
                                  not_ready=c["not_ready"], lr=lr, grad_norm=norm,
                                  loss=sum(losses) / len(losses) if losses else None,
                                  pipeline_bytes_in=self.server.bytes_in, pipeline_bytes_out=self.server.bytes_out))
            log.info("stage %d step %d/%d | micro-batches %d | grad %.3f | served fwd %d bwd %d", self.index, p.step,
                     self.total, count, norm, c["forward"], c["backward"] + c["loss"])

    def _serve_until_owners_leave(self, stop) -> None:
        """The first stage evaluates through this stage after the last step: stay until it has left (at most
        swarm.stage_wait without news from the store)."""
        heard = time.monotonic()
        while not stop.requested and time.monotonic() - heard < self.sw.stage_wait:
            known = self.link.run(lambda store: registry.workers(store, 0))
            if known is not None:
                heard = time.monotonic()
            owners = list(known if known is not None else self._first_stage)
            assert self.liveness is not None, "made at the start of execute()"
            if not owners or not self.liveness.alive(0, owners):
                return
            time.sleep(POLL_S * 4)
