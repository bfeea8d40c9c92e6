"""What one outer step did: the report a DiLoCo node returns to the training loop that ran it, and the
fields of the `outer_step` metrics event that come from it (both loops, zb.train.run and the swarm's
stage workers, log these the same way: a new field of the report is one edit here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True)
class OuterReport:
    """What one outer step did, for the `outer_step` metrics event."""

    mesh_version: int
    global_world_size: int
    num_peers: int          # nodes that contributed a pseudo-gradient
    attempts: int
    allreduce_s: float = 0.0
    wire_bytes: int = 0
    wire_mbps: float = 0.0
    applied: bool = False   # False when skipped (non-finite, no peer reachable) or state was received
    params_hash: str | None = None
    note: str = ""          # why nothing was applied, when that is expected
    fragment: int | None = None  # streaming: the fragment this outer step synced
    hidden_s: float = 0.0   # overlap: all-reduce seconds that ran behind compute
    stall_s: float = 0.0    # overlap: seconds training waited for the all-reduce (blocking: all of it)
    # Blocking outer steps: where the seconds went. d2h_s and reduce_s overlap inside allreduce_s
    # (buckets are reduced while later ones are copied); h2d_s follows it (outer params to the model).
    d2h_s: float = 0.0
    reduce_s: float = 0.0
    h2d_s: float = 0.0
    # diloco.round_seconds: the run's step after the round (every node moves there), each node's inner
    # steps in the round (by node id), the run's tokens in it, and this node's weight in the average.
    run_step: int | None = None
    round_steps: dict[str, int] | None = None
    round_tokens: int | None = None
    round_weight: float | None = None

    def event_fields(self) -> dict[str, Any]:
        """The report's part of the `outer_step` event (the loop adds its own position and rates)."""
        fields: dict[str, Any] = dict(
            mesh_version=self.mesh_version, global_world_size=self.global_world_size, num_peers=self.num_peers,
            allreduce_s=self.allreduce_s, wire_bytes=self.wire_bytes, wire_mbps=self.wire_mbps, applied=self.applied,
            attempts=self.attempts, hidden_s=self.hidden_s, stall_s=self.stall_s, d2h_s=self.d2h_s,
            reduce_s=self.reduce_s, h2d_s=self.h2d_s)
        if self.params_hash is not None:
            fields["params_hash"] = self.params_hash
        if self.fragment is not None:
            fields["fragment"] = self.fragment
        if self.round_steps is not None:
            fields.update(round_steps=self.round_steps, round_tokens=self.round_tokens, round_weight=self.round_weight)
        return fields
