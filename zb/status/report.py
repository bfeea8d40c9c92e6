"""A finished run's report: the dashboard's document built from metrics.jsonl files instead of a store.

`zb status --from logs/sim/... --out report.html` finds every metrics.jsonl under the given paths
(one per node: each node's local rank 0 writes its own), and fills the same nodes table, curves and
membership timeline the live dashboard shows. A line that does not parse (a node killed mid-write)
is skipped and counted; a file appended to by several runs shows all of them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from zb.errors import InvalidInput
from zb.status.record import compression_of

METRICS = "metrics.jsonl"
POINTS = 2000        # per node and curve, as the live dashboard keeps


def find_metrics(paths: Iterable[str]) -> list[Path]:
    """Every metrics file named by `paths` (files, or directories searched recursively)."""
    found: list[Path] = []
    for text in paths:
        path = Path(text)
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found.extend(sorted(path.rglob(METRICS)))
        else:
            raise InvalidInput(f"--from {text}: no such file or directory")
    if not found:
        raise InvalidInput(f"--from {' '.join(paths)}: no {METRICS} there; give a node's log.dir or the directory "
                           "that holds the nodes' log dirs")
    return list(dict.fromkeys(p.resolve() for p in found))


def _events(path: Path) -> tuple[list[dict[str, Any]], int]:
    events, bad = [], 0
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        raise InvalidInput(f"--from: cannot read {path}: {e.strerror or e}") from None
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(event, dict) and isinstance(event.get("event"), str):
            events.append(event)
        else:
            bad += 1
    return events, bad


def _num(value: Any) -> float | int | None:
    """A finite number, else None (metrics write NaN/Inf as strings; a damaged line may hold anything)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok else None


class _Node:
    def __init__(self, uid: str) -> None:
        self.uid = uid
        self.row: dict[str, Any] = {"uid": uid, "state": "ended", "global_rank": None}
        self.steps: list[list] = []
        self.outer: list[list] = []
        self.evals: list[list] = []
        self.first: float | None = None
        self.last: float | None = None

    def add(self, e: dict[str, Any]) -> None:
        t, kind = _num(e.get("time")), e["event"]
        if t is not None:
            self.first = t if self.first is None else min(self.first, t)
            self.last = t if self.last is None else max(self.last, t)
        if kind == "run_start":
            self.row.update(host=e.get("host"), device=e.get("device"),
                            local_world_size=_num(e.get("local_world_size")), pid=_num(e.get("pid")))
            compression = compression_of(e)
            if compression is not None:
                self.row["compression"] = compression
        elif kind == "step":
            self.steps.append([t, _num(e.get("step")), _num(e.get("loss")), _num(e.get("tokens_per_s"))])
            self.row.update(step=_num(e.get("step")), outer_step=_num(e.get("outer_step")), loss=_num(e.get("loss")),
                            tokens_per_s=_num(e.get("tokens_per_s")))
        elif kind == "eval":
            self.evals.append([t, _num(e.get("step")), _num(e.get("loss"))])
            self.row["eval_loss"] = _num(e.get("loss"))
        elif kind == "outer_step":
            self.outer.append([t, _num(e.get("outer_step")), _num(e.get("allreduce_s")), _num(e.get("wire_mbps")),
                               _num(e.get("global_world_size"))])
            self.row.update(outer_step=_num(e.get("outer_step")), allreduce_s=_num(e.get("allreduce_s")),
                            wire_mbps=_num(e.get("wire_mbps")), wire_bytes=_num(e.get("wire_bytes")),
                            mesh_version=_num(e.get("mesh_version")), num_peers=_num(e.get("num_peers")))
        elif kind == "membership":
            self.row["global_rank"] = _num(e.get("global_rank"))

    def rate(self) -> float | None:
        pts = [p for p in self.steps if p[0] is not None and p[1] is not None]
        if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
            return None
        return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


def build_report(paths: Iterable[str]) -> dict[str, Any]:
    """The dashboard document of the runs in the metrics files under `paths`."""
    files = find_metrics(list(paths))
    nodes: dict[str, _Node] = {}
    membership: dict[int, dict[str, Any]] = {}
    skipped = 0
    for path in files:
        events, bad = _events(path)
        skipped += bad
        for e in events:
            uid = str(e.get("node") or path.parent.name)
            nodes.setdefault(uid, _Node(uid)).add(e)
            if e["event"] == "membership" and isinstance(e.get("mesh_version"), int):
                membership.setdefault(e["mesh_version"], {
                    "time": _num(e.get("time")), "mesh_version": e["mesh_version"],
                    "world_size": _num(e.get("global_world_size")), "leader": e.get("leader"),
                    **{k: list(e.get(k) or []) for k in ("joined", "left", "died")}, "from_nodes": True})
    if not any(n.steps for n in nodes.values()):
        raise InvalidInput(f"--from: no step events in {len(files)} metrics file(s); was any step logged?")
    rows = sorted((n.row for n in nodes.values()), key=lambda r: (r["global_rank"] is None, r["global_rank"] or 0,
                                                                   r["uid"]))
    for n in nodes.values():
        n.row["duration_s"] = round(n.last - n.first, 1) if n.first is not None and n.last is not None else None
        rate = n.rate()
        n.row["steps_per_s"] = round(rate, 4) if rate is not None else None
    timeline = [membership[v] for v in sorted(membership)]
    last = timeline[-1] if timeline else {}
    tps = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s") is not None]
    return {"source": "metrics: " + ", ".join(str(p) for p in files), "report": True,
            "time": max((n.last for n in nodes.values() if n.last is not None), default=None),
            "skipped_lines": skipped, "nodes": rows, "membership": timeline,
            "run": {"mesh_version": last.get("mesh_version"), "world_size": last.get("world_size"),
                    "leader": last.get("leader"), "step": max((r.get("step") or 0 for r in rows), default=None),
                    "outer_step": max((r.get("outer_step") or 0 for r in rows), default=None), "total_steps": None,
                    "tokens_per_s": round(sum(tps), 1) if tps else None, "eta_s": None,
                    "states": {"ended": len(rows)}},
            "history": {n.uid: {"steps": _even(n.steps), "outer": _even(n.outer), "eval": _even(n.evals)}
                        for n in nodes.values()}}


def _even(rows: list[list], limit: int = POINTS) -> list[list]:
    """At most about `limit` evenly spaced rows, the last one included (a long run stays a light page)."""
    if len(rows) <= limit:
        return rows
    stride = -(-len(rows) // limit)
    return rows[::stride] + ([rows[-1]] if (len(rows) - 1) % stride else [])
