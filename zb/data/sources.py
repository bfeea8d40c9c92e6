"""Which documents a rank reads: the sources (builtin stream, local files, hub datasets), their parts
and the round robin, and the document stream that mixes them.

Shards: shard = data_rank * local_world_size + local_rank, of data_world_size * local_world_size,
in every source on its own.
- builtin and local files: every rank walks all parts and keeps every num_shards-th document.
- hub datasets: files are dealt to data ranks when there are at least as many files as data ranks
  (a node downloads only its own files), then to local ranks when the node has at least as many
  files as local ranks; wherever files run short, documents are dealt instead.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from zb.config_checks import dataset_entries, ratio_weights
from zb.config_schema import DataConfig
from zb.data.files import FilePart, find_local_files, looks_local
from zb.data.hashing import mix64
from zb.data.mixture import MixedStream
from zb.data.stream import BuiltinPart, DocStream, Part
from zb.errors import InvalidInput

log = logging.getLogger("zb.data")
KEY = "data.dataset_name_or_paths"


@dataclass(frozen=True)
class Source:
    entry: str  # as written in data.dataset_name_or_paths (all of it for one source without a ratio)
    kind: str   # "builtin", "local" or "hub"


@dataclass
class Plan:
    parts: list[Part]
    rr_index: int
    rr_count: int
    version: str = ""  # what the parts are a snapshot of (a hub dataset's commit); "" when fixed
    release: Callable[[int], None] | None = None  # called with the resume point's part: parts before it may go


@dataclass(frozen=True)
class Ranks:
    data_rank: int
    data_world_size: int
    local_rank: int
    local_world_size: int

    @property
    def shard(self) -> int:
        return self.data_rank * self.local_world_size + self.local_rank

    @property
    def num_shards(self) -> int:
        return self.data_world_size * self.local_world_size


def source_kind(data_cfg: DataConfig) -> str:
    """"fake", "mixture", or the kind of the one source: "builtin", "local" or "hub"."""
    if data_cfg.fake:
        return "fake"
    found = sources(data_cfg)
    return "mixture" if len(found) > 1 else found[0].kind


def sources(data_cfg: DataConfig) -> list[Source]:
    """With data.dataset_ratio, each comma-separated entry is a source; without it the whole value is
    one source, and several entries must all be local paths (read as one set of files)."""
    spec = data_cfg.dataset_name_or_paths.strip()
    if data_cfg.dataset_ratio is not None:
        return [Source(e, _kind(e)) for e in dataset_entries(spec)]
    entries = dataset_entries(spec)
    if len(entries) > 1:
        other = next((e for e in entries if _kind(e) != "local"), None)
        if other is not None:
            raise InvalidInput(f"{KEY} = {spec!r}: without data.dataset_ratio, comma-separated entries are local "
                               f"paths read as one source, and {other!r} is not one; to mix several sources "
                               f"set data.dataset_ratio, one weight per source (\"{':'.join(['1'] * len(entries))}\")")
        return [Source(spec, "local")]
    return [Source(spec, _kind(spec))]


def _kind(entry: str) -> str:
    if entry == "builtin":
        return "builtin"
    return "local" if looks_local(entry) else "hub"


def open_stream(data_cfg: DataConfig, ranks: Ranks, *, held_out: bool, seed: int
                ) -> tuple[DocStream | MixedStream, str]:
    """The document stream of one rank and split, and the version of what it reads."""
    found = sources(data_cfg)
    if not held_out:  # said once per run, not again at every evaluation
        _warn_without_effect(data_cfg, found)
    streams, versions = [], []
    # The node's cache budget, shared by its local ranks and by the hub sources each of them streams.
    hub_sources = sum(s.kind == "hub" for s in found) or 1
    budget = data_cfg.cache_budget_gb * 1e9 / ranks.local_world_size / hub_sources
    for source in found:
        p = plan(source, data_cfg, ranks, seed=seed, held_out=held_out, budget=budget)
        streams.append(DocStream(p.parts, p.rr_index, p.rr_count, data_cfg.eval_fraction, held_out, source.entry,
                                 on_release=p.release))
        versions.append(p.version)
    if len(streams) == 1:
        return streams[0], versions[0]
    assert data_cfg.dataset_ratio is not None  # several sources come only from data.dataset_ratio (sources())
    weights = ratio_weights(data_cfg.dataset_ratio)
    # What the position is a position in: a change in sources, weights or snapshots is reported at resume.
    version = "; ".join(f"{s.entry} x{w:g}" + (f" ({v})" if v else "") for s, w, v in zip(found, weights, versions))
    return MixedStream(streams, weights, seed=mix64(seed, ranks.shard)), version


def _warn_without_effect(data_cfg: DataConfig, found: list[Source]) -> None:
    if data_cfg.dataset_config and not any(s.kind == "hub" for s in found):
        log.warning("data.dataset_config = %r has no effect: no source is a Hugging Face dataset",
                    data_cfg.dataset_config)
    if data_cfg.reverse_data_files and all(s.kind == "builtin" for s in found):
        log.warning("data.reverse_data_files has no effect: builtin data has no files")


def plan(source: Source, data_cfg: DataConfig, ranks: Ranks, *, seed: int, held_out: bool = False,
         budget: float = float("inf")) -> Plan:
    """`held_out`: the plan feeds the eval stream (whose hub files are kept for the run); `budget`:
    bytes of streamed hub files this rank may keep for this source."""
    if source.kind == "builtin":
        return Plan([BuiltinPart(seed)], ranks.shard, ranks.num_shards)
    if source.kind == "local":
        files = find_local_files(source.entry)
        if data_cfg.reverse_data_files:
            files = files[::-1]
        # Names relative to the files' common directory: the held-out split survives moving the data.
        base = os.path.commonpath([str(p.parent.resolve()) for p in files])
        return Plan([FilePart(p, os.path.relpath(p.resolve(), base), data_cfg.text_column) for p in files],
                    ranks.shard, ranks.num_shards)
    return _hub_plan(source.entry, data_cfg, ranks, held_out, budget)


def _hub_plan(entry: str, data_cfg: DataConfig, ranks: Ranks, held_out: bool, budget: float) -> Plan:
    from zb.data.hub import name_and_config, open_dataset, rank_files, select_files

    name, config = name_and_config(entry, data_cfg.dataset_config, KEY)
    ds = open_dataset(name, key=KEY, retries=data_cfg.retries)
    files = select_files(ds.files, data_cfg.split, config, f"{KEY} = {entry!r}")
    if data_cfg.reverse_data_files:
        files = files[::-1]
    mine, split_by_rank = rank_files(files, ranks.data_rank, ranks.data_world_size)
    if not split_by_rank:
        rr_index, rr_count = ranks.shard, ranks.num_shards
    elif len(mine) >= ranks.local_world_size:
        mine, rr_index, rr_count = mine[ranks.local_rank::ranks.local_world_size], 0, 1
    else:
        rr_index, rr_count = ranks.local_rank, ranks.local_world_size
    mine = _present_if_offline(ds, mine)
    log.info("dataset %s@%s: %d data files, this rank reads %d (documents 1 of every %d)",
             entry, ds.revision[:12], len(files), len(mine), rr_count)
    fetchers, ahead, release = _fetchers(ds, mine, data_cfg, budget, held_out)
    parts: list[Part] = [FilePart(Path(name, f.path), f.path, data_cfg.text_column,
                                  ensure=_with_prefetch(fetchers[i], ahead[i + 1] if i + 1 < len(mine) else None))
                         for i, f in enumerate(mine)]
    if not data_cfg.streaming:
        for fetch in fetchers:
            fetch()  # download everything up front
    return Plan(parts, rr_index, rr_count, version=f"{name}@{ds.revision}", release=release)


def _fetchers(ds, mine: list, data_cfg: DataConfig, budget: float, held_out: bool
              ) -> tuple[list[Callable[[], Path]], list[Callable[[], Path | None]], Callable[[int], None] | None]:
    """One fetch per file for its reader, one for fetching it ahead, and the release hook (None: nothing
    is evicted). Eviction needs streaming (without it the whole file list was asked for) and the network
    (offline, a deleted file is gone)."""
    from zb.data.evict import stream_cache
    from zb.data.hub import offline

    if not data_cfg.streaming or offline():
        fetchers: list[Callable[[], Path]] = [functools.partial(ds.fetch, f, data_cfg.retries) for f in mine]
        return fetchers, list(fetchers), None
    cache = stream_cache(ds, mine, budget)
    indices = range(len(mine))
    return ([functools.partial(cache.fetch, i, data_cfg.retries, pin=held_out) for i in indices],
            [functools.partial(cache.prefetch, i, data_cfg.retries, pin=held_out) for i in indices],
            cache.release_before)


def _with_prefetch(fetch: Callable[[], Path], fetch_next: Callable[[], Path | None] | None) -> Callable[[], Path]:
    """Streaming: while one file is read, the next one downloads in the background (a daemon thread,
    so exit never waits for it; with eviction the reader waits for a prefetch of its file in flight)."""
    def ensure() -> Path:
        path = fetch()
        if fetch_next is not None:
            threading.Thread(target=_quietly, args=(fetch_next,), daemon=True, name="zb-prefetch").start()
        return path

    return ensure


def _quietly(fetch: Callable[[], Path | None]) -> None:
    try:
        fetch()
    except Exception as e:  # the reader's own fetch retries and reports it
        log.debug("prefetch failed: %s", e)


def _present_if_offline(ds, files: list) -> list:
    """Offline, a rank reads the assigned files that are on disk (subset-data --max-shards fetches a few)."""
    from zb.data.hub import offline

    if not offline():
        return files
    present = [f for f in files if ds.cached(f) is not None]
    if len(present) < len(files):
        log.warning("offline: %d of this rank's %d files are in %s; reading those", len(present), len(files),
                    ds.cache_dir)
    return present
