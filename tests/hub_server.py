"""A local HTTP server emulating the few Hugging Face hub endpoints zb uses, with injectable faults.
huggingface_hub honours HF_ENDPOINT, so pointing it here makes this the hub for its own functions.

    GET  /api/datasets/{repo}                     {"id", "sha"} or 404 RepoNotFound (HfApi.dataset_info)
    GET  /api/datasets/{repo}/tree/{rev}          the file list (files and folders), recursive
    HEAD/GET /datasets/{repo}/resolve/{rev}/{path}  file bytes with the ETag and X-Repo-Commit headers
                                                  hf_hub_download needs; Range requests answered with 206
    HEAD/GET /{repo}/resolve/{rev}/{path}         model repo files (tokenizers)

`hub.fail(substring, times, status, retry_after, method)` answers the next `times` requests whose
path contains `substring` (and whose method is `method`, if given) with `status` (503, 429...),
optionally with a Retry-After header;
`hub.truncate(substring, times)` sends half a body then drops the connection. `hub.log` records
(method, path, status) of every request.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

SHA = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, datasets: dict[str, dict[str, bytes]], models: dict[str, dict[str, bytes]] | None = None):
        self.datasets, self.models = datasets, models or {}
        self.log: list[tuple[str, str, int]] = []
        self._faults: list[list] = []  # [substring, remaining, kind]
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        # zb fetches the next file in a background thread: let it finish here, or it outlives the test,
        # meets a closed port and makes huggingface_hub close its shared HTTP client under the next test.
        for thread in threading.enumerate():
            if thread.name == "zb-prefetch":
                thread.join(timeout=60)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def fail(self, substring: str, times: int, status: int = 503, retry_after: int | None = None,
             method: str | None = None) -> None:
        self._faults.append([substring, times, status, retry_after, method])

    def truncate(self, substring: str, times: int = 1) -> None:
        self._faults.append([substring, times, "truncate", None, "GET"])

    def _fault(self, method: str, path: str):
        with self._lock:
            for fault in self._faults:
                if fault[0] in path and fault[1] > 0 and fault[4] in (None, method):
                    fault[1] -= 1
                    return fault[2], fault[3]
        return None, None

    def downloads(self, status: int = 200) -> list[str]:
        return [p for m, p, s in self.log if "/resolve/" in p and m == "GET" and s in (status, 206)]

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self.do_GET(body=False)

            def do_GET(self, body: bool = True) -> None:
                path = unquote(urlparse(self.path).path)
                fault, retry_after = hub._fault(self.command, path)
                if isinstance(fault, int):
                    headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
                    return self._send(fault, b'{"error": "injected"}', path, headers, body)
                status, payload, headers = hub._route(path)
                if status == 200 and "Range" in self.headers and "/resolve/" in path:
                    start = int(re.match(r"bytes=(\d+)-", self.headers["Range"]).group(1))
                    headers["Content-Range"] = f"bytes {start}-{len(payload) - 1}/{len(payload)}"
                    status, payload = 206, payload[start:]
                self._send(status, payload, path, headers, body, truncate=fault == "truncate")

            def _send(self, status, payload, path, headers=None, body=True, truncate=False) -> None:
                hub.log.append((self.command, path, status))
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if body:
                    self.wfile.write(payload[:len(payload) // 2] if truncate else payload)
                if truncate:
                    self.close_connection = True

        return Handler

    def _route(self, path: str) -> tuple[int, bytes, dict]:
        not_found = (404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
        m = re.match(r"^/api/datasets/([^/]+/[^/]+|[^/]+)(?:/tree/([^/]+))?/?$", path)
        if m:
            files = self.datasets.get(m.group(1))
            if files is None:
                return not_found
            if m.group(2) is None:
                return 200, json.dumps({"id": m.group(1), "sha": SHA}).encode(), {}
            return 200, json.dumps(_tree(files)).encode(), {"Content-Type": "application/json"}
        m = re.match(r"^/(datasets/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if m:
            repos = self.datasets if m.group(1) else self.models
            data = repos.get(m.group(2), {}).get(m.group(4))
            if data is None:
                return 404, b"{}", {"X-Error-Code": "EntryNotFound"}
            return 200, data, {"ETag": f'"{hashlib.sha1(data).hexdigest()}"', "X-Repo-Commit": SHA}
        return not_found


def _tree(files: dict[str, bytes]) -> list[dict]:
    folders = sorted({"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)})
    entries = [{"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "path": f} for f in folders]
    entries += [{"type": "file", "oid": hashlib.sha1(d).hexdigest(), "size": len(d), "path": p}
                for p, d in sorted(files.items())]
    return entries
