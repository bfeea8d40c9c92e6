"""Live recovery: fetch the current snapshot from live peers' sidecars into a local committed snapshot.

    result = fetch_snapshot(["10.0.0.1:7000", "10.0.0.2:7000"], token, Path("/dev/shm/zb/joined"),
                            files=["model.safetensors", "outer.safetensors"], fingerprint=run_fp)
    tensors, meta = load_snapshot(result.path, expect=...)
    zb.events.emit(metrics, result.record())

Steps: 1. ask every peer for its manifest (or the one of `expect_step`); 2. take the newest step and,
per file, the peers that hold the same bytes (same sha256; the majority if they disagree); 3.
download the files split by byte ranges across those peers (download.py); 4. check every file's
sha256; a file that does not match is fetched again one peer at a time, dropping the peers that
served bad bytes; 5. commit the snapshot locally (same format, so load_snapshot reads it).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from zb.ckpt.format.catalog import commit, sha256_file
from zb.ckpt.format.manifest import TMP_PREFIX, FileEntry, Manifest, check_file_name, is_snapshot_name
from zb.ckpt.recovery.peer import PeerClient, PeerError, parse_peer
from zb.ckpt.recovery.progress import TransferProgress
from zb.ckpt.recovery.ranged import DownloadFailed, FilePlan, download
from zb.errors import EnvironmentFailure, InvalidInput
from zb.events import Recovery

log = logging.getLogger("zb.ckpt.fetch")


@dataclass
class FetchResult:
    path: Path
    step: int
    outer_step: int | None
    peers: list[str]            # peers that served bytes
    bytes: int                  # bytes transferred (reused files not counted)
    seconds: float
    bytes_by_peer: dict[str, int]

    def record(self) -> Recovery:
        """The `recovery` metrics event."""
        return Recovery(outer_step=self.outer_step, step=self.step, peers=self.peers, bytes=self.bytes,
                        seconds=round(self.seconds, 3))


class _SnapshotGone(Exception):
    """Every source lost the chosen snapshot mid-download (pruned): start again from new manifests."""


@dataclass(frozen=True)
class _Request:
    peers: list[str]
    token: str
    dest_dir: Path
    expect_step: int | None
    files: list[str] | None
    fingerprint: str | None
    progress: bool | None
    timeout: float
    wait_s: float
    conns_per_peer: int
    chunk_bytes: int | None
    deadline: float                 # time.monotonic() by which the whole fetch must be done


def fetch_snapshot(peers: list[str], token: str, dest_dir: Path, *, expect_step: int | None = None,
                   files: list[str] | None = None, fingerprint: str | None = None, progress: bool | None = None,
                   timeout: float = 30.0, wait_s: float = 0.0, conns_per_peer: int = 2,
                   chunk_bytes: int | None = None, max_restarts: int = 2,
                   deadline_s: float | None = None) -> FetchResult:
    """Fetch a snapshot from `peers` ("host:port") into `dest_dir/<name>`; EnvironmentFailure if it cannot.

    `files` keeps only those files (a joiner takes the node-identical ones); `fingerprint`, if given,
    ignores peers of another run (InvalidInput if all are); `wait_s` polls that long for a peer to
    serve a snapshot (of `expect_step`); `timeout` bounds every socket operation, so a stalled peer
    is dropped after that long; `deadline_s` bounds the whole fetch; `progress` None = a bar only on
    a terminal.
    """
    if not peers:
        raise InvalidInput("live recovery needs at least one peer address")
    for peer in peers:
        parse_peer(peer)
    for name in files or ():
        check_file_name(name)
    start = time.monotonic()
    req = _Request(list(peers), token, Path(dest_dir), expect_step, files, fingerprint, progress, timeout, wait_s,
                   conns_per_peer, chunk_bytes, start + deadline_s if deadline_s is not None else float("inf"))
    for attempt in range(max_restarts + 1):
        try:
            return _fetch_once(req, start)
        except _SnapshotGone:
            if expect_step is not None or attempt == max_restarts:
                raise EnvironmentFailure(f"the snapshot was pruned on every peer during the download "
                                         f"({', '.join(peers)}): keep more snapshots (prune keep) or retry") from None
            log.warning("snapshot pruned on every peer mid-download; starting again with the newest one")
    raise AssertionError("unreachable")


def _fetch_once(req: _Request, start: float) -> FetchResult:
    found = _manifests(req)
    step = req.expect_step if req.expect_step is not None else max(m.step for _, m in found.values())
    found = {p: nm for p, nm in found.items() if nm[1].step == step}
    first = next(iter(found.values()))[1]
    wanted = req.files if req.files is not None else list(first.files)
    entries, plans = _plan(found, wanted)
    manifest = Manifest(first.name, step, first.outer_step, first.fingerprint, first.created, entries, first.meta)
    tmp = req.dest_dir / f"{TMP_PREFIX}{manifest.name}"
    tmp.mkdir(parents=True, exist_ok=True)
    todo = [f for f in wanted if not _reusable(tmp / f, entries[f])]
    names = {p: nm[0] for p, nm in found.items()}
    try:
        by_peer = _download_verified(req, todo, plans, names, tmp, manifest.total_bytes)
    except _SnapshotGone:
        shutil.rmtree(tmp, ignore_errors=True)  # nobody serves this snapshot any more
        raise
    path = commit(tmp, manifest)
    _remove_stale_tmp(req.dest_dir)
    result = FetchResult(path, step, manifest.outer_step, sorted(p for p, n in by_peer.items() if n),
                         sum(by_peer.values()), time.monotonic() - start, by_peer)
    log.info("recovered step %d (%.1f MB) from %s in %.2f s", step, result.bytes / 1e6, ", ".join(result.peers) or "cache",
             result.seconds)
    return result


def _manifests(req: _Request) -> dict[str, tuple[str, Manifest]]:
    """{peer: (name, manifest)} of the peers that serve a usable snapshot; polls up to `wait_s`."""
    peers, expect_step, fingerprint = req.peers, req.expect_step, req.fingerprint
    deadline = time.monotonic() + req.wait_s
    while True:
        found, errors = _ask_all(peers, req.token, expect_step, req.timeout)
        if fingerprint is not None:
            for peer in [p for p, (_, m) in found.items() if m.fingerprint != fingerprint]:
                errors[peer] = f"{peer}: belongs to another run (fingerprint {found.pop(peer)[1].fingerprint!r})"
        pending = len(found) + len(errors) < len(peers)
        if found and (not pending or time.monotonic() >= deadline):
            return found
        if time.monotonic() >= deadline:
            if errors and all("belongs to another run" in e for e in errors.values()):
                raise InvalidInput(f"every peer belongs to another run (fingerprint differs from {fingerprint!r}): "
                                   + "; ".join(errors.values()))
            what = f"a snapshot of step {expect_step}" if expect_step is not None else "a committed snapshot"
            detail = "; ".join(errors.values()) or "none has committed one yet"
            raise EnvironmentFailure(f"no peer serves {what} ({', '.join(peers)}): {detail}")
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def _ask_all(peers, token, expect_step, timeout) -> tuple[dict, dict]:
    def ask(peer: str):
        client = PeerClient(peer, token, timeout)
        try:
            return client.manifest(expect_step)
        except PeerError as e:
            return e
        finally:
            client.close()

    with ThreadPoolExecutor(len(peers)) as pool:
        answers = dict(zip(peers, pool.map(ask, peers)))
    found = {p: a for p, a in answers.items() if isinstance(a, tuple)}
    errors = {p: str(a) for p, a in answers.items() if isinstance(a, PeerError)}
    return found, errors


def _plan(found: dict[str, tuple[str, Manifest]], wanted: list[str]) -> tuple[dict[str, FileEntry], dict[str, FilePlan]]:
    """Per file, the entry most peers agree on (same size and sha256) and the peers holding it."""
    entries, plans = {}, {}
    for f in wanted:
        holders = {p: m.files[f] for p, (_, m) in found.items() if f in m.files}
        if not holders:
            raise EnvironmentFailure(f"no peer's snapshot has {f} ({', '.join(found)})")
        votes = Counter((e.size, e.sha256) for e in holders.values())
        (size, sha), _ = votes.most_common(1)[0]
        if len(votes) > 1:
            log.warning("peers disagree on %s; using the version of %d of %d peers", f, votes[(size, sha)],
                        len(holders))
        entries[f] = next(e for e in holders.values() if (e.size, e.sha256) == (size, sha))
        plans[f] = FilePlan(size, sha, [p for p, e in holders.items() if (e.size, e.sha256) == (size, sha)])
    return entries, plans


def _remove_stale_tmp(dest_dir: Path) -> None:
    """Partial downloads of other snapshots left by failed fetches: RAM in /dev/shm, never reusable now."""
    for tmp in dest_dir.glob(f"{TMP_PREFIX}*"):
        if tmp.is_dir() and is_snapshot_name(tmp.name[len(TMP_PREFIX):]):
            log.debug("removing the stale partial download %s", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


def _reusable(path: Path, entry: FileEntry) -> bool:
    """A file left complete by an interrupted fetch of the same snapshot is not downloaded again."""
    return path.is_file() and path.stat().st_size == entry.size and sha256_file(path) == entry.sha256


def _download_verified(req: _Request, todo: list[str], plans: dict[str, FilePlan], names: dict[str, str], tmp: Path,
                       total: int) -> dict[str, int]:
    """Download and check `todo`; a file with a bad checksum is retried one source at a time.
    Returns the bytes each peer served."""
    by_peer: Counter[str] = Counter()
    solo: dict[str, list[str]] = {}
    bar = TransferProgress(total, "live recovery", req.progress)
    try:
        while todo:
            round_plans = {f: FilePlan(plans[f].size, plans[f].sha256, solo[f][:1] if f in solo else plans[f].sources)
                           for f in todo}
            try:
                report = download(round_plans, names, tmp, req.token, timeout=req.timeout,
                                  conns_per_peer=req.conns_per_peer, progress=bar, deadline=req.deadline,
                                  chunk_bytes=req.chunk_bytes or _chunk_size(round_plans, req.conns_per_peer))
            except DownloadFailed as e:
                if e.expired:
                    errors = "; ".join(e.errors.values())
                    raise EnvironmentFailure(f"live recovery from {', '.join(req.peers)} missed its deadline (peers "
                                             f"too slow or stalled){': ' + errors if errors else ''}") from None
                if e.gone:
                    raise _SnapshotGone() from None
                raise EnvironmentFailure(str(e)) from None
            by_peer.update(report.bytes_by_peer)
            todo = _check_round(todo, plans, solo, report, tmp)
    finally:
        bar.close()
    return dict(by_peer)


def _chunk_size(plans: dict[str, FilePlan], conns_per_peer: int) -> int:
    """About 8 chunks per connection, so the last chunks (the tail) are short; 1-16 MB."""
    total = sum(p.size for p in plans.values())
    connections = conns_per_peer * len({peer for p in plans.values() for peer in p.sources})
    return min(16 << 20, max(1 << 20, total // max(8 * connections, 1)))


def _check_round(todo: list[str], plans: dict[str, FilePlan], solo: dict[str, list[str]], report, tmp: Path) -> list[str]:
    """Files of this round whose sha256 (hashed during the transfer) is wrong; drops the peer that
    served them when that is known."""
    bad = [f for f in todo if report.sha256.get(f) != plans[f].sha256]
    for f in bad:
        contributors = report.contributors[f]
        if f in solo:
            culprits = [solo[f].pop(0)]
        elif len(contributors) == 1:
            culprits = list(contributors)
        else:  # several peers served parts: try each alone in turn to find the bad one
            culprits, solo[f] = [], list(plans[f].sources)
        for peer in culprits:
            log.warning("%s served a copy of %s that does not match its sha256; not using it for this file", peer, f)
            plans[f].sources.remove(peer)
        if not plans[f].sources or (f in solo and not solo[f]):
            raise EnvironmentFailure(f"every peer served a copy of {f} that does not match its sha256 "
                                     f"({', '.join(sorted(contributors))}): their snapshots are corrupt")
    return bad
