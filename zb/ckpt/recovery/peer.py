"""HTTP client side of the sidecar protocol: one keep-alive connection to one peer.

Only JSON and raw file bytes come back from a peer; the manifest is parsed by Manifest.from_json,
which validates every field, so a hostile peer can at worst waste our time.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import quote

from zb.ckpt.format.manifest import Manifest
from zb.errors import InvalidInput

MAX_MANIFEST_BYTES = 64 << 20


class PeerError(Exception):
    """A peer failed a request; `fatal` means retrying this peer is pointless (auth, gone snapshot)."""

    def __init__(self, peer: str, message: str, *, status: int | None = None, fatal: bool = False):
        super().__init__(f"{peer}: {message}")
        self.peer, self.status, self.fatal = peer, status, fatal


def parse_peer(peer: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); InvalidInput otherwise."""
    host, sep, port = peer.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInput(f"peer address {peer!r} is not host:port")
    return host, int(port)


class PeerClient:
    """Requests to one peer over a reused connection (reopened after any error)."""

    def __init__(self, peer: str, token: str, timeout: float):
        self.peer = peer
        self.host, self.port = parse_peer(peer)
        self.token, self.timeout = token, timeout
        self.conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def request(self, path: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
        """GET `path`; a connection or protocol failure is a PeerError (the connection is dropped).

        A reused connection the server has since closed (idle timeout) is retried once on a new one,
        so an idle worker is not counted as a failing peer.
        """
        for fresh in (self.conn is None, True):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self.conn.request("GET", path, headers={"Authorization": f"Bearer {self.token}", **(headers or {})})
                response = self.conn.getresponse()
                break
            except (OSError, http.client.HTTPException) as e:
                self.close()
                if fresh:
                    raise PeerError(self.peer, f"request failed: {e or type(e).__name__}") from None
        if response.status == 401:
            self._discard(response)
            raise PeerError(self.peer, "token rejected (check ZB_CKPT_TOKEN / --token-file)", status=401, fatal=True)
        return response

    def _discard(self, response: http.client.HTTPResponse) -> None:
        try:
            response.read(1 << 16)
        except (OSError, http.client.HTTPException):
            self.close()

    def manifest(self, step: int | None = None) -> tuple[str, Manifest] | None:
        """(snapshot name, manifest) of the newest snapshot, or of `step`; None if not there yet."""
        response = self.request("/manifest" + (f"?step={step}" if step is not None else ""))
        if response.status in (503, 404):
            self._discard(response)
            return None
        if response.status != 200:
            self._discard(response)
            raise PeerError(self.peer, f"GET /manifest answered HTTP {response.status}", status=response.status)
        try:
            data = response.read(MAX_MANIFEST_BYTES + 1)
        except (OSError, http.client.HTTPException) as e:
            self.close()
            raise PeerError(self.peer, f"reading the manifest failed: {e}") from None
        if len(data) > MAX_MANIFEST_BYTES:
            self.close()
            raise PeerError(self.peer, "manifest larger than 64 MB", fatal=True)
        try:
            manifest = Manifest.from_json(data, f"manifest from {self.peer}")
            return json.loads(data)["name"], manifest
        except InvalidInput as e:
            raise PeerError(self.peer, str(e), fatal=True) from None

    def open_range(self, name: str, file_name: str, start: int, stop: int, sha256: str) -> http.client.HTTPResponse:
        """Response positioned at byte `start` of the file; checks status, Content-Range and ETag."""
        path = f"/files/{quote(name)}/{quote(file_name)}"
        response = self.request(path, {"Range": f"bytes={start}-{stop - 1}"})
        if response.status != 206:
            self._discard(response)
            gone = response.status in (404, 409)
            raise PeerError(self.peer, f"GET {path} answered HTTP {response.status}"
                            + (" (snapshot pruned or replaced)" if gone else ""), status=response.status, fatal=gone)
        content_range = response.getheader("Content-Range", "")
        if not content_range.startswith(f"bytes {start}-{stop - 1}/") or response.getheader("ETag") != f'"{sha256}"':
            self.close()
            raise PeerError(self.peer, f"GET {path}: unexpected Content-Range or ETag (snapshot replaced?)",
                            fatal=True)
        return response
