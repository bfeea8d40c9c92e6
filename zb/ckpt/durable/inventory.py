"""What checkpoints a directory holds, and whether one is intact: `zb ckpt ls` and `zb ckpt verify`.

    listing = list_checkpoints("/data/ckpt")              # or ckpt.ram_dir, or remote="s3://bucket/run-42"
    report = verify_checkpoint("/data/ckpt/step-000000100")   # every file's size and sha256, per part

A listing reads markers, manifests and file sizes (zb.ckpt.durable.layout.scan_steps), never the tensors,
so it is quick on any size of model; `latest` is the step `--ckpt.resume latest` takes, unless its
checksums fail when it loads (then the one before): `verify_checkpoint` hashes everything. Torch-free.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zb.ckpt.durable.agree import newest_common_step
from zb.ckpt.durable.layout import part_name, scan_steps, step_dirs, step_from_name
from zb.ckpt.durable.lineage import Entry, Origin, current_branch, current_lineage, entry_of, merge, tips
from zb.ckpt.format.catalog import read_committed, verify_snapshot
from zb.ckpt.format.manifest import TMP_PREFIX, Manifest
from zb.errors import EnvironmentFailure, InvalidInput, ZbError, missing_extra
from zb.position import JSON_KEY, RunPosition
from zb.stop_signals import worker_pool

_PART = re.compile(r"rank-(\d+)")
WHAT = "a ckpt.path (step-NNNNNNNNN directories), a ckpt.ram_dir or a directory of node directories holding them"


@dataclass
class StepEntry:
    step: int
    path: str
    where: str                   # "local" or "remote"
    complete: bool               # every local rank's part committed, sizes as the manifests say
    why: str | None              # why it is not complete
    parts: int                   # committed parts found
    ranks: int | None            # local ranks that wrote it (from a committed part), None if none is readable
    bytes: int                   # everything under the step directory
    position: dict | None        # RunPosition: step, outer_step, tokens, run_tokens
    final: bool                  # written at the end of a run (its last step, or a stop)
    branch: str | None = None    # its branch (zb.ckpt.durable.lineage; "" written before lineage), None if unreadable
    base: dict | None = None     # {"step", "branch"} its branch started from; None: from scratch
    created: float = 0.0         # when it was written (its manifest)


@dataclass
class Branch:
    id: str                      # "" for checkpoints written before lineage
    base: int | None             # the step it started from (None: from scratch)
    base_branch: str | None
    steps: list[int]             # its complete steps
    current: bool                # the branch `latest` takes from (the one written last)


@dataclass
class NodeListing:
    node: str | None             # None: the directory itself holds the step directories
    roots: list[str]
    steps: list[StepEntry] = field(default_factory=list)
    latest: int | None = None    # the step --ckpt.resume latest takes (local or remote)
    lineage: list[int] = field(default_factory=list)   # the steps latest chooses from: the current branch's lineage
    branches: list[Branch] = field(default_factory=list)


@dataclass
class Listing:
    sources: list[str]
    nodes: list[NodeListing]
    common: int | None           # several nodes: the newest step complete on each (what a restart agrees on)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def meta_facts(manifest: Manifest) -> tuple[int | None, dict | None, bool]:
    """(local ranks, run position, final) from a part's manifest; None where it does not say."""
    meta = manifest.meta
    ranks = meta.get("local_world_size") if isinstance(meta.get("local_world_size"), int) else None
    try:
        position = RunPosition.from_json(meta.get(JSON_KEY)).to_json()
    except ValueError:
        position = None
    total = (meta.get("config") or {}).get("optim", {}).get("total_steps") if isinstance(meta.get("config"), dict) \
        else None
    # A final checkpoint of a step the interval had saved is not written again: its meta says false.
    final = meta.get("final") is True or (position is not None and isinstance(total, int)
                                          and position["step"] >= total)
    return ranks, position, final


def _part_dirs(step_dir: Path) -> dict[int, Path]:
    out = {}
    for entry in os.scandir(step_dir):
        m = _PART.fullmatch(entry.name)
        if m and entry.is_dir(follow_symlinks=False):
            out[int(m.group(1))] = Path(entry.path)
    return dict(sorted(out.items()))


def _disk_bytes(path: Path) -> int:
    total = 0
    for top, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(top, name)).st_size
            except OSError:
                pass
    return total


def _local_entry(step: int, path: Path, why: str | None) -> StepEntry:
    manifests = []
    for part in _part_dirs(path).values():
        try:
            manifests.append(read_committed(part))
        except (InvalidInput, OSError):
            pass
    ranks, position, final = meta_facts(manifests[0]) if manifests else (None, None, False)
    if why is not None:
        why = _unfinished(path, manifests) or why
    return StepEntry(step, str(path), "local", why is None, why, len(manifests), ranks, _disk_bytes(path), position,
                     final, *_lineage_facts(manifests))


def _lineage_facts(manifests: list[Manifest]) -> tuple[str | None, dict | None, float]:
    if not manifests:
        return None, None, 0.0
    e = entry_of(manifests[0])
    return e.branch, e.origin.to_json()["base"], e.created


def _unfinished(step_dir: Path, committed: list[Manifest]) -> str | None:
    """Why a step is incomplete when a part is only being written: name the `.tmp-` copy, not a missing part."""
    done = {m.name for m in committed}
    for entry in sorted(os.scandir(step_dir), key=lambda e: e.name):
        if entry.name.startswith(TMP_PREFIX) and _PART.fullmatch(entry.name[len(TMP_PREFIX):]):
            name = entry.name[len(TMP_PREFIX):]
            if name not in done:
                return f"{name} is still being written or was cut short (only {entry.name} exists)"
    return None


def check_directory(path: Path, what: str = "directory") -> Path:
    path = Path(path)
    if not path.exists():
        raise InvalidInput(f"{what} {path} does not exist")
    if not path.is_dir():
        raise InvalidInput(f"{what} {path} is not a directory")
    return path


def local_roots(path: Path) -> dict[str | None, Path]:
    """{node id or None: a directory holding step directories} for a ckpt.path, a node's RAM
    directory, or a directory of node directories (ckpt.ram_dir, a mirrored remote copy)."""
    path = check_directory(path)
    if step_from_name(path.name) is not None or _PART.fullmatch(path.name):
        raise InvalidInput(f"{path} is a checkpoint, not a directory of checkpoints: check it with zb ckpt verify "
                           f"{path}, or list the directory holding it")
    if step_dirs(path):
        return {None: path}
    nodes: dict[str | None, Path] = {e.name: Path(e.path) for e in sorted(os.scandir(path), key=lambda e: e.name)
                                     if not e.name.startswith(".") and e.is_dir(follow_symlinks=False) and step_dirs(Path(e.path))}
    if not nodes:
        raise InvalidInput(f"{path} holds no zb checkpoints (no step-NNNNNNNNN directories in it or in the "
                           f"directories below it); name {WHAT}")
    return nodes


def list_checkpoints(path: str | Path | None = None, remote: str | None = None) -> Listing:
    """Every step under `path` and/or the fsspec URL `remote`, per node; a node found in both is one
    node whose `latest` considers both copies, as a resume does."""
    if path is None and remote is None:
        raise InvalidInput(f"name a directory to list ({WHAT}), a --remote URL, or both")
    nodes: dict[str | None, NodeListing] = {}
    sources = []
    if path is not None:
        sources.append(str(path))
        for node, root in local_roots(Path(path)).items():
            done, bad = scan_steps(root)
            listing = nodes.setdefault(node, NodeListing(node, []))
            listing.roots.append(str(root))
            listing.steps += [_local_entry(s, p, None if s in done else bad.get(s, "appeared while it was listed"))
                              for s, p in sorted(step_dirs(root).items())]
    if remote is not None:
        sources.append(remote)
        for node, remote_root, entries in _remote_listings(remote):
            listing = nodes.setdefault(node, NodeListing(node, []))
            listing.roots.append(remote_root)
            listing.steps += entries
    for listing in nodes.values():
        listing.steps.sort(key=lambda e: (e.step, e.where))
        _add_lineage(listing)
    ordered = sorted(nodes.values(), key=lambda n: n.node or "")
    named = {n.node: n.lineage for n in ordered if n.node is not None}
    common = newest_common_step(named) if len(named) > 1 else None
    return Listing(sources, ordered, common)


def _add_lineage(listing: NodeListing) -> None:
    """The node's branches, the lineage `latest` chooses from, and `latest`, as a resume decides them."""
    found = merge([Entry(e.step, Origin(e.branch, (e.base["step"], e.base["branch"]) if e.base else None), e.created)
                   for e in listing.steps if e.complete and e.branch is not None])
    listing.lineage = current_lineage(found)
    listing.latest = listing.lineage[-1] if listing.lineage else None
    current, newest = current_branch(found), tips(found)
    for branch in sorted(newest, key=lambda b: newest[b]):
        steps = sorted(s for s, e in found.items() if e.branch == branch)
        base = found[steps[0]].origin.base
        listing.branches.append(Branch(branch, base[0] if base else None, base[1] if base else None, steps,
                                       branch == current))


def _remote_listings(url: str) -> list[tuple[str | None, str, list[StepEntry]]]:
    """(node or None, node URL, its steps) under an fsspec URL: a node's remote directory or
    ckpt.remote.path itself (one directory per node). Unreachable: EnvironmentFailure (exit 1)."""
    from zb.ckpt.durable.remote import REMOTE_EXTRA, remote_fs

    try:
        fs, root = remote_fs(url)
    except ImportError as e:
        scheme = url.split("://", 1)[0].lower()
        if scheme in REMOTE_EXTRA:
            raise missing_extra(f"--remote {url!r}", REMOTE_EXTRA[scheme], "remote") from None
        raise EnvironmentFailure(f"--remote {url!r}: {e}") from None
    except ValueError as e:
        raise InvalidInput(f"--remote {url!r}: {e}") from None
    try:
        if not fs.exists(root):
            raise InvalidInput(f"--remote {url} does not exist")
        children = _remote_dirs(fs, root)
        nodes: dict[str | None, tuple[str, str]]
        if any(step_from_name(c) is not None for c in children):
            nodes = {None: (root, url)}
        else:
            nodes = {c: (f"{root}/{c}", f"{url.rstrip('/')}/{c}") for c in children if not c.startswith(".")
                     and any(step_from_name(g) is not None for g in _remote_dirs(fs, f"{root}/{c}"))}
        if not nodes:
            raise InvalidInput(f"--remote {url} holds no zb checkpoints (no step-NNNNNNNNN directories in it or in "
                               "the directories below it); name ckpt.remote.path or one node's directory in it")
        return [(node, node_url, _remote_entries(fs, path, node_url)) for node, (path, node_url) in nodes.items()]
    except ZbError:
        raise
    except Exception as e:  # noqa: BLE001 - fsspec backends raise their own error types
        raise EnvironmentFailure(f"--remote {url}: cannot read it ({type(e).__name__}: {e})") from None


def _remote_dirs(fs, path: str) -> list[str]:
    return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(path, detail=True)
                  if e.get("type") == "directory")


def _remote_entries(fs, root: str, url: str) -> list[StepEntry]:
    from zb.ckpt.durable.remote import read_remote_manifest, remote_scan

    done, bad = remote_scan(url)
    entries = []
    for name in _remote_dirs(fs, root):
        step = step_from_name(name)
        if step is None:
            continue
        manifests = []
        for part in _remote_dirs(fs, f"{root}/{name}"):
            if _PART.fullmatch(part):
                try:
                    manifests.append(read_remote_manifest(fs, f"{root}/{name}/{part}"))
                except Exception:  # noqa: BLE001 - an uncommitted part is counted as missing
                    pass
        ranks, position, final = meta_facts(manifests[0]) if manifests else (None, None, False)
        why = None if step in done else bad.get(step, "not every part is committed")
        entries.append(StepEntry(step, f"{url.rstrip('/')}/{name}", "remote", why is None, why, len(manifests),
                                 ranks, int(fs.du(f"{root}/{name}", total=True)), position, final,
                                 *_lineage_facts(manifests)))
    return entries


# -- verify ------------------------------------------------------------------------------------

@dataclass
class PartCheck:
    rank: int
    path: str
    ok: bool
    why: str | None
    bytes: int                   # checked (the manifest's files)


@dataclass
class VerifyReport:
    step_dir: str
    step: int | None
    ranks: int | None            # local ranks that wrote the checkpoint; None when no part says
    parts: list[PartCheck]
    ignored: list[str] = field(default_factory=list)   # parts beyond the rank count (another run's)

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.parts)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _resolve(path: Path, step: int | None) -> tuple[Path, list[int] | None]:
    """(step directory, the ranks to check or None for all) of what `zb ckpt verify` names."""
    path = check_directory(path, "checkpoint")
    is_part = _PART.fullmatch(path.name) and step_from_name(path.parent.name) is not None
    is_step = step_from_name(path.name) is not None or (path / part_name(0)).is_dir()
    if step is not None:
        if is_part or is_step:
            raise InvalidInput(f"--step {step}: {path} is a checkpoint already; --step picks one under a "
                               "checkpoint root (zb ckpt verify DIR --step N)")
        steps = step_dirs(path)
        if step not in steps:
            have = ", ".join(map(str, sorted(steps))) or "none"
            raise InvalidInput(f"no checkpoint step {step} under {path} (its steps: {have})")
        return steps[step], None
    if is_part:
        part = _PART.fullmatch(path.name)
        assert part is not None  # is_part says it matched
        return path.parent, [int(part.group(1))]
    if is_step:
        return path, None
    steps = step_dirs(path)
    if steps:
        raise InvalidInput(f"{path} is a checkpoint root: name one of its steps with --step N (its steps: "
                           f"{', '.join(map(str, sorted(steps)))}) or give a step directory")
    raise InvalidInput(f"{path} is not a zb checkpoint (no rank-N parts, no step-NNNNNNNNN directories); name a "
                       "step directory (<ckpt.path>/step-NNNNNNNNN), one of its rank-N parts, or DIR --step N")


def _check_part(part: Path, rank: int, step: int | None, ranks: int | None) -> PartCheck:
    why: str | None
    if not part.is_dir():
        tmp = part.parent / f"{TMP_PREFIX}{part.name}"
        why = f"{part} is missing" + (f" ({tmp.name} is a copy being written or cut short)" if tmp.exists() else "")
        return PartCheck(rank, str(part), False, why, 0)
    try:
        manifest = verify_snapshot(part)
    except (InvalidInput, OSError) as e:
        return PartCheck(rank, str(part), False, str(e), 0)
    own_ranks, position, _ = meta_facts(manifest)
    why = None
    if step is not None and manifest.step != step:
        why = f"{part}: its manifest is of step {manifest.step}, its directory of step {step}"
    elif position is None or position["step"] != manifest.step:
        why = f"{part}: the manifest's run position ({position}) does not match its step {manifest.step}"
    elif ranks is not None and own_ranks != ranks:
        why = f"{part}: written by {own_ranks} local rank(s), the other parts by {ranks}"
    return PartCheck(rank, str(part), why is None, why, manifest.total_bytes)


def verify_checkpoint(path: str | Path, step: int | None = None) -> VerifyReport:
    """Check every file of every part (or of the one part named) against its manifest: marker, size,
    sha256, and the manifest's step and rank count. InvalidInput (exit 2) when `path` names no checkpoint."""
    step_dir, only = _resolve(Path(path), step)
    dir_step = step_from_name(step_dir.name)
    found = _part_dirs(step_dir)
    ranks = None
    for part in found.values():
        try:
            ranks = meta_facts(read_committed(part))[0]
            break
        except (InvalidInput, OSError):
            continue
    wanted = only if only is not None else list(range(ranks or max(found, default=0) + 1))
    # An interrupted verify does not wait for the parts still hashing (zb.stop_signals).
    with worker_pool(max(1, min(len(wanted), os.cpu_count() or 1, 8)), "zb-verify") as pool:
        checks = list(pool.map(lambda r: _check_part(step_dir / part_name(r), r, dir_step, ranks), wanted))
    ignored = [str(p) for r, p in found.items() if only is None and ranks is not None and r >= ranks]
    if dir_step is None:
        dir_step = next((read_committed(Path(c.path)).step for c in checks if c.ok), None)
    return VerifyReport(str(step_dir), dir_step, ranks, checks, ignored)
