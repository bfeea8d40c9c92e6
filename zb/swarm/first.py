"""A first-stage worker: reads its data slot, drives its micro-batches through the pipeline, keeps
their loss bookkeeping, and steps the first stage (embeddings + its blocks).

Per step: up to swarm.max_in_flight micro-batches at once, each
  stage 0 forward (kept for backward) -> forward hops through stages 1..S-2 -> the last stage's
  loss and backward -> backward hops back (each carries that stage's inputs and output grads, so any
  worker of the stage can serve it) -> stage 0 backward;
then the stage's inner step, a step notice to every later worker (their step ends when every live
first-stage worker has finished it), and every diloco.inner_steps steps the stage's outer step.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from zb.events import Swarm, emit
from zb.local_world import LocalWorld
from zb.swarm import registry, wire
from zb.swarm.client import Hops, to_wire
from zb.swarm.worker import StageWorker
from zb.train.signals import Ended

log = logging.getLogger("zb.swarm")


class FirstStage(StageWorker):
    def __init__(self, cfg, bounds, args, sink, uid: str, tokenizer):
        super().__init__(cfg, 0, bounds, args, sink, uid)
        self.tokenizer, self.num_stages = tokenizer, len(bounds)
        self.accum = cfg.optim.batch_size // cfg.train.micro_bs
        from zb.train.progress import StepClock

        self.step_clock = StepClock()   # for the ETA of the step lines
        self._hops: Hops | None = None
        self.compute = threading.Lock()
        self.counted: set[int] = set()   # micro-batch ids whose loss was counted (each exactly once)
        self._asking_end = threading.Lock()   # the micro-batch threads share the membership's store client

    @property
    def hops(self) -> Hops:
        assert self._hops is not None, "the hops are made once the stage is joined"
        return self._hops

    def execute(self, vocab_size: int) -> Ended:
        from zb.train.setup import build_loaders
        from zb.train.signals import StopRequest

        stop = StopRequest().install()
        me = None
        try:
            self.link = self.store_link()
            registry.announce_start(self.link.client, 0, self.uid, self.token)
            slot = self.join_stage(vocab_size)
            self._hops = Hops(self.link, self.num_stages, self.sw.hop_timeout, self.sw.stage_wait,
                             self.cfg.elastic.heartbeat_timeout, run_over=self._run_over)
            registry.publish_stages(self.link.client, self.num_stages)
            self.train_loader, self.eval_loader = build_loaders(self.cfg, self.tokenizer, LocalWorld(rank=0, world_size=1), slot,
                                                                self.diloco.num_slots)
            position = self.diloco.data_position()
            if position is not None:
                self.train_loader.load_state_dict(position)
            self.resume()
            me = registry.Worker(self.uid, "-", self.ledger.position.step, self.token)
            registry.register(self.link.client, 0, me)
            self.hops.refresh(force=True)
            self._loop(stop)
            self.checkpoints.final(self.ledger.position.step)
            if stop.requested:
                return Ended(stop.signum, self.ledger.position.step)
            self.diloco.finished(self.ledger.position)   # `zb status` and late workers of the stage see it
            if self.cfg.eval.interval >= 0 and self.ledger.position.step > 0:
                self._evaluate()
            return Ended(None, self.ledger.position.step)
        finally:
            if me is not None:
                self.link.run(lambda store: registry.leave(store, me, self.ledger.position.step))
            if self.hops is not None:
                self.hops.close()
            self.shutdown()
            stop.restore()

    def _loop(self, stop) -> None:
        cfg = self.cfg
        with ThreadPoolExecutor(self.sw.max_in_flight, thread_name_prefix="zb-swarm-mb") as pool:
            while self.ledger.position.step < self.total and not stop.requested:
                t0 = time.perf_counter()
                step = self.ledger.position.step
                batches = [next(self.train_loader) for _ in range(self.accum)]
                ids = [step * self.accum + i for i in range(self.accum)]
                losses = list(pool.map(lambda a, step=step: self._micro_batch(step, *a), zip(ids, batches)))
                for mb in ids:
                    if mb in self.counted:
                        raise RuntimeError(f"micro-batch {mb} counted twice")   # a bug: the bookkeeping is per id
                    self.counted.add(mb)
                lr = self.optimizer.param_groups[0]["lr"]
                norm = self.inner_step(self.accum)
                self.hops.notify_step(step, self.uid)
                dt = time.perf_counter() - t0
                self._log_step(sum(losses) / len(losses), lr, norm, dt, len(ids))
                if self.outer_due():
                    self.outer_step_unless_stopping(stop, self.train_loader.state_dict())
                self.checkpoints.maybe_save(self.ledger.position.step)
                if cfg.eval.interval > 0 and self.ledger.position.step % cfg.eval.interval == 0 and \
                        self.ledger.position.step < self.total:
                    self._evaluate()

    def _run_over(self) -> None:
        """RunFinishedWithout when the stage's run ended in a later world than this worker's: a worker cut off or
        stopped until the others finished finds the later stages gone, and its next outer step out of reach."""
        with self._asking_end:
            self.diloco.mesh.check_finished()

    def inner_step(self, count: int) -> float:
        # The run's tokens of the step: this worker's times the first-stage workers training beside it.
        self.ledger.nodes = self._owners()
        return super().inner_step(count)

    def data_state(self) -> tuple[dict, bool]:
        return self.train_loader.state_dict(), self.train_loader.exact_resume

    def load_data_state(self, state: dict | None) -> None:
        if self.cfg.ckpt.skip_dataloader:
            log.info("ckpt.skip_dataloader: the data starts from the beginning of this worker's slot")
        elif state is not None:
            self.train_loader.load_state_dict(state)

    def _micro_batch(self, step: int, mb: int, batch) -> float:
        inputs, labels = batch[0].to(self.device), batch[1]
        cu = batch[2] if len(batch) > 2 else None
        extra = [cu] if cu is not None else []
        meta = {"cu": 1} if cu is not None else {}
        with self.compute:
            h0 = self.stage(inputs, cu.to(self.device) if cu is not None else None)
        hidden = [to_wire(h0)]
        for j in range(1, self.num_stages - 1):   # forward through the middle stages
            reply = self.hops.call(j, wire.Message(wire.FORWARD, step, mb, meta, [hidden[-1]] + extra))
            hidden.append(reply.tensors[0])
        reply = self.hops.call(self.num_stages - 1,
                               wire.Message(wire.LOSS, step, mb, meta, [hidden[-1], labels] + extra))
        loss, grad = float(reply.meta["loss"]), reply.tensors[0]
        for j in range(self.num_stages - 2, 0, -1):   # backward: stage j's inputs and its outputs' grad
            request = wire.Message(wire.BACKWARD, step, mb, meta, [hidden[j - 1], grad] + extra)
            grad = self.hops.call(j, request).tensors[0]
        with self.compute:
            h0.backward(grad.to(self.device))
        return loss

    @torch.no_grad()
    def _evaluate(self) -> float:
        total, count, step = 0.0, 0, self.ledger.position.step
        it = iter(self.eval_loader())
        for i in range(self.cfg.eval.batches):
            batch = next(it, None)
            if batch is None:
                break
            cu = batch[2] if len(batch) > 2 else None
            extra, meta = ([cu], {"cu": 1}) if cu is not None else ([], {})
            h = to_wire(self.stage(batch[0].to(self.device), cu.to(self.device) if cu is not None else None))
            for j in range(1, self.num_stages):
                msg = wire.Message(wire.EVAL, step, -1 - i, meta, [h] + ([batch[1]] if j == self.num_stages - 1
                                                                           else []) + extra)
                reply = self.hops.call(j, msg)
                if j < self.num_stages - 1:
                    h = reply.tensors[0]   # the next stage's input; the last stage answers with the loss only
            total += float(reply.meta["loss"])
            count += 1
        loss = total / count if count else float("nan")
        log.info("eval step %d | held-out loss %.4f", step, loss)
        self.ledger.eval(loss)
        return loss

    def _log_step(self, loss: float, lr: float, norm: float, dt: float, micro_batches: int) -> None:
        record = self.ledger.step(loss=loss, lr=lr, grad_norm=norm, z_loss=None, seconds=dt,
                                  micro_batches=micro_batches)
        self.step_clock.add(dt)
        if record.step % self.cfg.train.log_interval == 0 or record.step == self.total:
            log.info(self.ledger.step_line(record, self.total, seconds=dt,
                                           eta_s=self.step_clock.eta(self.total - record.step)))
            self._log_swarm(record.step)
            speed = self.accum / max(1e-9, dt)
            self.link.run(lambda store: registry.publish_speed(store, self.uid, speed))

    def _log_swarm(self, step: int) -> None:
        routers = self.hops.routers
        emit(self.sink, Swarm(step=step, stage=0, forward=len(self.counted), backward=len(self.counted),
                              reissued=self.hops.reissued, not_ready=self.hops.not_ready,
                              shares={str(j): dict(r.sent) for j, r in routers.items()},
                              throughput={str(j): {u: round(v, 3) for u, v in r.throughputs().items() if v}
                                          for j, r in routers.items()},
                              pipeline_bytes_in=self.hops.bytes_in, pipeline_bytes_out=self.hops.bytes_out))

    def _owners(self) -> int:
        return self.diloco.mesh.view.global_world_size if self.diloco and self.diloco.mesh.view else 1
