"""The dashboard's memory: longer curves than the store keeps, by merging what each refresh reads.

Each node's store history holds only its last few points (zb.status.record); the serving process
merges every refresh into bounded per-node series (`points` per series), so a dashboard left open
draws the whole run at a growing stride, and one opened late still starts with the recent past.
Membership changes are merged by mesh version, from the nodes' histories and from what the
dashboard itself saw change.
"""

from __future__ import annotations

import threading
from typing import Any

SERIES = {"steps": 1, "outer": 1, "eval": 1}   # series name -> index of its ordering key (step / outer step)


class RunHistory:
    def __init__(self, points: int = 2000, changes: int = 500) -> None:
        self.points, self.changes = points, changes
        self._series: dict[str, dict[str, dict[tuple, list]]] = {}    # uid -> series -> {(time, key): row}
        self._membership: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def merge(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Fold one document in; returns it with the merged history and membership timeline."""
        with self._lock:
            for uid, hist in (doc.get("history") or {}).items():
                series = self._series.setdefault(uid, {name: {} for name in SERIES})
                for name, key_index in SERIES.items():
                    rows = series[name]
                    for row in hist.get(name, []):
                        rows[(row[0], row[key_index])] = row
                    if len(rows) > self.points:
                        self._thin(rows)
                for change in hist.get("membership", []):
                    self._add_change(change)
            self._note_world(doc)
            merged = {uid: {name: sorted(rows.values(), key=_time_key) for name, rows in series.items()}
                      for uid, series in self._series.items()}
            timeline = [self._membership[v] for v in sorted(self._membership)]
        return dict(doc, history=merged, membership=timeline)

    def _thin(self, rows: dict[tuple, list]) -> None:
        """Drop every other point of the older half: recent points stay dense, the whole run stays drawn."""
        ordered = sorted(rows, key=lambda k: (k[0] is None, k[0] or 0))
        old = ordered[: len(ordered) // 2]
        for key in old[1::2]:
            del rows[key]

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


def _time_key(row: list) -> tuple:
    return (row[0] is None, row[0] or 0, row[1] or 0)
