"""A node's checkpoints on remote storage (ckpt.remote.path, any fsspec URL): upload, prune, list,
and download back for a resume on a machine whose disk is gone (a replaced spot instance).

Layout, per node: `<remote.path>/<node id>/step-000000100/rank-0/` with the files of the part,
`manifest.json` and the `COMMITTED` marker. Object stores have no atomic rename, so an upload
sends the files first, `manifest.json` next and `COMMITTED` last, and a reader trusts a part only
when the marker matches the manifest. A download lands in `.tmp-rank-N`, every file's size and
sha256 is checked against the manifest, and only then is the part committed locally.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from zb.ckpt.durable.layout import part_count, part_name, step_from_name
from zb.ckpt.durable.lineage import Entry, Origin, entry_of, plan_prune
from zb.ckpt.format.catalog import commit, read_committed, sha256_file, tmp_dir
from zb.ckpt.format.manifest import MANIFEST, MARKER, Manifest, sha256_bytes, snapshot_name
from zb.errors import EnvironmentFailure, InvalidInput, missing_extra

log = logging.getLogger("zb.ckpt")

# URL scheme -> the fsspec backend the `remote` extra installs for it (pyproject.toml).
REMOTE_EXTRA = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}


def remote_fs(url: str):
    import fsspec

    return fsspec.core.url_to_fs(url)


def check_remote(url: str) -> None:
    """Fail at start, not at the first upload hours later, when no fsspec backend serves the URL."""
    try:
        remote_fs(url)
    except ImportError as e:  # the URL is fine, this machine lacks its backend
        scheme = url.split("://", 1)[0].lower()
        if scheme in REMOTE_EXTRA:
            raise missing_extra(f"ckpt.remote.path {url!r}", REMOTE_EXTRA[scheme], "remote") from None
        raise EnvironmentFailure(f"ckpt.remote.path {url!r}: {e}") from None
    except ValueError as e:  # fsspec knows no such protocol
        raise InvalidInput(f"ckpt.remote.path {url!r}: {e}") from None


def upload_part(src: Path, url: str) -> int:
    """Upload a committed part to an fsspec URL (a directory), marker last; returns bytes sent."""
    manifest = read_committed(src)
    fs, root = remote_fs(url)
    # A stale marker from an earlier attempt must go first, or a partial copy would look committed.
    if fs.exists(f"{root}/{MARKER}"):
        fs.rm(f"{root}/{MARKER}")
    fs.makedirs(root, exist_ok=True)
    sent = 0
    for name in [*manifest.files, MANIFEST, MARKER]:
        fs.put_file(str(src / name), f"{root}/{name}")
        sent += (src / name).stat().st_size
    return sent


def prune_remote(url: str, running: Origin, keep: int) -> list[tuple[int, str]]:
    """Delete the step directories under a remote node directory that lineage.plan_prune names (the
    same rule as on ckpt.path); (step, why) of each."""
    fs, root = remote_fs(url)
    if not fs.exists(root):
        return []
    found, _ = _scan(fs, root)
    doomed = plan_prune(found, running, keep)
    for step, _ in doomed:
        fs.rm(f"{root}/{snapshot_name(step)}", recursive=True)
    return doomed


def read_remote_manifest(fs, part: str) -> Manifest:
    """The manifest of a remote part, trusted only when its COMMITTED marker matches it."""
    try:
        data, marker = fs.cat_file(f"{part}/{MANIFEST}"), fs.cat_file(f"{part}/{MARKER}")
    except FileNotFoundError:
        raise InvalidInput(f"{part} is not a committed part (no {MARKER} or {MANIFEST})") from None
    if sha256_bytes(data) != marker.strip().decode("ascii", "replace"):
        raise InvalidInput(f"{part}: {MARKER} does not match {MANIFEST} (a cut or edited upload)")
    return Manifest.from_json(data, f"{part}/{MANIFEST}")


def remote_steps(url: str) -> list[int]:
    """Steps under a node's remote directory whose every local rank's part is committed, oldest first.

    An unreachable remote is logged and counts as empty: resuming then falls back to what is local.
    """
    return remote_scan(url)[0]


def remote_scan(url: str) -> tuple[list[int], dict[int, str]]:
    """(complete remote steps oldest first, {step: why it is not complete}); see remote_steps."""
    done, bad = remote_entries(url)
    return sorted(done), bad


def remote_entries(url: str) -> tuple[dict[int, Entry], dict[int, str]]:
    """({step: lineage entry} of the complete remote steps, {step: why it is not complete}).
    An unreachable remote is logged and counts as empty."""
    try:
        fs, root = remote_fs(url)
        if not fs.exists(root):
            return {}, {}
        return _scan(fs, root)
    except Exception as e:  # noqa: BLE001 - any backend error: the remote is just not usable now
        log.warning("cannot list the remote checkpoints at %s: %s: %s", url, type(e).__name__, e)
        return {}, {}


def _scan(fs, root: str) -> tuple[dict[int, Entry], dict[int, str]]:
    done, bad = {}, {}
    for entry in fs.ls(root, detail=False):
        step = step_from_name(entry.rstrip("/").rsplit("/", 1)[-1])
        if step is None:
            continue
        try:
            first = read_remote_manifest(fs, f"{root}/{snapshot_name(step)}/{part_name(0)}")
            for rank in range(1, part_count(first)):
                read_remote_manifest(fs, f"{root}/{snapshot_name(step)}/{part_name(rank)}")
            done[step] = entry_of(first)
        except Exception as e:  # noqa: BLE001 - an incomplete or unreadable step is simply not listed
            bad[step] = str(e)
    return done, bad


def download_part(url: str, step: int, local_rank: int, dst_root: Path) -> Path:
    """Fetch this rank's part of `step` from a node's remote directory into `dst_root`, verified,
    committed; returns the local part. Raises InvalidInput (not a committed part, bytes that do not
    match the manifest) or EnvironmentFailure (the remote cannot be read)."""
    started, tmp = time.perf_counter(), None
    try:
        fs, root = remote_fs(url)
        remote_part = f"{root}/{snapshot_name(step)}/{part_name(local_rank)}"
        manifest = read_remote_manifest(fs, remote_part)
        if manifest.name != part_name(local_rank) or manifest.step != step:
            raise InvalidInput(f"{remote_part}: its manifest describes {manifest.name} of step {manifest.step}")
        step_dir = Path(dst_root) / snapshot_name(step)
        step_dir.mkdir(parents=True, exist_ok=True)
        tmp = tmp_dir(step_dir, part_name(local_rank))
        log.info("downloading checkpoint step %d (%s bytes) from %s", step, f"{manifest.total_bytes:,}", remote_part)
        for name, entry in manifest.files.items():
            fs.get_file(f"{remote_part}/{name}", str(tmp / name))
            if (tmp / name).stat().st_size != entry.size or sha256_file(tmp / name) != entry.sha256:
                raise InvalidInput(f"{remote_part}/{name} does not match its manifest (size or sha256)")
    except Exception as e:  # noqa: BLE001 - fsspec backends raise their own error types
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, InvalidInput):
            raise
        raise EnvironmentFailure(f"downloading checkpoint step {step} from {url} failed: "
                                 f"{type(e).__name__}: {e}") from None
    part = commit(tmp, manifest)
    log.info("checkpoint step %d downloaded to %s in %.1f s", step, part, time.perf_counter() - started)
    return part
