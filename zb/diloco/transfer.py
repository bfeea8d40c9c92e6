"""State for a joiner, sent by a live node over their replica group as raw tensors (no pickles).

What travels: outer params and outer momentum (identical on every node), this rank's stripe of the
inner AdamW state (zb.diloco.stripes: its FSDP shard on a node with as many local ranks as stripes,
rows moved inside the node otherwise), and the run's position. The joiner keeps its own data position (its data slot).
A header goes first so the joiner can refuse a donor whose layout differs before reading anything
else; every transfer is bounded by a deadline from its size and diloco.min_bandwidth_mbps.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from zb.collectives import PeerFailure
from zb.diloco.outer import OuterState, local_shard
from zb.errors import InvalidInput
from zb.position import RunPosition

log = logging.getLogger("zb.diloco")

TAG = 7_000  # distinct from the all-reduce ring's tags
HEADER_LEN = 8
DEADLINE_FLOOR_S = 30.0


def ensure_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every param an (empty) AdamW state so a joiner has tensors to receive into."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if "exp_avg" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _moments(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every param's AdamW moments (exp_avg, exp_avg_sq), as the optimizer holds them (FSDP DTensors)."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            out += [state["exp_avg"], state["exp_avg_sq"]]
    return out


def _steps(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [optimizer.state[p]["step"] for g in optimizer.param_groups for p in g["params"]]


def _layout_hash(outer: OuterState) -> int:
    text = ";".join(f"{n}:{tuple(s)}" for n, s in zip(outer.names, outer.shapes))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")


def _deadline(nbytes: int, min_bandwidth_mbps: float) -> timedelta:
    return timedelta(seconds=DEADLINE_FLOOR_S + nbytes * 8 / (min_bandwidth_mbps * 1e6))


def _wait(work: dist.Work, nbytes: int, bw: float, peer: int, what: str) -> None:
    try:
        work.wait(_deadline(nbytes, bw))
    except Exception as e:  # noqa: BLE001 - gloo's errors name an address; we know the peer
        raise PeerFailure(f"state transfer ({what}) with rank {peer} failed: {str(e).splitlines()[0]}",
                          rank=peer) from None


class FailureReports(Protocol):
    def report_failure(self, rank: int | None) -> None: ...


def send_each(mesh: FailureReports, ranks: list[int], send: Callable[[int], object], what: str) -> None:
    """The donor's side of a hand-over: a joiner that fails to receive is reported, the rest go on."""
    for r in ranks:
        try:
            send(r)
        except PeerFailure as e:
            log.warning("could not send %s to joiner rank %d: %s", what, r, e)
            mesh.report_failure(r)


class StateTransfer:
    """Send or receive one rank's share of the joiner state over `pg` (a replica group)."""

    def __init__(self, pg: dist.ProcessGroup, outer: OuterState, optimizer: torch.optim.Optimizer, bw: float):
        self.pg, self.outer, self.optimizer, self.bw = pg, outer, optimizer, bw
        self.layout = outer.layout
        self._inner: list[torch.Tensor] = []

    def stage(self, read: bool) -> None:
        """Every local rank, before send (read: take the moments) or receive: give every param AdamW
        state and lay this rank's stripe of it out (a collective when rows move inside the node)."""
        ensure_adam_state(self.optimizer)
        moments = _moments(self.optimizer)
        if self.layout.identity:
            self._inner = [local_shard(t) for t in moments]   # the shards themselves: received in place
            return
        shapes = [tuple(t.shape) for t in moments]
        self._inner = [torch.zeros(self.layout.stripe_shape(s)) for s in shapes]
        if read:
            self.layout.read(shapes, moments, self._inner)

    def finish(self) -> None:
        """Every local rank, after a receive: the received state into the model and the optimizer."""
        if not self.layout.identity:
            moments = _moments(self.optimizer)
            self.layout.write([tuple(t.shape) for t in moments], self._inner, moments)
        self.outer.push_to_model()

    def _header(self, position: RunPosition) -> torch.Tensor:
        has_momentum = int("outer/momentum" in self.outer.state_tensors())
        values = [self.outer.numel, has_momentum, sum(t.numel() for t in self._inner),
                  _layout_hash(self.outer), *position.to_ints()]
        return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64)

    def _payload(self) -> torch.Tensor:
        """One fp32 CPU buffer: momentum, inner AdamW state, AdamW step counts (outer params go alone)."""
        parts = [t.reshape(-1).float().cpu() for t in self.outer.state_tensors().values()][1:]
        parts += [t.reshape(-1).float().cpu() for t in self._inner]
        parts.append(torch.stack([s.float().cpu() for s in _steps(self.optimizer)]))
        return torch.cat(parts)

    def send(self, dst: int, position: RunPosition) -> None:
        header, payload = self._header(position), self._payload()
        for i, t in enumerate((header, self.outer.flat.data, payload)):
            _wait(self.pg.send([t], dst, TAG + i), t.numel() * t.element_size(), self.bw, dst, "send")

    def send_tensor(self, dst: int, tensor: torch.Tensor, part: int = -1) -> None:
        """One fp32 buffer of the outer params' layout (an average for a late joiner; `part`: the
        streaming fragment it covers, -1 for all params), behind a header."""
        header = torch.tensor([tensor.numel(), _layout_hash(self.outer), part], dtype=torch.int64)
        for i, t in enumerate((header, tensor)):
            _wait(self.pg.send([t], dst, TAG + 3 + i), t.numel() * t.element_size(), self.bw, dst, "send")

    def receive_tensor(self, src: int, numel_of: Callable[[int], int]) -> tuple[torch.Tensor, int]:
        """(the buffer, its part); `numel_of(part)` is how many values this node expects for it."""
        header = torch.empty(3, dtype=torch.int64)
        _wait(self.pg.recv([header], src, TAG + 3), 24, self.bw, src, "header")
        numel, layout, part = header.tolist()
        if layout != _layout_hash(self.outer) or numel != numel_of(part):
            raise InvalidInput(f"the donor's buffer layout differs from this node's ({numel} values for part {part}): "
                               "the nodes run different models")
        out = torch.empty(numel)
        _wait(self.pg.recv([out], src, TAG + 4), 4 * numel, self.bw, src, "average")
        return out, part

    def receive(self, src: int) -> RunPosition:
        """Load the donor's state (after stage; finish puts it in the model); returns its position.
        InvalidInput if its layout differs."""
        mine = self._header(RunPosition())
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        _wait(self.pg.recv([header], src, TAG), 8 * HEADER_LEN, self.bw, src, "header")
        theirs, ours = header[:4].tolist(), mine[:4].tolist()
        if [theirs[0], theirs[2], theirs[3]] != [ours[0], ours[2], ours[3]]:
            raise InvalidInput(f"the donor's state layout differs from this node's (outer params: {theirs[0]} vs "
                               f"{ours[0]} values, inner state: {theirs[2]} vs {ours[2]}): the nodes run different "
                               "models")
        _wait(self.pg.recv([self.outer.flat.data], src, TAG + 1), 4 * self.outer.numel, self.bw, src, "outer")
        momentum = int(header[1].item())
        payload = torch.empty(momentum * self.outer.numel + int(header[2]) + len(_steps(self.optimizer)))
        _wait(self.pg.recv([payload], src, TAG + 2), 4 * payload.numel(), self.bw, src, "state")
        self._load_payload(payload, momentum)
        return RunPosition.from_ints(header[4:].tolist())

    @torch.no_grad()
    def _load_payload(self, payload: torch.Tensor, momentum: int) -> None:
        offset = 0
        if momentum:
            self.outer.load_state_tensors({"outer/params": self.outer.flat.data,
                                           "outer/momentum": payload[:self.outer.numel]})
            offset = self.outer.numel
        for t in self._inner:
            t.copy_(payload[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        for s in _steps(self.optimizer):
            s.fill_(payload[offset].item())
            offset += 1
