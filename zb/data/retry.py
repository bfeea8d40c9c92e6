"""Retries around huggingface_hub calls, with jittered exponential backoff and Retry-After.

huggingface_hub retries some failures itself, and which ones depends on its version (2.x retries a
429 and resumes a download whose connection dropped, but gives up on a 503, and its dataset_info
call retries nothing). zb retries the whole call `data.retries` times on top, so a hub that is down
for a minute costs a pause, not the run; a Retry-After header sets the least it waits.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable
from typing import TypeVar

from zb.errors import EnvironmentFailure

log = logging.getLogger("zb.data")

TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
BASE_WAIT_S = 0.5
MAX_WAIT_S = 16.0
MAX_RETRY_AFTER_S = 300.0  # a server asking for longer is treated as down, not as busy
# Network errors of the HTTP stacks huggingface_hub has used (requests before 1.0, httpx, httpx2).
NETWORK_MODULES = ("httpx", "httpx2", "httpcore", "requests", "urllib3")
T = TypeVar("T")


def status_of(e: BaseException) -> int | None:
    return getattr(getattr(e, "response", None), "status_code", None)


def is_transient(e: BaseException) -> bool:
    """Worth retrying: a 408/429/5xx answer, a refused or dropped connection, a timeout."""
    from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError

    if isinstance(e, LocalEntryNotFoundError):  # hf_hub_download: hub unreachable and no cached copy
        return True
    if isinstance(e, HfHubHTTPError):
        return status_of(e) in TRANSIENT_STATUS
    return isinstance(e, (ConnectionError, TimeoutError)) or type(e).__module__.split(".")[0] in NETWORK_MODULES


def with_retries(fn: Callable[[], T], retries: int, what: str) -> T:
    """Call `fn`, retrying transient failures `retries` times; other exceptions pass through."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - sorted by is_transient, the rest re-raised as is
            if not is_transient(e):
                raise
            if attempt == retries:
                raise EnvironmentFailure(f"{what} failed after {retries + 1} attempts: {short(e)}; "
                                         "check the network and HF_ENDPOINT, or raise data.retries") from None
            wait = _wait(e, attempt)
            log.warning("%s: %s; retry %d/%d in %.1fs", what, short(e), attempt + 1, retries, wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


def _wait(e: BaseException, attempt: int) -> float:
    wait = min(MAX_WAIT_S, BASE_WAIT_S * 2**attempt) * random.uniform(0.8, 1.2)
    headers = getattr(getattr(e, "response", None), "headers", None) or {}
    after = str(headers.get("Retry-After", "")).strip()
    return max(wait, min(MAX_RETRY_AFTER_S, float(after))) if after.isdigit() else wait


def short(e: BaseException) -> str:
    """One readable clause: an HTTP status, or a connection error reduced to its root cause."""
    if status_of(e) is not None:
        return f"HTTP {status_of(e)}"
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    errno = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", str(e))
    return errno.group(1).strip() if errno else text[:200]
