"""Where a training node keeps its live-recovery snapshots, and which directory a sidecar serves.

A node with ckpt.live_recovery keeps them in `<ckpt.ram_dir>/live/<node id>/r<local rank>/`: its
local ranks hold different stripes of the outer state, so each rank has its own directory, its own
sidecar and its own address in the store (`ckpt_serve/<node id>/r<local rank>`, the key a joiner's
rank of the same number reads). The guides tell users to serve `<ckpt.ram_dir>/live/<node id>`:
`served_dir` finds the rank directory under it, so both the node's directory and the rank's work.
"""

from __future__ import annotations

import re
from pathlib import Path

from zb.ckpt.format.catalog import list_snapshots
from zb.errors import InvalidInput

_RANK = re.compile(r"r(\d+)")


def node_dir(ram_dir: str | Path, uid: str) -> Path:
    return Path(ram_dir) / "live" / uid


def rank_dir(ram_dir: str | Path, uid: str, local_rank: int) -> Path:
    return node_dir(ram_dir, uid) / f"r{local_rank}"


def sidecar_id(uid: str, local_rank: int) -> str:
    """The name a rank's sidecar is published under (zb.ckpt.sidecar.publish.address_key)."""
    return f"{uid}/r{local_rank}"


def rank_of(directory: Path) -> int:
    """The local rank whose snapshots `directory` holds: its `r<N>` name, else 0 (a plain directory
    of snapshots is taken for a node of one local rank)."""
    found = _RANK.fullmatch(directory.name)
    return int(found.group(1)) if found else 0


def served_dir(root: Path) -> Path:
    """`root` itself when it holds committed snapshots (or nothing to descend into); its one rank
    directory when it is a node's live directory. A node of several local ranks needs one sidecar
    per rank: refused in one line naming them."""
    ranks = [] if list_snapshots(root) else sorted(
        (p for p in root.iterdir() if _RANK.fullmatch(p.name) and p.is_dir() and not p.is_symlink()),
        key=lambda p: int(p.name[1:]))
    if not ranks:
        return root
    if len(ranks) > 1:
        raise InvalidInput(f"{root} holds the live snapshots of {len(ranks)} local ranks "
                           f"({', '.join(p.name for p in ranks)}) and one sidecar serves one rank: start one "
                           f"zb ckpt-serve per rank, with --dir {ranks[0]} and so on")
    return ranks[0]
