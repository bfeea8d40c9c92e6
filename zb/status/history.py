"""The dashboard's memory: longer curves than the store keeps, by merging what each refresh reads.

Each node's store history holds only its last few points (zb.status.record); the serving process
merges every refresh into bounded per-node series (at most `points` each: past that, every other point
goes), so a dashboard left open draws the whole run at a growing stride, and one opened late still
starts with the recent past.
Membership changes are merged by mesh version, from the nodes' histories and from what the
dashboard itself saw change.
"""

from __future__ import annotations

import threading
from typing import Any

SERIES = ("steps", "outer", "eval")   # each row starts with the node's time, then its step or outer step


class _Series:
    """One node's curve: points newer than the last one kept, every `stride`-th of them; past `limit`
    points every other one goes and the stride doubles, so the whole run stays drawn evenly."""

    def __init__(self, limit: int) -> None:
        self.limit, self.stride, self.seen = limit, 1, 0
        self.rows: list[list] = []
        self.tail: list | None = None        # the newest point when the stride skipped it (drawn anyway)
        self.newest: tuple = (float("-inf"), float("-inf"))

    def points(self) -> list[list]:
        return self.rows + ([self.tail] if self.tail is not None else [])

    def add(self, rows: list[list]) -> None:
        for row in sorted(rows, key=_order):
            if _order(row) <= self.newest:
                continue             # already seen (each refresh reads the node's last points again)
            self.newest = _order(row)
            self.seen += 1
            self.tail = None if self.seen % self.stride == 0 else row
            if self.tail is None:
                self.rows.append(row)
        if len(self.rows) > self.limit:
            self.rows = self.rows[::2]
            self.stride *= 2


def _order(row: list) -> tuple:
    return (row[0] if isinstance(row[0], (int, float)) else float("-inf"),
            row[1] if isinstance(row[1], (int, float)) else float("-inf"))


class RunHistory:
    def __init__(self, points: int = 2000, changes: int = 500) -> None:
        self.points, self.changes = points, changes
        self._series: dict[str, dict[str, _Series]] = {}
        self._membership: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def merge(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Fold one document in; returns it with the merged history and membership timeline."""
        with self._lock:
            for uid, hist in (doc.get("history") or {}).items():
                series = self._series.setdefault(uid, {name: _Series(self.points) for name in SERIES})
                for name in SERIES:
                    series[name].add(hist.get(name, []))
                for change in hist.get("membership", []):
                    self._add_change(change)
            self._note_world(doc)
            merged = {uid: {name: s.points() for name, s in series.items()} for uid, series in self._series.items()}
            timeline = [self._membership[v] for v in sorted(self._membership)]
        return dict(doc, history=merged, membership=timeline)

    def _add_change(self, change: dict[str, Any]) -> None:
        version = change.get("mesh_version")
        if isinstance(version, int) and (version not in self._membership or
                                         not self._membership[version].get("from_nodes")):
            self._membership[version] = dict(change, from_nodes=True)
        while len(self._membership) > self.changes:
            del self._membership[min(self._membership)]

    def _note_world(self, doc: dict[str, Any]) -> None:
        run = doc.get("run") or {}
        version = run.get("mesh_version")
        if isinstance(version, int) and version not in self._membership:
            self._membership[version] = {"time": doc.get("time"), "mesh_version": version,
                                         "world_size": run.get("world_size"), "leader": run.get("leader"),
                                         "joined": [], "left": [], "died": [], "from_nodes": False}

