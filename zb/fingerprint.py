"""The run fingerprint: the settings every node of a run must share.

The first node publishes it in the store; a joiner (or a resumed node) whose settings differ is
refused with exit 2, naming the keys, before it touches the run. Checkpoints carry it too, so a
resume with other settings is refused the same way. Which keys count is declared on the knobs
(`knob(run_defining=True)`): the model, the sequence length and tokenizer, the seed and the outer
optimizer; and the stripes of the outer state (diloco.stripes, zb.diloco.stripes), which a joiner
that leaves it unset takes from the run. Everything else may differ per node, the local rank
count included: LR schedule and its position, batch and micro batch sizes, log, eval, checkpoint
and timing settings, total_steps and max_steps.

It lives below both of its users (zb.diloco checks it at join, zb.ckpt at resume).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from zb import __version__
from zb.config import KEYS, get, toml_value
from zb.config_schema import Config
from zb.errors import InvalidInput

RUN_DEFINING = [key for key, spec in KEYS.items() if spec.run_defining]

# The layout of the bytes nodes send each other, raised whenever one changes: zb's version string does not
# move with every commit, and two nodes that would misread each other's payloads must be refused at join,
# naming this, not fail every exchange. 2: the sparse scheme's indices in the Elias-Fano code (1: 12-bit
# indices; fingerprints before this key had none).
WIRE_FORMAT = 2


def fingerprint(cfg: Config, local_world_size: int, vocab_size: int) -> dict[str, Any]:
    values = {key: get(cfg, key) for key in RUN_DEFINING}
    values.update({"vocab_size_resolved": vocab_size, "zb_version": __version__, "wire_format": WIRE_FORMAT})
    if cfg.diloco is not None:   # the outer state's layout; without DiLoCo nothing depends on it
        values["stripes"] = cfg.diloco.stripes or local_world_size
    return values


def encode(values: dict[str, Any]) -> str:
    return json.dumps(values, sort_keys=True, separators=(",", ":"))


def differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    keys = sorted(set(mine) | set(theirs))
    return [f"{k} (run: {_short(theirs.get(k))}, this node: {_short(mine.get(k))})" for k in keys
            if mine.get(k) != theirs.get(k)]


def _short(value: Any, limit: int = 60) -> str:
    """A value for a one-line message: long ones (a stage's parameter list) cut, with their length."""
    text = toml_value(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}... ({len(text)} chars)"


def check_against(mine: dict[str, Any], published: str, ended: Callable[[], str | None] = lambda: None) -> None:
    """Raise InvalidInput (exit 2) naming every differing key. `ended` says how the store's run ended
    (None: it may be live), asked only on a difference: a run that ended cannot be joined."""
    try:
        theirs = json.loads(published)
    except ValueError:
        raise InvalidInput("the run's published fingerprint is unreadable; is this store used by another tool?") \
            from None
    diff = differences(mine, theirs)
    if not diff:
        return
    how = ended()
    if how is not None:
        raise InvalidInput(f"this store holds a run that has ended ({how}) and this node's settings differ from "
                           "that run's: " + "; ".join(diff) + ". For a new run start a new `zb store`, or pick a new "
                           "namespace on this one with --elastic.namespace")
    raise InvalidInput("this node's settings differ from the run's: " + "; ".join(diff)
                       + ". Use the run's settings to join it.")
