"""Background copies of a committed checkpoint part from RAM to disk (remote copies: zb.ckpt.remote).

The copy keeps the commit rule: the files go into `.tmp-rank-N`, are fsynced, then
`catalog.commit` writes manifest + marker and renames, so a copy cut short is never a snapshot.
`retry` wraps each copy (and each upload): failures are logged and retried with backoff, then
reported; nothing here raises into the training loop.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable, TypeVar

from zb.ckpt.catalog import commit, fsync_path, read_committed, tmp_dir

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
    for name in manifest.files:
        copy_file(src / name, tmp / name)
    final = commit(tmp, manifest)
    fsync_path(dst_step_dir.parent)
    return final


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
