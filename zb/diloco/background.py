"""The pseudo-gradient all-reduce of one outer step, run in a thread while the next inner steps train
(diloco.overlap): the buffer is a CPU copy nobody else touches until `wait()` returns, and the
groups are the overlap's own (built by the main thread at the boundary, every node together), so
the check-in, joiner hand-overs and heartbeats on the mesh's group never queue behind it.

`wait()` is where training can stall: the seconds it blocks are the stall, the rest of the
transfer was hidden behind compute. A failure (a peer killed or hung) is kept, never raised in the
thread: the next boundary's check-in makes every node skip the average alike.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from zb.collectives import PeerFailure, all_reduce
from zb.config_schema import DilocoConfig
from zb.diloco.sync import bucket_ranges, reduce_bucket, share_factor, wire_options
from zb.elastic.view import WorldView

log = logging.getLogger("zb.diloco")


@dataclass
class Arrival:
    """What the wait for a background all-reduce found."""

    buffer: torch.Tensor | None     # the average (SUM / scale), when ok
    error: PeerFailure | None       # why it failed, when it did
    seconds: float = 0.0            # launch to the end of the transfer
    stall_s: float = 0.0            # how long the caller waited for it
    wire_bytes: int = 0
    weight: float | None = None     # this node's share of a token-weighted average (zb.diloco.fragment_rounds)

    @property
    def ok(self) -> bool:
        return self.error is None and self.buffer is not None

    @property
    def hidden_s(self) -> float:
        """Transfer seconds that ran behind compute."""
        return max(0.0, self.seconds - self.stall_s)

    @property
    def mbps(self) -> float:
        return 8 * self.wire_bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0


class BackgroundAllReduce(threading.Thread):
    """All-reduce `buffer` in place (SUM over the first group `groups()` returns, striped over the
    others, then divided by `scale`) in buckets, in a daemon thread started at construction. The
    groups are built inside the thread too: their rendezvous is a round trip to every peer.

    With `tokens` (this node's work behind its buffer), the average is weighted by tokens instead:
    the tokens are summed first (one value, uncompressed), and each node sends tokens / total of its
    buffer, so the SUM is the weighted average (zb.diloco.fragment_rounds) and `scale` is not applied."""

    def __init__(self, buffer: torch.Tensor, groups: Callable[[], Sequence[dist.ProcessGroup]], cfg: DilocoConfig,
                 scale: int, tokens: int | None = None, feedback: Callable[[], AbstractContextManager[torch.Tensor | None]] | None = None,
                 view: WorldView | None = None):
        super().__init__(name="zb-overlap-allreduce", daemon=True)
        self.buffer, self.groups, self.cfg, self.scale = buffer, groups, cfg, scale
        self.wire = wire_options(cfg, view)   # the world it runs in: its link figures pick the reduce's shape
        self.tokens = tokens
        self.feedback = feedback or nullcontext  # error feedback: the buffer's residual, restored on a failure
        self.weight: float | None = None
        self.error: PeerFailure | None = None
        self.wire_bytes = 0
        self.started_at = time.perf_counter()
        self.seconds = 0.0
        self.start()

    def run(self) -> None:
        try:
            group, *streams = self.groups()
            if self.tokens is not None:
                self.weight = self._token_share(group)
                self.buffer.mul_(share_factor(self.cfg, self.weight, self.scale))
            with self.feedback() as residual:
                for a, b in bucket_ranges(self.buffer.numel(), int(self.cfg.bucket_mb * 1e6 / 4)):
                    stats = reduce_bucket(self.buffer[a:b], group, streams, self.cfg, self.wire,
                                          residual[a:b] if residual is not None else None, self.scale,
                                          self.tokens is not None)
                    self.wire_bytes += stats.wire_bytes
        except PeerFailure as e:
            self.error = e
        except Exception as e:  # noqa: BLE001 - any transfer error is a failed sync, never a crashed thread
            self.error = PeerFailure(f"background all-reduce failed: {str(e).splitlines()[0] if str(e) else e!r}",
                                     rank=None)
        finally:
            self.seconds = time.perf_counter() - self.started_at

    def _token_share(self, group: dist.ProcessGroup) -> float:
        """This node's tokens over every node's (0 when none trained): the same total on every node."""
        total = torch.tensor([float(self.tokens or 0)])
        all_reduce(total, group, op=ReduceOp.SUM, min_bandwidth_mbps=self.cfg.min_bandwidth_mbps)
        return (self.tokens or 0) / float(total[0]) if float(total[0]) > 0 else 0.0

    def wait(self) -> Arrival:
        t0 = time.perf_counter()
        self.join()
        stall = time.perf_counter() - t0
        if self.error is not None:
            return Arrival(None, self.error, self.seconds, stall, self.wire_bytes)
        return Arrival(self.buffer, None, self.seconds, stall, self.wire_bytes, self.weight)

    def abandon(self, grace_s: float) -> None:
        """Leaving the run: give the transfer `grace_s` to end (the peers then keep this node's share),
        then go without it (daemon thread; the peers' transfers fail and they skip the average alike)."""
        self.join(grace_s)
        if self.is_alive():
            log.info("leaving with the background all-reduce still running: the other nodes skip its average")


class HeldArrival:
    """An average that already arrived, waiting for its boundary: taken early for a checkpoint (its
    seconds, bytes and stall as they were), or read back from one (it travelled before the restart:
    no seconds, no bytes). `wait()` returns it at once."""

    def __init__(self, arrival: Arrival):
        self.arrival, self.buffer = arrival, arrival.buffer

    def wait(self) -> Arrival:
        return self.arrival

    def abandon(self, grace_s: float) -> None:
        return None
