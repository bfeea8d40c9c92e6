"""Snapshot directories on disk: commit, list, verify, pick the latest, prune. Torch-free.

A snapshot counts only once it is committed: its files are written into `<root>/.tmp-<name>`,
fsynced, then `manifest.json`, then the `COMMITTED` marker (sha256 of the manifest), and finally
the directory is renamed to `<root>/<name>`. A crash at any point leaves either a `.tmp-` directory
(never listed) or a complete snapshot. The marker also guards copies made file by file (uploads):
a copy without it, or with a marker that does not match the manifest, is not a snapshot.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import logging
import os
import shutil
import uuid
from pathlib import Path

from zb.ckpt.format.manifest import MANIFEST, MARKER, TMP_PREFIX, Manifest, is_snapshot_name, sha256_bytes
from zb.errors import InvalidInput
from zb.stop_signals import interrupted

log = logging.getLogger("zb.ckpt")

_HASH_CHUNK = 8 << 20
_DELETED = ".del-"
_OLD = ".old-"
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


class CorruptSnapshot(InvalidInput):
    """A snapshot directory that is not committed or whose content does not match its manifest."""


def sha256_file(path: Path) -> str:
    """sha256 of a file, read in 8 MB chunks (hashlib releases the GIL, so files hash in parallel).

    Gives up (raising the Interrupted) once a stop signal interrupts the command: the command waits for
    its hashing threads on the way out, and a large file on a slow disk would hold it for minutes."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_HASH_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            digest.update(view[:n])
            stop = interrupted()
            if stop is not None:
                raise stop
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

    A committed snapshot of the same name is replaced so that at every instant one complete copy
    exists: the two directories are swapped in one atomic rename (RENAME_EXCHANGE), then the old
    copy, now under the temporary name, is deleted. Where the file system cannot swap, the old copy
    is first renamed to `.old-<name>-*`, which `recover_leftovers` puts back if a crash strikes
    before the new copy is in place.
    """
    data = manifest.to_json()
    write_durable(tmp / MANIFEST, data)
    write_durable(tmp / MARKER, sha256_bytes(data).encode())
    fsync_path(tmp)
    final = tmp.parent / manifest.name
    if not final.exists():
        os.rename(tmp, final)
        fsync_path(final.parent)
        return final
    if exchange(tmp, final):
        old = tmp  # the replaced copy now has the temporary name, which is never read
    else:
        old = _move_aside(final, _OLD)
        os.rename(tmp, final)
    fsync_path(final.parent)  # the new copy is in place for good before the old one goes
    shutil.rmtree(old, ignore_errors=True)
    return final


def exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (renameat2 RENAME_EXCHANGE); False where the platform or the
    file system cannot (then nothing changed). Other errors raise OSError."""
    rename2 = _renameat2()
    if rename2 is None:
        return False
    if rename2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2 RENAME_EXCHANGE {a} <-> {b}: {os.strerror(err)}")


@functools.cache
def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux/glibc: the move-aside fallback
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


def _move_aside(path: Path, prefix: str = _DELETED) -> Path:
    aside = path.parent / f"{prefix}{path.name}-{uuid.uuid4().hex[:8]}"
    os.rename(path, aside)
    return aside


def recover_leftovers(root: Path, names: list[str] | None = None) -> list[str]:
    """Tidy what a crash left under `root`: put back a replaced snapshot whose successor never
    arrived (`.old-<name>-*` while `<name>` is missing), delete temporary (`.tmp-`) and
    half-deleted (`.del-`, other `.old-`) directories. With `names`, only leftovers of those
    snapshot names are touched (another process may be writing the others). Returns what it did,
    one phrase per directory."""
    done: list[str] = []
    root = Path(root)
    if not root.is_dir():
        return done
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        kind, name = _leftover(entry.name)
        if kind is None or (names is not None and name not in names) or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        if kind == _OLD and not (root / name).exists() and _intact(path):
            os.rename(path, root / name)
            fsync_path(root)
            done.append(f"restored {root / name} from {entry.name} (a replacement was cut short)")
        else:
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed {path}")
    return done


def _leftover(dirname: str) -> tuple[str | None, str]:
    """(prefix, snapshot name) of a leftover directory's name, (None, "") for any other name."""
    if dirname.startswith(TMP_PREFIX):
        return TMP_PREFIX, dirname[len(TMP_PREFIX):]
    for prefix in (_OLD, _DELETED):
        if dirname.startswith(prefix):
            return prefix, dirname[len(prefix):].rpartition("-")[0]
    return None, ""


def _intact(path: Path) -> bool:
    try:
        check_quick(path)
        return True
    except (InvalidInput, OSError):
        return False


def read_committed(path: Path) -> Manifest:
    """The manifest of a committed snapshot, checked against its marker and its directory name."""
    path = Path(path)
    try:
        marker = (path / MARKER).read_bytes().strip().decode("ascii", "replace")
        data = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise CorruptSnapshot(f"{path} is not a committed snapshot (no {MARKER} marker or no {MANIFEST})") from None
    except (IsADirectoryError, NotADirectoryError) as e:  # COMMITTED or manifest.json is a directory
        raise CorruptSnapshot(f"{path} is not a committed snapshot ({e.filename} is not a file)") from None
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
    found: list[tuple[Path, Manifest]] = []
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
