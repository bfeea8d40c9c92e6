"""The outer-step algorithms by the value of diloco.overlap that selects them (zb.diloco.algorithm has
the interface, zb.overlap_modes what each mode is): a new algorithm is its module and one line here."""

from __future__ import annotations

from zb.diloco.algorithm import OuterAlgorithm
from zb.diloco.blocking import BlockingAlgorithm
from zb.diloco.delayed import DelayedAlgorithm
from zb.diloco.eager_overlap import EagerAlgorithm
from zb.diloco.streaming import StreamingAlgorithm

ALGORITHMS: dict[str, type[OuterAlgorithm]] = {a.mode.name: a for a in (
    BlockingAlgorithm,
    EagerAlgorithm,
    StreamingAlgorithm,
    DelayedAlgorithm,
)}
