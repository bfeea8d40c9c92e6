"""Background copies of a committed checkpoint part from RAM to disk (remote copies: zb.ckpt.durable.remote).

The copy keeps the commit rule: the files go into `.tmp-rank-N`, are fsynced, then
`catalog.commit` writes manifest + marker and renames, so a copy cut short is never a snapshot.
`retry` wraps each copy (and each upload): failures are logged and retried with backoff, then
reported; nothing here raises into the training loop.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from zb.ckpt.format.catalog import commit, fsync_path, read_committed, tmp_dir
from zb.errors import EnvironmentFailure, InvalidInput, free_space

log = logging.getLogger("zb.ckpt")

T = TypeVar("T")


def copy_file(src: Path, dst: Path) -> int:
    """Copy and fsync one file; returns its size.

    shutil.copyfile picks the kernel's fast path (sendfile) and works across file systems; RAM
    (tmpfs) -> disk is always such a crossing, where copy_file_range fails with EXDEV.
    """
    shutil.copyfile(src, dst)
    with open(dst, "rb+", buffering=0) as f:
        os.fsync(f.fileno())
        return os.fstat(f.fileno()).st_size


def copy_part(src: Path, dst_step_dir: Path) -> Path:
    """Copy the committed part at `src` into `dst_step_dir/<same name>`, committing it there."""
    manifest = read_committed(src)
    dst_step_dir.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir(dst_step_dir, manifest.name)
    try:
        for name in manifest.files:
            copy_file(src / name, tmp / name)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)  # a half copy on a full disk only takes the space a retry needs
        raise
    final = commit(tmp, manifest)
    fsync_path(dst_step_dir.parent)
    return final


def check_writable_dir(path: str, key: str = "ckpt.path") -> None:
    """At start: `path` must be a directory this process can create files in (made if missing).

    Raises InvalidInput (exit 2) for a path that can never work: a regular file, a read-only file
    system, no permission, a parent that cannot be created; EnvironmentFailure (exit 1) for a disk
    that is full already. Each names `key` and what to do."""
    target = Path(path)
    probe = target / f".zb-probe-{os.getpid()}-{threading.get_ident()}"
    try:
        if target.exists() and not target.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "it exists and is not a directory")
        target.mkdir(parents=True, exist_ok=True)
        write_probe(probe)
    except OSError as e:
        why = e.strerror or str(e)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise EnvironmentFailure(f"{key} {path!r}: {why} ({free_space(target)}): free space there or point {key} "
                                     "at another disk") from None
        raise InvalidInput(f"{key} {path!r} cannot hold checkpoints: {why}; give a writable directory "
                           f"(--{key} DIR)") from None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass  # there was never a probe (not a directory)


def describe_failure(error: Exception | None, where: Path) -> str:
    """A failed copy in a few words; a full disk also says how much room `where`'s disk has left."""
    if error is None:
        return "not written"
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        text += f" ({free_space(where)} on {where})"
    return text


def write_probe(path: Path) -> None:
    with open(path, "wb") as f:
        f.write(b"zb")
        f.flush()
        os.fsync(f.fileno())


def retry(what: str, fn: Callable[[], T], attempts: int, delay: float) -> tuple[T | None, Exception | None]:
    """Run fn up to `attempts` times with doubling delays; (result, None) or (None, last error)."""
    error: Exception | None = None
    for attempt in range(1, attempts + 1):
        try:
            return fn(), None
        except Exception as e:  # noqa: BLE001 - a background copy must never kill training
            error = e
            log.warning("%s failed (attempt %d/%d): %s: %s", what, attempt, attempts, type(e).__name__, e)
            if attempt < attempts:
                time.sleep(delay * 2 ** (attempt - 1))
    return None, error
