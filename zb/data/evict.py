"""Streamed hub files under a disk budget: files already read and behind the resume point are
deleted from the cache, oldest first, once a rank's files exceed its share of data.cache_budget_gb.

A rank reads its files in order. A file may go once the position a run could resume from lies past
it: the latest checkpoint (the training run reports it through `DataLoader.release`), or the
reader's own position when the run takes no periodic checkpoints. Only files zb downloaded itself
are deleted (a marker beside the cache entry says so, and survives a restart): files that were in
the shared cache already, fetched by huggingface_hub, `datasets` or `zb subset-data`, stay. Files
the held-out stream reads stay for the run, as every evaluation reads them again.

The train and eval loaders of a rank are built apart, so one StreamCache per (cache, dataset,
commit, file list) is shared by every loader of the process.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from urllib.parse import quote

from zb.data.hub import HubDataset, RemoteFile, repo_folder

log = logging.getLogger("zb.data")

MARKERS = ".zb-streamed"  # in the dataset's cache folder: <revision>/<quoted path> per file zb fetched
_registry: dict[tuple, StreamCache] = {}
_registry_lock = threading.Lock()


def stream_cache(ds: HubDataset, files: list[RemoteFile], budget_bytes: float) -> StreamCache:
    """The process's StreamCache of these files (made on first use)."""
    key = (str(ds.cache_dir), ds.repo_id, ds.revision, tuple(f.path for f in files))
    with _registry_lock:
        if key not in _registry:
            _registry[key] = StreamCache(ds, files, budget_bytes)
        return _registry[key]


class StreamCache:
    def __init__(self, ds: HubDataset, files: list[RemoteFile], budget_bytes: float):
        self.ds, self.files, self.budget = ds, files, budget_bytes
        self._lock = threading.Lock()
        self._owned: dict[int, int] = {}  # file index -> bytes on disk, for files zb fetched
        self._pinned: set[int] = set()    # read by the held-out stream
        self._release = 0                 # files before this index are behind the resume point
        self._started: set[int] = set()   # files a fetch has begun on (until evicted): no second prefetch
        self._ahead: dict[int, threading.Event] = {}  # prefetches in flight, set when each one ends
        self._warned = False
        for i, f in enumerate(files):  # fetched by an earlier run of this node (a restart)
            path = ds.cached(f)
            if path is not None and self._marker(f).exists():
                self._owned[i] = path.stat().st_size

    def fetch(self, i: int, retries: int, *, pin: bool) -> Path:
        """The local copy of file i for its reader (downloaded and marked as zb's unless cached); `pin` keeps it.
        A prefetch of the file in flight is waited for, never raced: two downloads of one file let the later
        one write it back after the reader had read it and eviction had let it go."""
        with self._lock:
            self._started.add(i)
            if not pin:  # a training stream reads from here (a loader resumed at an earlier position): keep it
                self._release = min(self._release, i)
            ahead = self._ahead.get(i)
        if ahead is not None:
            ahead.wait()
        return self._download(i, retries, pin=pin)

    def prefetch(self, i: int, retries: int, *, pin: bool) -> Path | None:
        """Fetch file i ahead of its reader, unless a fetch of it has started already or the resume point has
        passed it (a prefetch a busy machine ran late); a prefetch never moves the resume point back."""
        with self._lock:
            if i in self._started or (i < self._release and not pin):
                return None
            self._started.add(i)
            done = self._ahead[i] = threading.Event()
        try:
            return self._download(i, retries, pin=pin)
        finally:
            with self._lock:
                del self._ahead[i]
            done.set()

    def _download(self, i: int, retries: int, *, pin: bool) -> Path:
        remote = self.files[i]
        ours = self.ds.cached(remote) is None
        path = self.ds.fetch(remote, retries)
        with self._lock:
            if pin:
                self._pinned.add(i)
            if ours:
                self._marker(remote).parent.mkdir(parents=True, exist_ok=True)
                self._marker(remote).touch()
                self._owned[i] = path.stat().st_size
            self._evict()
        return path

    def release_before(self, i: int) -> None:
        """Files before index i will not be read again from any position the run may resume at."""
        with self._lock:
            self._release = i  # not a running max: after an epoch wraps, the early files are needed again
            self._evict()

    def _evict(self) -> None:
        total = sum(self._owned.values())
        for i in sorted(self._owned):
            if total <= self.budget or i >= self._release:
                break
            if i in self._pinned:
                continue
            total -= self._owned.pop(i)
            self._started.discard(i)  # read again after an epoch wraps: fetched anew
            self._delete(self.files[i])
        if total > self.budget and not self._warned:
            self._warned = True
            log.warning("the streamed data files of this rank take %.2f GB, over its share of data.cache_budget_gb "
                        "(%.2f GB), and are still needed (being read, read by evaluations, or at or after the latest "
                        "checkpoint): raise the budget or checkpoint more often", total / 1e9, self.budget / 1e9)

    def _delete(self, remote: RemoteFile) -> None:
        path = self.ds.cached(remote)
        if path is not None:
            blob = path.resolve()  # the snapshot entry is a link to a blob: both go
            size = blob.stat().st_size
            path.unlink()
            if blob != path:
                blob.unlink(missing_ok=True)
            log.info("data cache: evicted %s (%.1f MB), read and behind the latest resume point", remote.path,
                     size / 1e6)
        self._marker(remote).unlink(missing_ok=True)

    def _marker(self, remote: RemoteFile) -> Path:
        folder = repo_folder(self.ds.repo_id, self.ds.cache_dir)
        return folder / MARKERS / self.ds.revision / quote(remote.path, safe="")
