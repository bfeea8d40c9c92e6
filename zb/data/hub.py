"""Hugging Face datasets through huggingface_hub: list the data files, pick a data rank's, fetch them.

Calls (all under HF_ENDPOINT, default https://huggingface.co): HfApi.dataset_info (does it exist,
at which commit), HfApi.list_repo_tree (the file list at that commit) and hf_hub_download (the bytes,
pinned to the commit). Files land in Hugging Face's shared cache ($ZB_DATA_CACHE when set, else
huggingface_hub's own: $HF_HUB_CACHE, default ~/.cache/huggingface/hub), so what huggingface_hub or
`datasets` fetched before is reused and huggingface_hub's locking, resume and offline mode apply.
zb's file list is saved in the dataset's cache folder: with HF_HUB_OFFLINE=1 (or when the hub is
unreachable) a node trains from what `zb subset-data` or an earlier run fetched.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zb.config import ConfigError
from zb.data.retry import short, status_of, with_retries
from zb.errors import EnvironmentFailure, InvalidInput

log = logging.getLogger("zb.data")

DATA_EXTENSIONS = (".parquet", ".jsonl", ".json", ".jsonl.gz", ".json.gz", ".txt")
LISTING = ".zb-listing.json"
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int | None


@dataclass(frozen=True)
class HubDataset:
    repo_id: str
    revision: str
    files: tuple[RemoteFile, ...]
    cache_dir: Path

    def cached(self, remote: RemoteFile) -> Path | None:
        """The local copy if the cache holds it (no network)."""
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(self.repo_id, remote.path, cache_dir=self.cache_dir, revision=self.revision,
                                       repo_type="dataset")
        return Path(found) if isinstance(found, str) else None

    def fetch(self, remote: RemoteFile, retries: int) -> Path:
        """The local copy of `remote`, downloaded first unless the cache holds it."""
        return hub_download(self.repo_id, remote.path, repo_type="dataset", revision=self.revision,
                            cache_dir=self.cache_dir, retries=retries)


def hub_download(repo_id: str, filename: str, *, repo_type: str, revision: str | None, cache_dir: Path,
                 retries: int) -> Path:
    """hf_hub_download with zb's retries (offline: the cached copy); failures are EnvironmentFailure."""
    check_endpoint()
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError, disable_progress_bars

    disable_progress_bars()  # its tqdm bars would garble zb's own display and logs (process-wide)
    what = f"{filename} of {repo_id}"
    kwargs: dict[str, Any] = dict(repo_type=repo_type, revision=revision, cache_dir=cache_dir, endpoint=hub_endpoint())
    try:
        unreachable = None if offline() else unresolvable_hub()
        if offline() or unreachable:
            return Path(hf_hub_download(repo_id, filename, local_files_only=True, **kwargs))
        path = Path(with_retries(lambda: hf_hub_download(repo_id, filename, **kwargs), retries, f"download of {what}"))
        _reached_hub()
        return path
    except LocalEntryNotFoundError:  # offline or unresolvable: online, with_retries turned it into EnvironmentFailure
        if unreachable:
            raise EnvironmentFailure(f"download of {what}: {unreachable}, and the cache {cache_dir} has no copy "
                                     f"({OFFLINE_HINT})") from None
        raise EnvironmentFailure(f"HF_HUB_OFFLINE is set and {what} is not in the cache {cache_dir}") from None
    except HfHubHTTPError as e:
        if status_of(e) in (401, 403, 404):   # no such repo or file, or no access: the name given is wrong
            raise InvalidInput(f"download of {what} from {hub_endpoint()} failed: {short(e)} (no such repo or file, "
                               "or a private one: check the name, or set HF_TOKEN)") from None
        raise EnvironmentFailure(f"download of {what} from {hub_endpoint()} failed: {short(e)}") from None
    except OSError as e:  # the disk: full, read-only
        raise EnvironmentFailure(f"download of {what} into {cache_dir} failed: {e}") from None


OFFLINE_HINT = "is this machine offline? HF_HUB_OFFLINE=1 uses only what the cache holds"
_reached = False   # this process got an answer from the hub: a DNS failure now is a blip, worth the retries


def _reached_hub() -> None:
    global _reached
    _reached = True


def unresolvable_hub() -> str | None:
    """Why the hub's host name does not resolve, or None. Until this process has reached the hub once,
    such a name fails the call at once: on a machine without internet every attempt would fail alike
    (retried, with huggingface_hub's own retries inside zb's: 2.5 minutes and 75 log lines)."""
    import socket
    from urllib.parse import urlsplit

    if _reached:
        return None
    host = urlsplit(hub_endpoint()).hostname
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as e:
        return f"the hub's name {host} does not resolve ({e.strerror})"
    except UnicodeError as e:   # a host name the resolver cannot even encode
        return f"the hub's name {host!r} is not valid ({e})"
    return None


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or _constants().ENDPOINT).rstrip("/")


def check_endpoint() -> None:
    """HF_ENDPOINT, if set, must be an http(s) URL with a host: else every request fails only after
    all retries, and one huggingface_hub cannot parse fails its import (a ValueError traceback)."""
    endpoint = os.environ.get("HF_ENDPOINT")
    if not endpoint:
        return
    from urllib.parse import urlsplit

    try:
        url = urlsplit(endpoint)
        problem = None if url.scheme in ("http", "https") and url.hostname else ""
    except ValueError as e:  # an unclosed [IPv6] bracket, a port that is not a number
        problem = f" ({e})"
    if problem is not None:
        raise InvalidInput(f"HF_ENDPOINT = {endpoint!r} (from env HF_ENDPOINT): not an http(s) URL{problem}; set it "
                           "to the hub or mirror's URL (e.g. https://huggingface.co) or unset it")


def _constants():
    """huggingface_hub's settings, after HF_ENDPOINT was checked (they are read at its import)."""
    check_endpoint()
    from huggingface_hub import constants

    return constants


def cache_root() -> Path:
    """Where hub files are cached: $ZB_DATA_CACHE, else huggingface_hub's cache (shared with its other users)."""
    return Path(os.environ.get("ZB_DATA_CACHE") or _constants().HF_HUB_CACHE).expanduser()


def offline() -> bool:
    """HF_HUB_OFFLINE, as zb and huggingface_hub (which reads it once, at import) both see it."""
    constants = _constants()

    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes")


def open_dataset(repo_id: str, *, key: str, retries: int, cache_dir: Path | None = None,
                 downloading: bool = False) -> HubDataset:
    """The dataset's file list: from the hub, or from the saved list when offline or unreachable.
    `downloading`: the caller is there to fetch the files (zb subset-data), so "fetch them first" is no way out."""
    check_endpoint()
    cache_dir = cache_dir or cache_root()
    endpoint = hub_endpoint()
    if not REPO_ID.match(repo_id):
        raise InvalidInput(f"{key} = {repo_id!r}: not a local path and not a Hugging Face dataset name (owner/name)")
    saved = _read_listing(repo_id, cache_dir)
    if offline():
        if saved is None:
            raise InvalidInput(_offline_without_list(repo_id, key, cache_dir, downloading))
        return saved
    try:
        revision = _probe(repo_id, endpoint, key, retries)
    except EnvironmentFailure:
        if saved is None:
            raise
        log.warning("hub %s unreachable; using the saved file list of %s from %s", endpoint, repo_id, cache_dir)
        return saved
    if saved is not None and saved.revision == revision:  # a commit's files never change
        return saved
    dataset = HubDataset(repo_id, revision, _list_files(repo_id, revision, endpoint, retries), cache_dir)
    _save_listing(dataset)
    return dataset


def _offline_without_list(repo_id: str, key: str, cache_dir: Path, downloading: bool) -> str:
    if downloading:
        return (f"{key} = {repo_id!r}: HF_HUB_OFFLINE is set, which forbids the downloads zb subset-data makes "
                f"({cache_dir} holds no file list of it yet); unset HF_HUB_OFFLINE to fetch it, or, with a local "
                "copy of its files, train on them directly (data.dataset_name_or_paths = their paths)")
    return (f"{key} = {repo_id!r}: HF_HUB_OFFLINE is set and {cache_dir} holds no saved file list; "
            "fetch the files first with `zb subset-data` (and point ZB_DATA_CACHE at its --out)")


def _probe(repo_id: str, endpoint: str, key: str, retries: int) -> str:
    """The dataset's current commit; a clear InvalidInput when the hub does not know it."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import HfHubHTTPError

    what = f"looking up dataset {repo_id} on {endpoint}"
    unreachable = unresolvable_hub()
    if unreachable:
        raise EnvironmentFailure(f"{what}: {unreachable} ({OFFLINE_HINT}, after `zb subset-data` fetched the files)")
    try:
        info = with_retries(lambda: HfApi(endpoint=endpoint).dataset_info(repo_id), retries, what)
        _reached_hub()
    except HfHubHTTPError as e:
        if status_of(e) in (401, 403, 404):
            local = "" if "/" in repo_id else ", nor a local path"
            raise InvalidInput(f"{key} = {repo_id!r}: no such dataset on {endpoint} (HTTP {status_of(e)}){local}; "
                               "check the name (owner/name), or set HF_TOKEN for a private or gated dataset") from None
        raise EnvironmentFailure(f"{what}: {short(e)}") from None
    return info.sha or "main"


def _list_files(repo_id: str, revision: str, endpoint: str, retries: int) -> tuple[RemoteFile, ...]:
    from huggingface_hub import HfApi
    from huggingface_hub.utils import HfHubHTTPError

    what = f"listing the files of dataset {repo_id} on {endpoint}"
    api = HfApi(endpoint=endpoint)
    try:
        entries = with_retries(lambda: list(api.list_repo_tree(repo_id, repo_type="dataset", revision=revision,
                                                               recursive=True)), retries, what)
    except HfHubHTTPError as e:
        raise EnvironmentFailure(f"{what}: {short(e)}") from None
    files = [RemoteFile(e.path, getattr(e, "size", None)) for e in entries if hasattr(e, "size")]
    return tuple(sorted(files, key=lambda f: f.path))


def repo_folder(repo_id: str, cache_dir: Path) -> Path:
    """The dataset's folder in huggingface_hub's cache layout (datasets--owner--name): zb keeps its
    own notes there, beside blobs/, refs/ and snapshots/, so they travel with the files."""
    return cache_dir / ("datasets--" + repo_id.replace("/", "--"))


def _listing_path(repo_id: str, cache_dir: Path) -> Path:
    return repo_folder(repo_id, cache_dir) / LISTING


def _save_listing(ds: HubDataset) -> None:
    path = _listing_path(ds.repo_id, ds.cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"repo_id": ds.repo_id, "revision": ds.revision, "files": [[f.path, f.size] for f in ds.files]}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def _read_listing(repo_id: str, cache_dir: Path) -> HubDataset | None:
    path = _listing_path(repo_id, cache_dir)
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    return HubDataset(repo_id, doc["revision"], tuple(RemoteFile(p, s) for p, s in doc["files"]), cache_dir)


def name_and_config(entry: str, config: str | None, key: str) -> tuple[str, str | None]:
    """(dataset, config) of an entry: Prime's "owner/name:config" spelling, or the name alone with
    data.dataset_config; both may name the config, but not two different ones."""
    name, colon, own = (part.strip() for part in entry.partition(":"))
    if not colon:
        return name, config
    if not own:
        raise ConfigError(f"{key} = {entry!r}: nothing follows ':'; write owner/name:config, or leave the ':' out")
    if config and config != own:
        raise ConfigError(f"{key} = {entry!r} names config {own!r} but data.dataset_config = {config!r}; "
                          "give the config once (either spelling)")
    return name, own


def select_files(files: tuple[RemoteFile, ...], split: str, config: str | None, key: str) -> list[RemoteFile]:
    """Data files of one split (and config), by the hub's naming conventions."""
    data = [f for f in files if f.path.endswith(DATA_EXTENSIONS)
            and not any(part.startswith(".") for part in f.path.split("/"))]
    if config:
        prefix = config.replace("-", "/") + "/"
        data = [f for f in data if config in f.path.split("/")[:-1] or f.path.startswith(prefix)]
    if not data:
        raise InvalidInput(f"{key}: the dataset has no data files ({', '.join(DATA_EXTENSIONS)})"
                           + (f" for config {config!r}" if config else ""))
    named = [f for f in data if split in re.split(r"[/_.\-]", f.path)]
    if named:
        return named
    if split == "train":  # datasets without split names hold only training data
        return data
    raise InvalidInput(f"data.split = {split!r}: no file of the dataset is named after this split")


def rank_files(files: list[RemoteFile], data_rank: int, data_world_size: int) -> tuple[list[RemoteFile], bool]:
    """(files this data rank reads, whether files were split between ranks).

    Files are dealt round robin when there are at least as many as data ranks; otherwise every rank
    gets every file and documents are dealt instead.
    """
    if len(files) >= data_world_size:
        return files[data_rank::data_world_size], True
    return list(files), False
