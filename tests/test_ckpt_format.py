"""Snapshots: format, atomic commit, corruption detection, latest, prune, load-time validation."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file

from zb.ckpt.format import catalog
from zb.ckpt.format.catalog import (
    CorruptSnapshot,
    latest_snapshot,
    list_snapshots,
    prune,
    read_manifest,
    verify_snapshot,
)
from zb.ckpt.format.manifest import MANIFEST, MARKER, Manifest
from zb.ckpt.format.snapshot import expect_of, load_snapshot, write_snapshot
from zb.errors import InvalidInput


def _tensors(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.safetensors": {"w": torch.randn(33, 7, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
                              "steps": torch.arange(5, dtype=torch.int64)[::2], "scalar": torch.tensor(3.5),
                              "empty": torch.zeros(0, 4), "mask": torch.tensor([True, False, True])},
        "outer.safetensors": {"w": torch.randn(33, 7, generator=g).half()},
    }


def _write(root, step, seed=0, **kw):
    return write_snapshot(root, _tensors(seed), {"data": {"pos": step}}, step, outer_step=step // 10,
                          fingerprint="fp", **kw)


def test_roundtrip_exact_and_readable_by_safetensors(tmp_path):
    tensors = _tensors()
    path = write_snapshot(tmp_path, tensors, {"a": [1, 2]}, 120, outer_step=12, fingerprint="run-1")
    loaded, meta = load_snapshot(path, expect_of(tensors))
    assert meta == {"a": [1, 2]}
    for file_name, ts in tensors.items():
        reference = load_file(str(path / file_name))  # the safetensors library agrees with our writer
        for name, t in ts.items():
            for got in (loaded[file_name][name], reference[name]):
                assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t.contiguous())
    manifest = read_manifest(path)
    assert (manifest.step, manifest.outer_step, manifest.fingerprint) == (120, 12, "run-1")
    assert manifest.files["model.safetensors"].tensors["b"].dtype == "BF16"
    assert (path / MARKER).read_text() == catalog.sha256_bytes((path / MANIFEST).read_bytes())
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary left behind


def test_crash_before_marker_leaves_nothing_listed(tmp_path, monkeypatch):
    good = _write(tmp_path, 10)
    real = catalog.write_durable

    def crash_on_marker(path, data):
        if path.name == MARKER:
            raise OSError("simulated crash")
        real(path, data)

    monkeypatch.setattr(catalog, "write_durable", crash_on_marker)
    with pytest.raises(OSError):
        _write(tmp_path, 20)
    assert [p for p, _ in list_snapshots(tmp_path)] == [good]
    assert latest_snapshot(tmp_path) == good
    monkeypatch.setattr(catalog, "write_durable", real)
    assert _write(tmp_path, 20).name == "step-000000020"  # the stale temporary is replaced


def test_directory_without_marker_or_with_wrong_marker_is_not_a_snapshot(tmp_path):
    path = _write(tmp_path, 10)
    (path / MARKER).unlink()
    assert list_snapshots(tmp_path) == [] and latest_snapshot(tmp_path) is None
    with pytest.raises(CorruptSnapshot, match="not a committed snapshot"):
        read_manifest(path)
    (path / MARKER).write_text("0" * 64)
    with pytest.raises(CorruptSnapshot, match="does not match"):
        read_manifest(path)


def test_corrupted_and_truncated_files_are_detected(tmp_path):
    path = _write(tmp_path, 10)
    target = path / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-3] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(CorruptSnapshot, match="model.safetensors: sha256 does not match"):
        verify_snapshot(path)
    with pytest.raises(CorruptSnapshot):
        load_snapshot(path)
    load_snapshot(path, files=["outer.safetensors"])  # the other file is fine
    target.write_bytes(bytes(data[:-10]))
    with pytest.raises(CorruptSnapshot, match="truncated"):
        verify_snapshot(path)


def test_latest_skips_a_corrupt_newest_with_a_warning(tmp_path, caplog):
    older = _write(tmp_path, 10)
    newer = _write(tmp_path, 20)
    assert latest_snapshot(tmp_path) == newer
    with open(newer / "outer.safetensors", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    with caplog.at_level(logging.WARNING, logger="zb"):
        assert latest_snapshot(tmp_path) == older
    assert "skipping snapshot" in caplog.text and newer.name in caplog.text
    assert latest_snapshot(tmp_path, full=False) == newer  # the cheap check only sees sizes


def test_prune_keeps_the_newest(tmp_path):
    paths = [_write(tmp_path, step) for step in (30, 10, 20, 40)]
    (tmp_path / ".tmp-step-000000050").mkdir()  # a writer still busy: untouched
    (tmp_path / ".del-step-000000005-abcd").mkdir()  # a deletion that crashed: removed
    deleted = prune(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == ["step-000000010", "step-000000020"]
    assert [p for p, _ in list_snapshots(tmp_path)] == [paths[0], paths[3]]
    assert (tmp_path / ".tmp-step-000000050").is_dir() and not (tmp_path / ".del-step-000000005-abcd").exists()
    assert prune(tmp_path, keep=1) == [paths[0]]
    with pytest.raises(InvalidInput, match="at least 1"):
        prune(tmp_path, keep=0)
    assert latest_snapshot(tmp_path) == paths[3]


def test_same_name_is_replaced_atomically(tmp_path):
    _write(tmp_path, 10, seed=0)
    path = _write(tmp_path, 10, seed=1)
    loaded, _ = load_snapshot(path)
    assert torch.equal(loaded["outer.safetensors"]["w"], _tensors(1)["outer.safetensors"]["w"])
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.mark.parametrize("change, message", [
    (lambda e: e["model.safetensors"].update(w=((33, 8), torch.float32)), "tensor w is \\[33, 7\\] torch.float32"),
    (lambda e: e["model.safetensors"].update(b=((7,), torch.float32)), "tensor b is \\[7\\] torch.bfloat16"),
    (lambda e: e["model.safetensors"].update(extra=((1,), torch.float32)), "tensor extra is missing"),
    (lambda e: e["model.safetensors"].pop("w"), "unexpected tensor w"),
    (lambda e: e.update({"inner.safetensors": {}}), "no file inner.safetensors"),
])
def test_load_validates_names_shapes_dtypes(tmp_path, change, message):
    path = _write(tmp_path, 10)
    expect = expect_of(_tensors())
    change(expect)
    with pytest.raises(InvalidInput, match=message):
        load_snapshot(path, expect)


@pytest.mark.parametrize("tensors, meta, message", [
    ({"../evil.safetensors": {}}, {}, "file name"),
    ({"model.pt": {}}, {}, "file name"),
    ({"model.safetensors": {"x": 3}}, {}, "not a torch.Tensor"),
    ({"model.safetensors": {"x": torch.zeros(2, dtype=torch.complex64)}}, {}, "cannot be stored"),
    ({}, {"x": object()}, "JSON-serializable"),
])
def test_write_rejects_bad_input(tmp_path, tensors, meta, message):
    with pytest.raises(InvalidInput, match=message):
        write_snapshot(tmp_path, tensors, meta, 1)
    assert list_snapshots(tmp_path) == []


@pytest.mark.parametrize("edit", [
    lambda d: d["files"].update({"../x.safetensors": d["files"].pop("model.safetensors")}),
    lambda d: d.update(name="../../etc"),
    lambda d: d["files"]["model.safetensors"].update(sha256="zz"),
    lambda d: d["files"]["model.safetensors"].update(size=-1),
    lambda d: d.update(format="pickle"),
    lambda d: d.update(version=99),
    lambda d: d["files"]["model.safetensors"]["tensors"]["w"].update(dtype="object"),
])
def test_manifest_from_a_peer_is_validated(tmp_path, edit):
    doc = json.loads((_write(tmp_path, 10) / MANIFEST).read_bytes())
    edit(doc)
    with pytest.raises(InvalidInput, match="not a valid zb snapshot manifest"):
        Manifest.from_json(json.dumps(doc), "peer")


@pytest.mark.perf
def test_write_is_fast_enough(tmp_path):
    """~40 MB: a loose bound that still catches an accidental extra copy or re-read per tensor."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tmp_path
    tensors = {"model.safetensors": {f"l{i}": torch.randn(1 << 20) for i in range(10)}}
    import tempfile
    import time

    with tempfile.TemporaryDirectory(dir=root) as d:
        start = time.perf_counter()
        write_snapshot(d, tensors, {}, 1)
        assert time.perf_counter() - start < 2.0
