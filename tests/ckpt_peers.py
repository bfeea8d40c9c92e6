"""Shared by the sidecar and recovery tests: snapshots to serve, raw requests, checking a fetch (the
`peer` fixture that serves them is in conftest)."""

from __future__ import annotations

import http.client
import socket
from pathlib import Path

import torch

from zb.ckpt.format.snapshot import expect_of, load_snapshot, write_snapshot

TOKEN = "t0ken-for-tests-0123456789"


def sample_tensors(seed: int = 0, n: int = 1 << 18) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {"model.safetensors": {"w": torch.randn(n, generator=g), "b": torch.randn(17, generator=g)},
            "outer.safetensors": {"w": torch.randn(n // 2, generator=g)},
            "inner.safetensors": {"m": torch.randn(1000, generator=g)}}


def write_sample(root: Path, step: int = 10, seed: int = 0, node: str = "a") -> Path:
    return write_snapshot(root, sample_tensors(seed), {"node": node}, step, outer_step=step // 10, fingerprint="fp")


def http_get(handle, target: str, token: str | None = TOKEN, method: str = "GET", headers: dict | None = None):
    host, port = handle.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    auth = {"Authorization": f"Bearer {token}"} if token is not None else {}
    conn.request(method, target, headers={**auth, **(headers or {})})
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response, body


def raw_request(handle, request: bytes) -> bytes:
    host, port = handle.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        return s.recv(65536)

def check_fetched(result, files=None):
    expected = sample_tensors()
    expect = {f: expect_of(expected)[f] for f in (files or expected)}
    tensors, meta = load_snapshot(result.path, expect)
    assert meta["node"] in ("a", "b")
    for f in expect:
        for name, t in expected[f].items():
            assert torch.equal(tensors[f][name], t)
