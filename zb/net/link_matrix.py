"""A link matrix measured before the run: the `zb iperf-mesh --json` document, read back.

`elastic.link_matrix = path` hands it to a run so the ring can be ordered by it (zb.elastic.ring).
The document's ranks are iperf-mesh's, not the run's: a node is matched to a row by its unique id
when iperf-mesh was given `--node-id` (the document's `nodes`), else by the address its gloo
traffic uses (the host part of the document's `hosts`), when exactly one row has that address.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from zb.errors import InvalidInput


@dataclass(frozen=True)
class LinkMatrix:
    source: str                           # the file it came from, for messages
    addrs: list[str]                      # host part of each rank's advertised address
    names: list[str | None]               # unique id of each rank (iperf-mesh --node-id), or None
    mbps: list[list[float | None]]        # [sender][receiver]; None: failed or not measured

    def index_of(self, uid: str, addr: str | None) -> int | None:
        """This node's row: by unique id, else by address when exactly one row has it."""
        if uid in self.names:
            return self.names.index(uid)
        if addr is not None and self.addrs.count(addr) == 1:
            return self.addrs.index(addr)
        return None

    def describe(self) -> str:
        return ", ".join(f"{n or '?'}@{a}" for n, a in zip(self.names, self.addrs))


def parse_link_matrix(text: str, source: str) -> LinkMatrix:
    """The matrix in `text`; InvalidInput naming `source` and what is wrong."""
    def bad(why: str) -> InvalidInput:
        return InvalidInput(f"elastic.link_matrix {source}: {why}; write it with `zb iperf-mesh --json > FILE` "
                            "on the run's hosts")

    try:
        doc = json.loads(text)
    except ValueError as e:
        raise bad(f"not JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("matrix_mbps"), list) or not isinstance(doc.get("hosts"), dict):
        raise bad("not a zb iperf-mesh document (no matrix_mbps and hosts)")
    matrix, n = doc["matrix_mbps"], len(doc["matrix_mbps"])
    if n < 2 or any(not isinstance(row, list) or len(row) != n for row in matrix):
        raise bad(f"matrix_mbps is not a square matrix of at least 2 x 2 (rows: {n})")
    mbps = [[_rate(v, bad, a, b) for b, v in enumerate(row)] for a, row in enumerate(matrix)]
    try:
        addrs = [str(doc["hosts"][str(r)]).rpartition(":")[0].strip("[]") for r in range(n)]
    except KeyError as e:
        raise bad(f"hosts has no entry for rank {e.args[0]}") from None
    names = doc.get("nodes") or {}
    if not isinstance(names, dict):
        raise bad("nodes is not an object of rank -> unique id")
    return LinkMatrix(source, addrs, [names.get(str(r)) for r in range(n)], mbps)


def _rate(value, bad, a: int, b: int) -> float | None:
    if a == b or value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise bad(f"matrix_mbps[{a}][{b}] = {value!r} is not a rate in Mbit/s")
    return float(value)


def load_link_matrix(path: str) -> tuple[LinkMatrix, str]:
    """(matrix, the file's text); InvalidInput when it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise InvalidInput(f"elastic.link_matrix {path}: cannot read it ({e.strerror or e}); "
                           "give the file `zb iperf-mesh --json` wrote, or unset the key") from None
    return parse_link_matrix(text, path), text
