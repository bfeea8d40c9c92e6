"""Which checkpoints belong together: branches, the step `latest` takes, and what pruning may delete.

A run that resumes from the newest step of its branch continues that branch. A run that starts from
scratch, or resumes from an older step (a named one, an agreed one, or `latest` skipping a damaged
newer one), starts a new branch whose base is the step it resumed from. Every part's manifest
records its branch under `meta["lineage"]`: `{"branch": id, "base": {"step": s, "branch": id} | null}`.
Checkpoints written before lineage existed have none: together they form one branch, LEGACY.

    current branch   the branch of the newest checkpoint written (the manifest's `created`)
    lineage          a branch's steps, its base, and the base's branch up to the base, and so on
    latest           the newest complete step of the current branch's lineage
    pruning          keeps the newest `keep` steps of the running branch's lineage, the base until a
                     newer step of the branch is complete, and the newest step (tip) of every other
                     branch; it deletes the other steps of other branches, each with its reason

A branch's step written again by another branch (a new run reaching the same step) belongs to the
new one from then on. Torch-free: `zb ckpt ls` uses it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from zb.ckpt.format.manifest import Manifest

LEGACY = ""        # the branch of checkpoints written before lineage
META_KEY = "lineage"
_ID = re.compile(r"[0-9a-f]{1,32}")


@dataclass(frozen=True)
class Origin:
    """What a run writes: its branch, and the step (of which branch) it started from."""

    branch: str
    base: tuple[int, str] | None

    def to_json(self) -> dict[str, Any]:
        base = {"step": self.base[0], "branch": self.base[1]} if self.base else None
        return {"branch": self.branch, "base": base}


@dataclass(frozen=True)
class Entry:
    """One complete checkpoint as lineage sees it."""

    step: int
    origin: Origin
    created: float

    @property
    def branch(self) -> str:
        return self.origin.branch


def origin_of(meta: Any) -> Origin:
    """The lineage a manifest's meta records, checked for type and range; LEGACY when it has none or
    it does not parse (a checkpoint is never unusable for its lineage)."""
    doc = meta.get(META_KEY) if isinstance(meta, dict) else None
    if not isinstance(doc, dict) or not _is_id(doc.get("branch")):
        return Origin(LEGACY, None)
    base = doc.get("base")
    if isinstance(base, dict) and _is_step(base.get("step")) and _is_id(base.get("branch"), legacy=True):
        return Origin(doc["branch"], (base["step"], base["branch"]))
    return Origin(doc["branch"], None)


def _is_id(value: Any, legacy: bool = False) -> bool:
    return isinstance(value, str) and (bool(_ID.fullmatch(value)) or (legacy and value == LEGACY))


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def entry_of(manifest: Manifest) -> Entry:
    return Entry(manifest.step, origin_of(manifest.meta), manifest.created)


def merge(*sources: Iterable[Entry]) -> dict[int, Entry]:
    """step -> entry over several copies (disk, remote); for a step in both, the newer write wins."""
    out: dict[int, Entry] = {}
    for source in sources:
        for e in source:
            if e.step not in out or e.created > out[e.step].created:
                out[e.step] = e
    return out


def current_branch(entries: dict[int, Entry]) -> str | None:
    """The branch of the checkpoint written last; None when there is none."""
    if not entries:
        return None
    newest = max(entries.values(), key=lambda e: (e.created, e.step))
    return newest.branch


def base_of(entries: dict[int, Entry], branch: str) -> tuple[int, str] | None:
    """The base a branch records (any of its entries; they agree)."""
    return next((e.origin.base for e in entries.values() if e.branch == branch), None)


def lineage(entries: dict[int, Entry], branch: str, base: tuple[int, str] | None) -> list[int]:
    """The steps of `branch` and of its ancestors up to each base, oldest first. A base that is gone,
    or was written again by another branch, ends the walk."""
    steps = {s for s, e in entries.items() if e.branch == branch}
    seen = {branch}
    while base is not None:
        step, parent = base
        at = entries.get(step)
        if at is None or at.branch != parent or parent in seen:
            break
        seen.add(parent)
        steps |= {s for s, e in entries.items() if e.branch == parent and s <= step}
        base = at.origin.base
    return sorted(steps)


def current_lineage(entries: dict[int, Entry]) -> list[int]:
    """The steps `latest` chooses from, oldest first: the current branch's lineage."""
    branch = current_branch(entries)
    return [] if branch is None else lineage(entries, branch, base_of(entries, branch))


def tips(entries: dict[int, Entry]) -> dict[str, int]:
    """branch -> its newest complete step."""
    out: dict[str, int] = {}
    for s, e in entries.items():
        out[e.branch] = max(s, out.get(e.branch, s))
    return out


def continue_or_fork(entries: dict[int, Entry], resumed: Entry | None, new_branch: str) -> Origin:
    """The origin of a run that resumed from `resumed` (None: from scratch, or its state came from
    elsewhere): the same branch when it resumed that branch's newest step, else `new_branch` based
    on the resumed step."""
    if resumed is None:
        return Origin(new_branch, None)
    newer = [s for s, e in entries.items() if e.branch == resumed.branch and s > resumed.step]
    if not newer:
        return resumed.origin
    return Origin(new_branch, (resumed.step, resumed.branch))


def plan_prune(entries: dict[int, Entry], running: Origin, keep: int, *, keep_tips: bool = True,
               incomplete: Iterable[int] = ()) -> list[tuple[int, str]]:
    """(step, why) of every checkpoint pruning deletes, oldest first. `keep` 0 keeps every one.
    `keep_tips` False: other branches go whole (RAM copies that only fed ckpt.path, which keeps them).
    `incomplete`: steps with a part missing; those older than every step kept go too (a crash's leftovers;
    a step still being written is newer than what is kept)."""
    if keep < 1:
        return []
    line = lineage(entries, running.branch, running.base)
    kept = set(line[-keep:])
    own = [s for s in line if entries[s].branch == running.branch]
    if running.base is not None and not any(s > running.base[0] for s in own):
        kept.add(running.base[0])  # the step this run resumed from, until the branch has a newer one
    doomed = [(s, f"older than the newest {keep} of this run's branch") for s in line if s not in kept]
    newest = tips(entries)
    for s, e in entries.items():
        if s in line or (keep_tips and newest[e.branch] == s):
            continue
        doomed.append((s, f"on a branch this run left (its newest step, {newest[e.branch]}, is kept)" if keep_tips
                       else "a copy of another branch (ckpt.path keeps what it needs)"))
    oldest_kept = min(kept, default=None)
    doomed += [(s, "incomplete, and older than every step kept") for s in incomplete
               if oldest_kept is not None and s < oldest_kept and s not in entries]
    return sorted(doomed)


def describe(origin: Origin) -> str:
    """One phrase for logs: 'branch 3fa2c1 (from step 20)'."""
    name = origin.branch or "legacy"
    return f"branch {name}" + (f" (from step {origin.base[0]})" if origin.base else "")
