"""A stage worker's server: forward, backward and loss requests for its stage, and step notices.

Stateless per micro-batch, as in SWARM: a backward request carries the stage's inputs and the
gradient of its outputs, and the worker recomputes the forward before running backward, so any worker
of the stage can serve it and a worker that dies loses nothing the first stage cannot send again.
Gradients accumulate in the stage's parameters until the worker's inner step (zb.swarm.worker).

Steps are gated: a request for step s is computed only once this worker has applied every step
before s (answered `not-ready` otherwise; the sender retries), so no request mixes two steps'
params. One computation at a time: the worker's cores are busy with it anyway.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
from collections import Counter

import torch

from zb.models.loss import LossSpec
from zb.swarm import wire
from zb.swarm.stages import Stage

log = logging.getLogger("zb.swarm")

HOLD_S = 1.0   # the longest a request for a step not yet open waits here before `not-ready`


class StageServer:
    def __init__(self, stage: Stage, host: str, port: int, hop_timeout: float, loss: LossSpec,
                 device: torch.device | str = "cpu"):
        self.stage, self.hop_timeout, self.loss, self.device = stage, hop_timeout, loss, torch.device(device)
        self.compute = threading.Lock()       # held by a computation, an inner step or an outer step
        self.open_step = 0                    # requests for this step (and earlier) are served
        self.backward_count = 0               # micro-batches whose gradients are in .grad now
        self.losses: list[float] = []         # last stage: this step's micro-batch losses
        self.counts: Counter[str] = Counter()  # forward, backward, loss, eval, not_ready: for the metrics
        self.bytes_in = self.bytes_out = 0
        self.last_done: dict[str, int] = {}   # first-stage worker -> the latest step it finished
        self.changed = threading.Condition()
        # A worker that restarted a stage (no live peer held its state) takes the run's step from the first
        # request instead of waiting for notices of steps the run has left behind: set by the worker. Only the
        # first request decides: later, one for the next step is the first stage running ahead of this worker's
        # inner step (held, as for any worker), not the run being elsewhere.
        self.adopt = False
        self.adopted: int | None = None
        self._server = _Server((host, port), _handler(self))
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="zb-swarm-server", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():   # shutdown() of a server never started would wait forever
            self._server.shutdown()
        self._server.server_close()

    # -- requests ---------------------------------------------------------------------------------
    def handle(self, msg: wire.Message) -> wire.Message:
        if msg.kind == wire.STEP:
            with self.changed:
                owner = str(msg.meta.get("owner", "?"))
                self.last_done[owner] = max(msg.step, self.last_done.get(owner, -1))
                self.changed.notify_all()
            return wire.Message(wire.REPLY, msg.step, msg.mb)
        if msg.kind not in (wire.FORWARD, wire.BACKWARD, wire.LOSS, wire.EVAL):
            return wire.Message(wire.ERROR, msg.step, msg.mb, {"error": f"unexpected {wire.KIND_NAMES[msg.kind]}"})
        if self.adopt and msg.kind != wire.EVAL:
            with self.changed:
                if msg.step > self.open_step:
                    self.adopted, self.open_step = msg.step, msg.step
                self.adopt = False
                self.changed.notify_all()
        if msg.kind != wire.EVAL and msg.step > self.open_step:
            # Usually the step opens within moments (the last notice is on its way): hold the request a little
            # rather than have the sender send its tensors again.
            with self.changed:
                self.changed.wait_for(lambda: msg.step <= self.open_step, timeout=min(HOLD_S, self.hop_timeout / 4))
        if msg.kind != wire.EVAL and msg.step > self.open_step:
            self.counts["not_ready"] += 1
            return wire.Message(wire.NOT_READY, msg.step, msg.mb, {"open": self.open_step})
        with self.compute:
            if msg.kind != wire.EVAL and msg.step > self.open_step:   # re-checked: an outer step may have run
                return wire.Message(wire.NOT_READY, msg.step, msg.mb, {"open": self.open_step})
            return self._compute(msg)

    def _compute(self, msg: wire.Message) -> wire.Message:
        x, rest = msg.tensors[0].to(self.device), [t.to(self.device) for t in msg.tensors[1:]]
        cu = rest.pop() if msg.meta.get("cu") else None
        self.counts[wire.KIND_NAMES[msg.kind]] += 1
        if msg.kind == wire.FORWARD or (msg.kind == wire.EVAL and not self.stage.is_last):
            with torch.no_grad():
                return wire.Message(wire.REPLY, msg.step, msg.mb, tensors=[self.stage(x, cu)])
        if msg.kind == wire.EVAL:
            with torch.no_grad():
                loss, z = self.stage(x, cu, labels=rest[0], loss=self.loss)
            return wire.Message(wire.REPLY, msg.step, msg.mb, {"loss": _ce(loss, z, self.loss)})
        x = x.detach().requires_grad_(True)
        if msg.kind == wire.LOSS:
            loss, z = self.stage(x, cu, labels=rest[0], loss=self.loss)
            loss.backward()
            self.backward_count += 1
            ce = _ce(loss, z, self.loss)
            self.losses.append(ce)
            assert x.grad is not None   # x requires grad and the loss depends on it
            return wire.Message(wire.REPLY, msg.step, msg.mb, {"loss": ce, "z": float(z)}, [x.grad])
        out = self.stage(x, cu)          # BACKWARD: recompute the forward, then back-propagate the output grad
        out.backward(rest[0])
        self.backward_count += 1
        assert x.grad is not None
        return wire.Message(wire.REPLY, msg.step, msg.mb, tensors=[x.grad])

    # -- step gating ---------------------------------------------------------------------------------
    def open(self, step: int) -> None:
        """Steps before `step` are applied: serve its requests."""
        with self.changed:
            self.open_step = step
            self.changed.notify_all()

    def finished_by(self, step: int) -> set[str]:
        """First-stage workers that finished `step` (a notice of a later step implies it: one may be lost)."""
        with self.changed:
            return {o for o, s in self.last_done.items() if s >= step}

    def wait_change(self, timeout: float) -> None:
        with self.changed:
            self.changed.wait(timeout)


def _ce(loss: torch.Tensor, z: torch.Tensor, spec: LossSpec) -> float:
    """The logged loss: cross-entropy alone (z-loss excluded), as zb.train.step logs it."""
    return float(loss.detach()) - spec.z_loss_weight * float(z)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def _handler(server: StageServer):
    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            sock: socket.socket = self.request
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                try:
                    # A connection idles between requests: wait for the next one without a deadline,
                    # then hold the rest of the message to the hop's.
                    sock.settimeout(None)
                    first = sock.recv(1, socket.MSG_PEEK)
                    if not first:
                        return
                    msg, size = wire.receive(sock, wire.deadline_in(server.hop_timeout))
                except (wire.WireError, OSError) as e:
                    log.debug("swarm connection from %s closed: %s", self.client_address, e)
                    return
                server.bytes_in += size
                try:
                    reply = server.handle(msg)
                except Exception as e:  # noqa: BLE001 - told to the sender (a bug shows in its log), server goes on
                    log.exception("swarm request failed")
                    reply = wire.Message(wire.ERROR, msg.step, msg.mb, {"error": f"{type(e).__name__}: {e}"})
                try:
                    server.bytes_out += wire.send(sock, reply, wire.deadline_in(server.hop_timeout))
                except wire.WireError as e:
                    log.debug("swarm reply to %s lost: %s", self.client_address, e)
                    return

    return Handler
