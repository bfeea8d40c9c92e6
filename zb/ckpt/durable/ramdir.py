"""Who owns a directory under ckpt.ram_dir (RAM, /dev/shm by default), and removing it when its
owners are gone, so RAM copies do not pile up run after run until /dev/shm is full.

Each process that stages into a node directory (`<ram_dir>/<node id>/`, `<ram_dir>/live/<node
id>/`, ...) claims it with an owner file `.zb-owner-<pid>` holding its pid, the process start time
(so a reused pid is not mistaken for the owner) and the host. At its end a process removes what it
wrote and its owner file, and the last one out removes the directory (`release`). A process killed
with SIGKILL cannot; the next run on the machine removes directories whose every owner is dead
(`sweep_stale`), and never one with a live owner, another host's owner, or no owner file (written
by something else, or just being created).

Nor one that holds the only complete copy of a checkpoint, whatever ended its run (a second Ctrl-C,
SIGKILL, a power cut while the copy to ckpt.path was running): the owner file records the run's
ckpt.path, and a complete step in RAM newer than every complete step there is kept (`ram_only_steps`)
until a run of that node copies it to ckpt.path at its start (zb.ckpt.durable.manager).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
from collections.abc import Sequence
from pathlib import Path

from zb.ckpt.durable.layout import complete_steps

log = logging.getLogger("zb.ckpt")

OWNER_PREFIX = ".zb-owner-"
KINDS = ("", "live", "recovered")  # <ram_dir>/<node id>, <ram_dir>/live/<node id>, <ram_dir>/recovered/<node id>


def _start_time(pid: int) -> str | None:
    """The process start time in clock ticks since boot (/proc/<pid>/stat field 22); None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def owner_file(directory: Path, pid: int | None = None) -> Path:
    return Path(directory) / f"{OWNER_PREFIX}{pid or os.getpid()}"


def claim(directory: Path, ckpt_path: Path | None = None) -> Path:
    """Create `directory` if needed and record this process as one of its owners, with the ckpt.path
    its RAM copies are staged for."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = owner_file(directory)
    doc = {"pid": os.getpid(), "start": _start_time(os.getpid()), "host": socket.gethostname()}
    if ckpt_path is not None:
        doc["ckpt_path"] = str(Path(ckpt_path).resolve())
    path.write_text(json.dumps(doc))
    return path


def ram_only_steps(directory: Path, ckpt_path: Path) -> list[int]:
    """Steps complete in `directory` (a node's RAM copies) and newer than every step complete under
    ckpt_path: the only complete copies of those checkpoints."""
    durable = complete_steps(ckpt_path)
    return [s for s in complete_steps(directory) if not durable or s > durable[-1]]


def _ckpt_paths(owners: list[Path]) -> set[Path]:
    paths = set()
    for owner in owners:
        try:
            recorded = json.loads(owner.read_text()).get("ckpt_path")
        except (OSError, ValueError, AttributeError):
            continue
        if recorded:
            paths.add(Path(recorded))
    return paths


def release(directory: Path, own: list[str], keep: Sequence[Path] = ()) -> None:
    """Remove this process's entries of `directory`: the names in `own` at the top or one level down
    (a part `rank-0` inside each step directory) with their temporary and moved-aside twins, except
    the paths in `keep`, then its owner file; directories left empty go too. Best effort: it runs
    on the way out."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    kept = {Path(k).resolve() for k in keep}
    for sub in [directory, *(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))]:
        for entry in list(sub.iterdir()) if sub.is_dir() else []:
            if _is_own(entry.name, own) and entry.resolve() not in kept:
                shutil.rmtree(entry, ignore_errors=True)
        if sub != directory:
            _rmdir(sub)
    owner_file(directory).unlink(missing_ok=True)
    _rmdir(directory)


def _is_own(name: str, own: list[str]) -> bool:
    for prefix in ("", ".tmp-"):
        if name.startswith(prefix) and name[len(prefix):] in own:
            return True
    return any(name.startswith(f"{prefix}{o}-") for prefix in (".old-", ".del-") for o in own)


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass  # not empty: another local rank (or another run with this node id) still has parts in it


def alive(owner: Path) -> bool:
    """Whether the process an owner file names still runs (an unreadable file or another host's owner
    counts as alive: when in doubt, keep)."""
    try:
        doc = json.loads(owner.read_text())
        pid, start, host = int(doc["pid"]), doc.get("start"), doc.get("host")
    except (OSError, ValueError, KeyError, TypeError):
        return True
    if host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return start is None or _start_time(pid) in (None, start)


def sweep_stale(ram_dir: str | Path) -> list[Path]:
    """Remove node directories under ram_dir whose every owner is dead; returns them (logged)."""
    removed = []
    for kind in KINDS:
        base = Path(ram_dir) / kind if kind else Path(ram_dir)
        try:
            candidates = [p for p in base.iterdir() if p.is_dir() and not p.is_symlink()]
        except OSError:
            continue
        for directory in candidates:
            owners = list(directory.glob(f"{OWNER_PREFIX}*"))
            if owners and not any(alive(o) for o in owners):
                pending = sorted({s for path in _ckpt_paths(owners) for s in ram_only_steps(directory, path)})
                if kind == "" and pending:
                    log.warning("kept %s: it holds the only complete copy of checkpoint step %s (its run ended "
                                "before the copy to ckpt.path finished); a run of node %s with the same ckpt.path "
                                "and ckpt.ram_dir copies it there at its start", directory,
                                ", ".join(map(str, pending)), directory.name)
                    continue
                shutil.rmtree(directory, ignore_errors=True)
                removed.append(directory)
                log.info("removed %s: RAM copies of an earlier run on this machine whose processes are gone",
                         directory)
    return removed
