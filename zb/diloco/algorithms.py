"""The outer-step algorithms by the value of diloco.overlap that selects them (zb.diloco.algorithm has
the interface): a new algorithm is its module and one line here."""

from __future__ import annotations

from zb.diloco.algorithm import OuterAlgorithm
from zb.diloco.blocking import BlockingAlgorithm
from zb.diloco.eager_overlap import EagerAlgorithm
from zb.diloco.streaming import StreamingAlgorithm

ALGORITHMS: dict[str, type[OuterAlgorithm]] = {
    "none": BlockingAlgorithm,
    "eager": EagerAlgorithm,
    "streaming": StreamingAlgorithm,
}
