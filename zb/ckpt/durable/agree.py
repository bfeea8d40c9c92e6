"""Which checkpoint step a multi-node run resumes from: the newest one every node has committed.

Each node appends `{"uid": ..., "steps": [...]}` to one store key, waits until `quorum` nodes
published or `timeout` passed, computes the choice from what it read, and proposes it with
compare_set on a decision key: the first proposal wins and every node returns that same step, even
one that read a different set of publications. A late node reads the decision without proposing.

The keys are per `scope`, one for each start of the run: a store outlives the runs that used it
(a whole run killed and restarted against it), and the decision of an earlier start (often "no
step", when it began from scratch) must never be read as this one's.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

log = logging.getLogger("zb.ckpt")

ROOT = "zb/ckpt/resume"


def steps_key(scope: str) -> str:
    """Append-only: one JSON line per node."""
    return f"{ROOT}/{scope}/steps"


def decision_key(scope: str) -> str:
    """JSON {"step": int | null}, written once with compare_set."""
    return f"{ROOT}/{scope}/decision"


POLL_S = 0.1


def newest_common_step(published: dict[str, list[int]]) -> int | None:
    """The newest step present in every node's list; None if there is none (or no node)."""
    if not published:
        return None
    common = set.intersection(*(set(steps) for steps in published.values()))
    return max(common) if common else None


def parse_publications(raw: bytes) -> dict[str, list[int]]:
    """uid -> steps from the append-only key; malformed lines are skipped, a uid's last line wins."""
    out: dict[str, list[int]] = {}
    for line in raw.decode(errors="replace").splitlines():
        try:
            doc = json.loads(line)
            steps = [int(s) for s in doc["steps"] if isinstance(s, int) and not isinstance(s, bool)]
            out[str(doc["uid"])] = steps
        except (ValueError, KeyError, TypeError):
            continue
    return out


def agree_on_latest(store: Any, uid: str, my_steps: list[int], quorum: int, timeout: float, scope: str) -> int | None:
    """Publish my committed steps; return the run's decision (None: nothing every node has).

    A node that does not hold the decided step gets None (with a warning): it cannot resume that
    step from its own disk and should join through live recovery instead.
    """
    steps, decided = steps_key(scope), decision_key(scope)
    if not store.check([decided]):
        store.append(steps, json.dumps({"uid": uid, "steps": sorted(my_steps)}) + "\n")
        published = _wait_for(store, steps, decided, quorum, timeout)
        choice = newest_common_step(published)
        log.info("checkpoint steps published by %d node(s); newest common step: %s", len(published), choice)
        decision = store.compare_set(decided, "", json.dumps({"step": choice}))
    else:
        decision = store.get(decided)
    step = json.loads(decision)["step"]
    if step is None and my_steps:
        log.warning("the run found no checkpoint step that every node has (this node has %s): it starts from "
                    "scratch, and this node's checkpoints are replaced as the new run saves the same steps",
                    _steps_text(my_steps))
    if step is not None and step not in my_steps:
        log.warning("the run resumes from step %d, which this node has not committed: not resuming from disk",
                    step)
        return None
    return step


def _steps_text(steps: list[int]) -> str:
    steps = sorted(steps)
    return ", ".join(map(str, steps)) if len(steps) <= 4 else f"{len(steps)} steps, {steps[0]} to {steps[-1]}"


def _wait_for(store: Any, steps: str, decided: str, quorum: int, timeout: float) -> dict[str, list[int]]:
    deadline = time.monotonic() + timeout
    while True:
        published = parse_publications(store.get(steps)) if store.check([steps]) else {}
        if len(published) >= quorum or store.check([decided]) or time.monotonic() >= deadline:
            return published
        time.sleep(POLL_S)
