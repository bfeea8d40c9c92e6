"""Checkpoint directories on a node's disk: one step directory, one committed part per local rank.

    <root>/step-000001200/rank-0/   a zb snapshot (zb.ckpt.format.catalog): files, manifest.json, COMMITTED
    <root>/step-000001200/rank-1/   ...
    <root>/step-000001200/.tmp-rank-1/   a part being written (never read)

Each local rank writes and commits its own part, so no rank waits for another and no collective is
needed in the background. Every part's manifest records `local_world_size`; a checkpoint is complete
when parts rank-0 .. rank-(n-1) are all committed and agree on n. Pruning removes a rank's own parts
only, of the steps zb.ckpt.durable.lineage.plan_prune names (reading this rank's own manifests), so
an older checkpoint is never lost before a newer one of its branch is complete on every rank.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from zb.ckpt.durable.lineage import Entry, Origin, current_lineage, entry_of, plan_prune
from zb.ckpt.format.catalog import check_quick, read_committed, recover_leftovers, remove_snapshot
from zb.ckpt.format.manifest import TMP_PREFIX, Manifest, snapshot_name
from zb.errors import InvalidInput

log = logging.getLogger("zb.ckpt")

_STEP = re.compile(r"step-(\d{9,})")


def part_name(local_rank: int) -> str:
    return f"rank-{local_rank}"


def step_from_name(name: str) -> int | None:
    """The step of a step directory's name, None for any other name."""
    m = _STEP.fullmatch(name)
    return int(m.group(1)) if m else None


def step_dirs(root: Path) -> dict[int, Path]:
    """step -> directory, for every step directory under root (complete or not)."""
    out = {}
    if Path(root).is_dir():
        for entry in os.scandir(root):
            step = step_from_name(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False):
                out[step] = Path(entry.path)
    return out


def part_count(manifest: Manifest) -> int:
    n = manifest.meta.get("local_world_size")
    if not isinstance(n, int) or n < 1:
        raise InvalidInput(f"snapshot {manifest.name} has no valid local_world_size in its manifest")
    return n


def check_complete(step_dir: Path) -> int:
    """Raise InvalidInput unless every local rank's part is committed (marker + sizes); returns n parts."""
    n = part_count(read_committed(step_dir / part_name(0)))
    for rank in range(n):
        m = check_quick(step_dir / part_name(rank))
        if part_count(m) != n:
            raise InvalidInput(f"{step_dir}: parts disagree on the local rank count")
    return n


def complete_steps(root: Path) -> list[int]:
    """Steps whose checkpoint is complete under root (markers and sizes checked), oldest first."""
    return scan_steps(root)[0]


def scan_steps(root: Path) -> tuple[list[int], dict[int, str]]:
    """(complete steps oldest first, {step: why it is not complete}) under root. While a checkpoint
    is being written its step is incomplete too: only a caller that knows nothing is writing (a
    resume) may call those damaged."""
    done, bad = [], {}
    for step, path in sorted(step_dirs(root).items()):
        try:
            check_complete(path)
            done.append(step)
        except (InvalidInput, OSError) as e:
            bad[step] = str(e)
    return done, bad


def clean_own_leftovers(root: Path, local_rank: int) -> list[str]:
    """At start: put back or delete what a crash left of this rank's parts (zb.ckpt.format.catalog
    .recover_leftovers) and drop step directories left empty; returns what was done."""
    done = []
    for path in step_dirs(root).values():
        done += recover_leftovers(path, [part_name(local_rank)])
        if drop_if_empty(path):  # a crash (or a full disk) before any part was committed
            done.append(f"removed the empty {path}")
    return done


def entries(root: Path, local_rank: int = 0, steps: list[int] | None = None) -> dict[int, Entry]:
    """step -> lineage entry of every complete step under root (or of `steps`), read from local rank
    `local_rank`'s part: each rank decides from its own manifests."""
    out = {}
    for step in complete_steps(root) if steps is None else steps:
        try:
            out[step] = entry_of(read_committed(Path(root) / snapshot_name(step) / part_name(local_rank)))
        except (InvalidInput, OSError):
            continue  # removed or replaced since it was listed: not a step to decide by
    return out


def latest_step(root: Path) -> int | None:
    """The step `--ckpt.resume latest` takes first under root: the newest complete step of the
    current branch's lineage (markers and sizes; a resume still verifies the checksums)."""
    line = current_lineage(entries(root))
    return line[-1] if line else None


def prune_own_parts(root: Path, local_rank: int, running: Origin, keep: int, *,
                    keep_tips: bool = True) -> list[tuple[int, str]]:
    """Remove this rank's parts (and leftovers) of the steps lineage.plan_prune names; (step, why) of each."""
    dirs = step_dirs(root)
    doomed = plan_prune(entries(root, local_rank), running, keep, keep_tips=keep_tips, incomplete=list(dirs))
    for step, _ in doomed:
        path = dirs[step]
        own = path / part_name(local_rank)
        if own.exists():
            remove_snapshot(own)
        shutil.rmtree(path / f"{TMP_PREFIX}{part_name(local_rank)}", ignore_errors=True)
        drop_if_empty(path)  # the last rank to leave removes the step directory
    return doomed


def drop_if_empty(step_dir: Path) -> bool:
    """Remove a step directory that holds nothing (a write that failed before any part, a prune)."""
    try:
        step_dir.rmdir()
        return True
    except OSError:
        return False


def resolve_part(path: Path, local_rank: int) -> Path:
    """A user-given checkpoint path (a step directory or one of its parts) -> this rank's part."""
    path = Path(path)
    if (path / part_name(local_rank)).is_dir() or _STEP.fullmatch(path.name):
        return path / part_name(local_rank)
    if re.fullmatch(r"rank-\d+", path.name):
        return path.parent / part_name(local_rank)
    return path / part_name(local_rank)
