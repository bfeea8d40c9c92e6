"""A node's status record: what `zb status` and the dashboard show of it, built from its metrics events.

Two store values per node, both bounded whatever the run's length:
- the record (keys.status): identity, state and the newest figures, a few hundred bytes; the table
  reads only these;
- the history (keys.status_history): the last HISTORY_POINTS logged steps, OUTER_POINTS outer steps
  and MEMBERSHIP_POINTS membership changes, for the dashboard's curves.

Times are the node's wall clock: they order one node's points and give its rates; liveness never
depends on them (the reader judges heartbeats on its own clock). Values from the store are decoded
with known fields and types only: a peer's bytes are never trusted beyond their shape.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from typing import Any

from zb.events import Membership, OuterStep, RunStart, Step

FORMAT = 1              # bumped when a field changes meaning
HISTORY_POINTS = 120    # logged steps kept per node (about 6 KB)
OUTER_POINTS = 32
MEMBERSHIP_POINTS = 16
MAX_BYTES = 64 * 1024   # a value larger than this is not a zb status record: refused when read

STATES = ("recovering", "joining", "training", "leaving", "left", "refused")

# The record's fields and their types, for decoding what a peer wrote.
_FIELDS: dict[str, tuple[type, ...]] = {
    "format": (int,), "uid": (str,), "host": (str,), "pid": (int,), "device": (str,), "local_world_size": (int,),
    "state": (str,), "global_rank": (int,), "mesh_version": (int,), "leader": (str,), "world_size": (int,),
    "step": (int,), "outer_step": (int,), "total_steps": (int,), "loss": (float, int), "eval_loss": (float, int),
    "tokens": (int,), "tokens_per_s": (float, int), "run_tokens": (int,), "allreduce_s": (float, int),
    "wire_mbps": (float, int), "wire_bytes": (int,), "num_peers": (int,), "started": (float, int),
    "time": (float, int), "heartbeat_interval": (float, int), "heartbeat_timeout": (float, int),
    "steps_per_s": (float, int), "history_version": (int,), "reason": (str,), "compression": (str,),
    "store": (str,), "failovers": (int,), "clipped": (list,),
}


# What the record takes over from each event: fields it keeps under the event's own name (zb.events; checked
# there by tests/test_events.py). The handlers below add the rest (renamed or derived).
KEPT: dict[str, tuple[str, ...]] = {
    RunStart.EVENT: ("host", "pid", "device", "local_world_size"),
    Step.EVENT: ("step", "outer_step", "tokens", "tokens_per_s", "run_tokens"),
    OuterStep.EVENT: ("outer_step", "step", "mesh_version", "num_peers", "allreduce_s", "wire_mbps", "wire_bytes"),
    Membership.EVENT: ("mesh_version", "leader", "global_rank"),
}


def compression_of(run_start: dict) -> str | None:
    """The node's diloco.compression from its run_start event (None without settings). Only a DiLoCo node
    publishes a record (zb.status.publisher), and its settings hold the keys not at their default: a missing
    diloco.compression is "none" (an empty [diloco] table leaves no key at all)."""
    settings = run_start.get("settings")
    return str(settings.get("diloco.compression", "none")) if isinstance(settings, dict) else None


def _finite(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else None


class NodeStatus:
    """This node's record and history, updated from its metrics events (any thread)."""

    def __init__(self, uid: str, *, state: str, total_steps: int, heartbeat_interval: float,
                 heartbeat_timeout: float) -> None:
        self._lock = threading.Lock()
        self._record: dict[str, Any] = {"format": FORMAT, "uid": uid, "state": state, "total_steps": total_steps,
                                        "heartbeat_interval": heartbeat_interval,
                                        "heartbeat_timeout": heartbeat_timeout, "started": round(time.time(), 3)}
        self._steps: deque = deque(maxlen=HISTORY_POINTS)
        self._outer: deque = deque(maxlen=OUTER_POINTS)
        self._evals: deque = deque(maxlen=OUTER_POINTS)
        self._membership: deque = deque(maxlen=MEMBERSHIP_POINTS)
        self.history_version = 0   # bumps when the history changed (the publisher writes it only then)

    def observe(self, record: dict[str, Any]) -> bool:
        """Take one metrics event; True when it should be published at once (an outer step, a change
        of membership or of state)."""
        event = str(record.get("event"))
        handler = getattr(self, "_on_" + event, None)
        if handler is None:
            return False
        with self._lock:
            self._update(**{name: record.get(name) for name in KEPT.get(event, ())})
            return bool(handler(record))

    def end(self) -> None:
        """The node's process ends: `left`, unless the run refused it (that state stays, with its reason)."""
        with self._lock:
            if self._record.get("state") != "refused":
                self._record["state"] = "left"

    def snapshot(self) -> tuple[dict[str, Any], dict[str, Any], int]:
        """(record, history, history_version): JSON-able dicts stamped with the current time."""
        with self._lock:
            record = dict(self._record, time=round(time.time(), 3), history_version=self.history_version)
            rate = self._steps_per_s()
            if rate is not None:
                record["steps_per_s"] = rate
            history = {"uid": record["uid"], "steps": list(self._steps), "outer": list(self._outer),
                       "eval": list(self._evals), "membership": list(self._membership)}
            return record, history, self.history_version

    # -- events ------------------------------------------------------------------------------
    def _on_run_start(self, r: dict) -> bool:
        compression = compression_of(r)
        if compression is not None:
            self._record["compression"] = compression
        return True   # the node's identity (KEPT) is news at once

    def _on_step(self, r: dict) -> bool:
        self._update(loss=_finite(r.get("loss")))
        if self._record.get("state") in ("joining", "recovering") and r.get("step"):
            self._record["state"] = "training"
        self._steps.append([r.get("time"), r.get("step"), _finite(r.get("loss")), r.get("tokens_per_s")])
        self.history_version += 1
        return False

    def _on_eval(self, r: dict) -> bool:
        self._update(eval_loss=_finite(r.get("loss")))
        self._evals.append([r.get("time"), r.get("step"), _finite(r.get("loss"))])
        self.history_version += 1
        return False

    def _on_outer_step(self, r: dict) -> bool:
        self._update(world_size=r.get("global_world_size"))
        self._record["clipped"] = [str(u) for u in r.get("clipped") or []]   # diloco.clip, this outer step
        self._record["state"] = "training"
        self._outer.append([r.get("time"), r.get("outer_step"), r.get("allreduce_s"), r.get("wire_mbps"),
                            r.get("global_world_size")])
        self.history_version += 1
        return True

    def _on_membership(self, r: dict) -> bool:
        self._update(world_size=r.get("global_world_size"))
        uid = self._record["uid"]
        # Admitted but in need of the run's state (it arrives at this outer step), or a member.
        self._record["state"] = "joining" if uid in (r.get("joined") or []) else "training"
        self._membership.append({"time": r.get("time"), "mesh_version": r.get("mesh_version"),
                                 "world_size": r.get("global_world_size"), "leader": r.get("leader"),
                                 "joined": list(r.get("joined") or []), "left": list(r.get("left") or []),
                                 "died": list(r.get("died") or [])})
        self.history_version += 1
        return True

    def _on_refused(self, r: dict) -> bool:
        """The run refused this node (its settings differ from the run's, say): it ends, not `left`."""
        self._record.update(state="refused", reason=str(r.get("reason") or "")[:300])
        return True

    def _on_store_failover(self, r: dict) -> bool:
        return True   # published at once, to the store the node moved to (the publisher adds which)

    def _on_recovery(self, r: dict) -> bool:
        self._record["state"] = "joining"          # the outer state is here; admission comes next
        return True

    def _update(self, **fields: Any) -> None:
        for name, value in fields.items():
            if value is not None:
                self._record[name] = value

    def _steps_per_s(self) -> float | None:
        """Steps per second over the kept history, outer steps included (what an ETA needs)."""
        points = [p for p in self._steps if isinstance(p[0], (int, float)) and isinstance(p[1], int)]
        # Only the newest run of increasing steps: a joiner or a resume jumps to another position.
        start = len(points) - 1
        while start > 0 and points[start - 1][1] < points[start][1]:
            start -= 1
        points = points[start:]
        if len(points) < 2 or points[-1][0] <= points[0][0]:
            return None
        return round((points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0]), 4)


def finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (JSON has no NaN; browsers refuse it)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def encode(value: dict[str, Any]) -> bytes:
    return json.dumps(finite(value), separators=(",", ":"), allow_nan=False).encode()


def _finite_float(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


def _load(raw: bytes) -> dict | None:
    if not raw or len(raw) > MAX_BYTES:
        return None
    try:
        # NaN, Infinity and 1e999 become None as they are parsed (JSON has no such values; browsers refuse them).
        data = json.loads(raw, parse_constant=lambda _: None, parse_float=_finite_float)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def decode_record(raw: bytes) -> dict[str, Any] | None:
    """A record with only known fields of the right type; None when it is not a status record."""
    data = _load(raw)
    if data is None or data.get("format") != FORMAT or not isinstance(data.get("uid"), str):
        return None
    out = {}
    for name, types in _FIELDS.items():
        value = data.get(name)
        if isinstance(value, types) and not isinstance(value, bool):
            out[name] = value[:200] if isinstance(value, str) else value
    if out.get("state") not in STATES:
        out["state"] = "training"
    return out


def _rows(value: Any, width: int, limit: int) -> list[list]:
    """Lists of `width` numbers (or None), at most `limit` of them."""
    rows = []
    for row in value if isinstance(value, list) else []:
        if isinstance(row, list) and len(row) == width and all(
                v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in row):
            rows.append(row)
    return rows[-limit:]


def decode_history(raw: bytes) -> dict[str, Any] | None:
    data = _load(raw)
    if data is None or not isinstance(data.get("uid"), str):
        return None
    changes = []
    membership = data.get("membership")
    for item in membership if isinstance(membership, list) else []:
        if isinstance(item, dict) and isinstance(item.get("mesh_version"), int):
            changes.append({"time": item.get("time") if isinstance(item.get("time"), (int, float)) else None,
                            "mesh_version": item["mesh_version"],
                            "world_size": item.get("world_size") if isinstance(item.get("world_size"), int) else None,
                            "leader": str(item.get("leader") or "")[:200],
                            **{k: [str(u)[:200] for u in item.get(k) or [] if isinstance(u, str)][:64]
                               for k in ("joined", "left", "died")}})
    return {"uid": data["uid"][:200], "steps": _rows(data.get("steps"), 4, HISTORY_POINTS),
            "outer": _rows(data.get("outer"), 5, OUTER_POINTS), "eval": _rows(data.get("eval"), 3, OUTER_POINTS),
            "membership": changes[-MEMBERSHIP_POINTS:]}
