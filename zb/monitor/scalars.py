"""The numbers of a metrics event as named scalars for the charting backends (wandb, tensorboard).

A `step` event's fields take the names Prime logged to wandb (`Loss`, `Perplexity`, `inner_lr`,
`tokens_per_second`, `total_tokens`, `mfu`, ...), so dashboards made for Prime runs show zb runs; the
`outer_step` event's do too (`outer_mfu`, `outer_tokens_per_second`, `all_reduce_step`). Every other
number is `<event>/<field>` (`eval/loss`, `checkpoint/blocking_s`). Text, lists and non-finite
values (written as strings in metrics.jsonl) are left out; booleans become 0 or 1.
"""

from __future__ import annotations

import math
from typing import Any

from zb.events import OuterStep, RunStart, Step

# Fields named as Prime named them in wandb, per event (tests/test_events.py checks the fields against
# zb.events); "step" and "outer_step" are global names.
PRIME_NAMES = {
    Step.EVENT: {"loss": "Loss", "perplexity": "Perplexity", "lr": "inner_lr", "tokens_per_s": "tokens_per_second",
                 "run_tokens": "total_tokens", "mfu": "mfu", "grad_norm": "grad_norm", "z_loss": "z_loss"},
    OuterStep.EVENT: {"outer_mfu": "outer_mfu", "outer_tokens_per_s": "outer_tokens_per_second",
                      "allreduce_s": "all_reduce_step", "num_peers": "num_peers"},
}
GLOBAL = ("step", "outer_step")
SKIPPED_EVENTS = (RunStart.EVENT,)  # its settings go to the backend's run config instead
SKIPPED_FIELDS = ("event", "time", "node")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """{name: value} of the record's numeric fields ({} for an event without numbers)."""
    event: Any = record.get("event")   # a JSON value: a name, or anything in a malformed record
    if event in SKIPPED_EVENTS:
        return {}
    names = PRIME_NAMES.get(event, {})
    out: dict[str, float] = {}
    for field, value in record.items():
        if field in SKIPPED_FIELDS or isinstance(value, (str, list, dict)) or value is None:
            continue
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        name = field if field in GLOBAL else names.get(field, f"{event}/{field}")
        out[name] = value
    return out
