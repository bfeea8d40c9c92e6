"""Checkpoint directories on a node's disk: one step directory, one committed part per local rank.

    <root>/step-000001200/rank-0/   a zb snapshot (zb.ckpt.format.catalog): files, manifest.json, COMMITTED
    <root>/step-000001200/rank-1/   ...
    <root>/step-000001200/.tmp-rank-1/   a part being written (never read)

Each local rank writes and commits its own part, so no rank waits for another and no collective is
needed in the background. Every part's manifest records `local_world_size`; a checkpoint is complete
when parts rank-0 .. rank-(n-1) are all committed and agree on n. Pruning removes a rank's own parts
only, and only of steps older than the newest `keep` complete checkpoints, so an older checkpoint is
never lost before a newer one is complete on every rank.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from zb.ckpt.format.catalog import check_quick, read_committed, recover_leftovers, remove_snapshot
from zb.ckpt.format.manifest import TMP_PREFIX, Manifest
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
        try:
            path.rmdir()  # only when empty: a crash before any part was committed
            done.append(f"removed the empty {path}")
        except OSError:
            pass
    return done


def prune_own_parts(root: Path, local_rank: int, keep: int) -> list[int]:
    """Remove this rank's parts (and leftovers) of steps older than the newest `keep` complete ones."""
    kept = complete_steps(root)[-keep:]
    if len(kept) < keep or not kept:
        return []
    removed = []
    for step, path in step_dirs(root).items():
        if step >= kept[0]:
            continue
        own = path / part_name(local_rank)
        if own.exists():
            remove_snapshot(own)
        shutil.rmtree(path / f"{TMP_PREFIX}{part_name(local_rank)}", ignore_errors=True)
        try:
            path.rmdir()  # the last rank to leave removes the step directory
        except OSError:
            pass
        removed.append(step)
    return removed


def resolve_part(path: Path, local_rank: int) -> Path:
    """A user-given checkpoint path (a step directory or one of its parts) -> this rank's part."""
    path = Path(path)
    if (path / part_name(local_rank)).is_dir() or _STEP.fullmatch(path.name):
        return path / part_name(local_rank)
    if re.fullmatch(r"rank-\d+", path.name):
        return path.parent / part_name(local_rank)
    return path / part_name(local_rank)
