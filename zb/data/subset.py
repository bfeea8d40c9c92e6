"""Fetch only the part of a Hugging Face dataset that one data rank reads (the library of `zb subset-data`).

The files are those `zb train` would read on that data rank (zb.data.hub.rank_files), stored in
Hugging Face's cache layout (what `zb train` and huggingface_hub read), with zb's file list beside
them; so a node can later train offline with ZB_DATA_CACHE=<out> HF_HUB_OFFLINE=1. Files already in
the cache are skipped.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from zb.data.hub import RemoteFile, name_and_config, open_dataset, rank_files, select_files
from zb.stop_signals import worker_pool


@dataclass
class SubsetReport:
    dataset: str
    revision: str
    out: str
    files: list[str] = field(default_factory=list)
    downloaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0
    dry_run: bool = False  # listed only: `bytes` is what a real run would fetch (or find complete)


class Progress:
    """What the caller shows (a rich bar or plain lines); the base class shows nothing."""

    def start(self, files: list[RemoteFile]) -> None: ...

    def file_done(self, remote: RemoteFile, fetched: bool, seconds: float) -> None: ...


def subset_dataset(name: str, *, data_rank: int, data_world_size: int, out: Path, split: str = "train",
                   config: str | None = None, max_shards: int | None = None, retries: int = 5,
                   filters: tuple[str, ...] = (), workers: int = 1, dry_run: bool = False,
                   reverse_data_files: bool = False, split_by_data_rank: bool = True,
                   progress: Progress | None = None) -> SubsetReport:
    """`filters`: keep only files whose path holds one of these substrings, before the files are
    dealt to data ranks (Prime's --filter); `workers`: files downloaded at once; `dry_run`: list the
    rank's files and their size without fetching any. `reverse_data_files` and `split_by_data_rank`
    as the training keys of the same names: the files fetched are the ones training will read."""
    progress = progress or Progress()
    name, config = name_and_config(name, config, "--dataset")
    ds = open_dataset(name, key="--dataset", retries=retries, cache_dir=out, downloading=True)
    files = select_files(ds.files, split, config, f"--dataset {name!r}")
    if filters:
        files = [f for f in files if any(part in f.path for part in filters)]
    if reverse_data_files:
        files = files[::-1]
    if not split_by_data_rank:
        data_rank, data_world_size = 0, 1  # the node reads every file (they were split beforehand)
    mine, _ = rank_files(files, data_rank, data_world_size) if files else ([], True)
    if max_shards is not None:
        mine = mine[:max_shards]
    report = SubsetReport(name, ds.revision, str(out), files=[f.path for f in mine], dry_run=dry_run)
    if dry_run:
        report.bytes = sum(f.size or 0 for f in mine)
        return report
    progress.start(mine)
    begin, lock = time.perf_counter(), threading.Lock()

    def fetch(remote: RemoteFile) -> None:
        t0 = time.perf_counter()
        fetched = ds.cached(remote) is None
        size = ds.fetch(remote, retries).stat().st_size
        with lock:
            (report.downloaded if fetched else report.skipped).append(remote.path)
            report.bytes += size
            progress.file_done(remote, fetched, time.perf_counter() - t0)

    # On Ctrl-C or SIGTERM the files in flight are left (huggingface_hub resumes them on the next run).
    with worker_pool(workers, "zb-subset") as pool:
        for done in [pool.submit(fetch, remote) for remote in mine]:
            done.result()  # the first failure stops the command (the files already fetched stay)
    report.downloaded.sort()
    report.skipped.sort()
    report.seconds = round(time.perf_counter() - begin, 3)
    return report
