"""Snapshot directories on disk: commit, list, verify, pick the latest, prune. Torch-free.

A snapshot counts only once it is committed: its files are written into `<root>/.tmp-<name>`,
fsynced, then `manifest.json`, then the `COMMITTED` marker (sha256 of the manifest), and finally
the directory is renamed to `<root>/<name>`. A crash at any point leaves either a `.tmp-` directory
(never listed) or a complete snapshot. The marker also guards copies made file by file (uploads):
a copy without it, or with a marker that does not match the manifest, is not a snapshot.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import uuid
from pathlib import Path

from zb.ckpt.manifest import MANIFEST, MARKER, TMP_PREFIX, Manifest, is_snapshot_name, sha256_bytes
from zb.errors import InvalidInput

log = logging.getLogger("zb.ckpt")

_HASH_CHUNK = 8 << 20
_DELETED = ".del-"


class CorruptSnapshot(InvalidInput):
    """A snapshot directory that is not committed or whose content does not match its manifest."""


def sha256_file(path: Path) -> str:
    """sha256 of a file, read in 8 MB chunks (hashlib releases the GIL, so files hash in parallel)."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_HASH_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory fsync makes renames and new entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def tmp_dir(root: Path, name: str) -> Path:
    """A fresh temporary directory for snapshot `name` (a stale one from a crash is removed)."""
    tmp = root / f"{TMP_PREFIX}{name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, manifest: Manifest) -> Path:
    """Write manifest + marker into `tmp` (whose files are already fsynced), rename it into place.

    A committed snapshot of the same name is replaced: moved aside first, deleted after.
    """
    data = manifest.to_json()
    write_durable(tmp / MANIFEST, data)
    write_durable(tmp / MARKER, sha256_bytes(data).encode())
    fsync_path(tmp)
    final = tmp.parent / manifest.name
    old = _move_aside(final) if final.exists() else None
    os.rename(tmp, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _move_aside(path: Path) -> Path:
    aside = path.parent / f"{_DELETED}{path.name}-{uuid.uuid4().hex[:8]}"
    os.rename(path, aside)
    return aside


def read_committed(path: Path) -> Manifest:
    """The manifest of a committed snapshot, checked against its marker and its directory name."""
    path = Path(path)
    try:
        marker = (path / MARKER).read_bytes().strip().decode("ascii", "replace")
        data = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise CorruptSnapshot(f"{path} is not a committed snapshot (no {MARKER} marker or no {MANIFEST})") from None
    if sha256_bytes(data) != marker:
        raise CorruptSnapshot(f"{path}: {MARKER} does not match {MANIFEST} (torn or edited snapshot)")
    return Manifest.from_json(data, str(path / MANIFEST))


def read_manifest(path: Path) -> Manifest:
    """Public name: the manifest of the committed snapshot at `path` (raises if not committed)."""
    return read_committed(path)


def verify_snapshot(path: Path, files: list[str] | None = None) -> Manifest:
    """Check marker, sizes and sha256 of every file (or of `files`); raise CorruptSnapshot naming the file."""
    manifest = read_committed(path)
    for name in files if files is not None else manifest.files:
        _verify_file(Path(path), manifest, name, full=True)
    return manifest


def _verify_file(path: Path, manifest: Manifest, name: str, full: bool) -> None:
    entry = manifest.files.get(name)
    if entry is None:
        raise CorruptSnapshot(f"{path}: no file {name} in the snapshot (it has {', '.join(manifest.files)})")
    target = path / name
    try:
        size = target.lstat().st_size if not target.is_symlink() else -1
    except FileNotFoundError:
        raise CorruptSnapshot(f"{target} is missing") from None
    if size != entry.size:
        raise CorruptSnapshot(f"{target} has {size} bytes, the manifest says {entry.size} (truncated or replaced)")
    if full and sha256_file(target) != entry.sha256:
        raise CorruptSnapshot(f"{target}: sha256 does not match the manifest (corrupted)")


def check_quick(path: Path) -> Manifest:
    """Marker and file sizes only: cheap enough for every request of the sidecar."""
    manifest = read_committed(path)
    for name in manifest.files:
        _verify_file(Path(path), manifest, name, full=False)
    return manifest


def list_snapshots(root: Path) -> list[tuple[Path, Manifest]]:
    """Committed snapshots under `root` (marker checked, content not), oldest step first."""
    found = []
    root = Path(root)
    if not root.is_dir():
        return found
    for entry in os.scandir(root):
        if not is_snapshot_name(entry.name) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            found.append((Path(entry.path), read_committed(Path(entry.path))))
        except (InvalidInput, OSError) as e:
            log.debug("skipping %s: %s", entry.path, e)
    found.sort(key=lambda pm: (pm[1].step, pm[1].created, pm[0].name))
    return found


def latest_snapshot(root: Path, *, full: bool = True) -> Path | None:
    """The newest committed snapshot that verifies (checksums if `full`, else marker + sizes).

    Corrupt ones are skipped with a warning, so a torn or damaged newest snapshot falls back to the
    previous good one instead of failing a resume.
    """
    for path, _ in reversed(list_snapshots(root)):
        try:
            verify_snapshot(path) if full else check_quick(path)
            return path
        except (InvalidInput, OSError) as e:
            log.warning("skipping snapshot %s: %s", path, e)
    return None


def remove_snapshot(path: Path) -> None:
    """Uncommit first (rename away), then delete: a reader never sees a half-deleted snapshot."""
    shutil.rmtree(_move_aside(Path(path)), ignore_errors=True)


def prune(root: Path, keep: int) -> list[Path]:
    """Delete committed snapshots older than the newest `keep`; returns the deleted paths.

    Uncommitted and temporary directories are left alone (a writer may still be busy with them);
    leftovers of interrupted deletions (`.del-*`) are removed.
    """
    if keep < 1:
        raise InvalidInput(f"prune keep={keep}: must be at least 1 (the newest snapshot is never pruned)")
    old = [path for path, _ in list_snapshots(root)][:-keep]
    for path in old:
        remove_snapshot(path)
    for leftover in Path(root).glob(f"{_DELETED}*"):  # moved aside by a deletion that crashed
        shutil.rmtree(leftover, ignore_errors=True)
    return old
