"""Durable HTTP downloads: retries with exponential backoff, atomic rename, one downloader per file.

A file is written to `<dest>.tmp` (resumed with a Range request if a previous attempt left one) and
renamed into place only when complete, so a reader never sees a partial file. A lock file makes
the other local ranks wait for the one that downloads instead of fetching the same bytes again.
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import requests

from zb.errors import EnvironmentFailure

log = logging.getLogger("zb.data")

TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
BASE_WAIT_S = 0.5
MAX_WAIT_S = 16.0
CHUNK = 1 << 18  # small enough that a dropped connection keeps most of what arrived
T = TypeVar("T")


class TransientError(Exception):
    """A failure worth retrying: a 429/5xx answer, a refused or dropped connection, a timeout."""


RETRYABLE = (TransientError, requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)


def check_status(response: requests.Response) -> None:
    """Raise TransientError for retryable statuses; leave other errors to the caller."""
    if response.status_code in TRANSIENT_STATUS:
        raise TransientError(f"HTTP {response.status_code} from {response.url}")


def with_retries(fn: Callable[[], T], retries: int, what: str) -> T:
    """Call `fn`, retrying transient failures `retries` times with jittered exponential backoff."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except RETRYABLE as e:
            if attempt == retries:
                raise EnvironmentFailure(f"{what} failed after {retries + 1} attempts: {_short(e)}; "
                                         "check the network and HF_ENDPOINT, or raise data.retries") from None
            wait = min(MAX_WAIT_S, BASE_WAIT_S * 2**attempt) * random.uniform(0.8, 1.2)
            log.warning("%s: %s; retry %d/%d in %.1fs", what, _short(e), attempt + 1, retries, wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


def _short(e: Exception) -> str:
    """One readable clause: urllib3's nested connection errors reduced to their root cause."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, requests.ConnectionError):
        errno = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
        cause = errno.group(1) if errno else (re.search(r"Caused by (\w+)", text) or [None, "connection failed"])[1]
        host = re.search(r"host='([^']+)', port=(\d+)", text)
        return f"cannot connect to {host.group(1)}:{host.group(2)} ({cause})" if host else cause
    return text[:200]


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def is_complete(dest: Path, size: int | None) -> bool:
    return dest.is_file() and (size is None or dest.stat().st_size == size)


def download(url: str, dest: Path, *, size: int | None, headers: dict, retries: int,
             progress: Callable[[int], None] | None = None) -> bool:
    """Fetch `url` into `dest` unless already complete; returns True if bytes were downloaded."""
    with file_lock(dest):
        if is_complete(dest, size):
            return False
        tmp = Path(f"{dest}.tmp")
        with_retries(lambda: _fetch_to(url, tmp, headers, progress), retries, f"download of {url}")
        if size is not None and tmp.stat().st_size != size:
            got = tmp.stat().st_size
            tmp.unlink()
            raise EnvironmentFailure(f"download of {url} gave {got} bytes, expected {size}; retry later")
        os.replace(tmp, dest)
        return True


def _fetch_to(url: str, tmp: Path, headers: dict, progress: Callable[[int], None] | None) -> None:
    """One attempt: continue a partial .tmp with a Range request when the server supports it."""
    have = tmp.stat().st_size if tmp.exists() else 0
    request_headers = dict(headers, **({"Range": f"bytes={have}-"} if have else {}))
    with requests.get(url, headers=request_headers, stream=True, timeout=(10, 60), allow_redirects=True) as r:
        check_status(r)
        if r.status_code == 416:  # nothing left to fetch: the partial file is whole
            return
        if r.status_code >= 400:
            raise EnvironmentFailure(f"download of {url} failed: HTTP {r.status_code}")
        append = have and r.status_code == 206
        if progress and have and not append:
            progress(-have)
        with open(tmp, "ab" if append else "wb") as out:
            for chunk in r.iter_content(CHUNK):
                out.write(chunk)
                if progress:
                    progress(len(chunk))
        _ensure_whole(r, tmp)


def _ensure_whole(r: requests.Response, tmp: Path) -> None:
    """A connection cut mid-body can end iteration quietly: treat a short body as transient."""
    total = r.headers.get("Content-Range", "").rpartition("/")[2] or r.headers.get("Content-Length")
    if total and total.isdigit() and r.status_code in (200, 206) and tmp.stat().st_size < int(total):
        raise TransientError(f"connection closed early ({tmp.stat().st_size} of {total} bytes)")
