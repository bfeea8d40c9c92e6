"""Request parsing for the sidecar: the token of a request head, the route of a raw request target and single
byte ranges.

Kept apart from the server so the rules that guard the filesystem are small and testable alone.
"""

from __future__ import annotations

import hmac
import http.client
import io
import re
from urllib.parse import unquote

from zb.ckpt.format.manifest import is_file_name, is_snapshot_name

# ASCII digits only (\d and int() also take other scripts' digits), at most 19 of them: past int64
# no file exists, and int() refuses strings of over 4300 digits with a ValueError.
_POSITION = r"([0-9]{0,19})"
_RANGE = re.compile(f"bytes={_POSITION}-{_POSITION}")
_STEP = re.compile(r"[0-9]{1,19}")


class HttpError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers or {}


def head_end(head: bytes | bytearray) -> int | None:
    """Where a request head ends (just past its empty line, CRLF or bare LF as http.server takes either), or
    None while it has not."""
    ends = [i + len(mark) for mark in (b"\n\r\n", b"\n\n") if (i := head.find(mark)) >= 0]
    return min(ends) if ends else None


def head_token(head: bytes) -> str:
    """The Authorization header of a whole request head as http.server parses it ('' when absent or unparsable):
    the sidecar's door checks the same value its handler does."""
    _, _, lines = head.partition(b"\n")
    try:
        return http.client.parse_headers(io.BytesIO(lines)).get("Authorization", "")
    except (http.client.HTTPException, ValueError):
        return ""


def token_matches(authorization: str, token: bytes) -> bool:
    """`Bearer <token>`, compared in constant time."""
    scheme, _, credential = authorization.partition(" ")
    given = credential.strip().encode() if scheme.lower() == "bearer" else b""
    return hmac.compare_digest(given, token)


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """Half-open (start, stop) of a single `bytes=` range, None without a Range header; 416 if bad."""
    if header is None:
        return None
    m = _RANGE.fullmatch(header.strip())
    unsatisfiable = HttpError(416, f"bad or unsatisfiable range {header!r} for {size} bytes",
                              {"Content-Range": f"bytes */{size}"})
    if not m or not (m[1] or m[2]):
        raise unsatisfiable
    if m[1]:
        start = int(m[1])
        stop = size if not m[2] else min(int(m[2]) + 1, size)
        if m[2] and int(m[2]) < start:
            raise unsatisfiable
    else:
        start, stop = max(0, size - int(m[2])), size
        if int(m[2]) == 0:
            raise unsatisfiable
    if start >= size:
        raise unsatisfiable
    return start, stop


def parse_step(values: list[str] | None) -> int | None:
    """The N of `?step=N` (parse_qs values), None without one; 400 unless one plain non-negative integer."""
    if values is None:
        return None
    if len(values) != 1 or not _STEP.fullmatch(values[0]):
        raise HttpError(400, "step must be one non-negative integer (ASCII digits, at most 19)")
    return int(values[0])


def route(target: str) -> tuple[str, ...]:
    """("manifest", query) or ("file", snapshot, file) from a raw request target; HttpError otherwise."""
    if "\x00" in target or "\\" in target or not target.startswith("/") or "#" in target:
        raise HttpError(400, "malformed request path")
    raw_path, _, query = target.partition("?")
    try:
        parts = [unquote(p, errors="strict") for p in raw_path.split("/")[1:]]
    except UnicodeDecodeError:
        raise HttpError(400, "malformed request path") from None
    if parts == ["manifest"]:
        return ("manifest", query)
    if len(parts) == 3 and parts[0] == "files":
        if not is_snapshot_name(parts[1]) or not is_file_name(parts[2]):
            raise HttpError(400, "invalid snapshot or file name")
        return ("file", parts[1], parts[2])
    raise HttpError(404, "no such endpoint (GET /manifest or /files/<snapshot>/<file>)")
