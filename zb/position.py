"""Where a run stands, in one type wherever the position travels: the training loop's counters, the
outer-step report, the state a joiner receives (a tensor header), live-recovery snapshots and
checkpoints (JSON under the key "counters", as written by every earlier version)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

JSON_KEY = "counters"


@dataclass(frozen=True)
class RunPosition:
    step: int = 0          # inner steps taken by the run
    outer_step: int = 0    # outer steps completed
    tokens: int = 0        # tokens this node trained on
    run_tokens: int = 0    # tokens every node of the run trained on together

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    @staticmethod
    def from_json(data: object) -> RunPosition:
        """From a manifest's JSON; step and outer_step are required, token counts default to 0
        (live snapshots carry no node's own tokens). ValueError names what is missing."""
        if not isinstance(data, dict) or not all(isinstance(data.get(k), int) for k in ("step", "outer_step")):
            raise ValueError("no run position (step, outer_step)")
        return RunPosition(**{f.name: int(data.get(f.name, 0)) for f in fields(RunPosition)})

    def to_ints(self) -> list[int]:
        """The int64 encoding, in field order (a tensor header between nodes)."""
        return [getattr(self, f.name) for f in fields(self)]

    @staticmethod
    def from_ints(values) -> RunPosition:
        return RunPosition(*(int(v) for v in list(values)[:len(fields(RunPosition))]))
