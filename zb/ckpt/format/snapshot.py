"""Write and load tensor-only snapshots (see zb.ckpt.format.manifest for the format).

    path = write_snapshot(root, {"model.safetensors": model_sd, "outer.safetensors": outer_sd},
                          meta={"data": {...}}, step=1200, outer_step=12, fingerprint=run_fp)
    tensors, meta = load_snapshot(path, expect=expect_of({"model.safetensors": model_sd}))

Loading never unpickles anything: safetensors for tensors, JSON for the rest.
"""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from zb.ckpt.format.catalog import CorruptSnapshot, commit, read_manifest, tmp_dir, verify_snapshot
from zb.ckpt.format.manifest import Manifest, TensorInfo, check_file_name, check_snapshot_name, snapshot_name
from zb.ckpt.format.tensorfile import DTYPE_OF_CODE, dtype_code, write_tensor_file
from zb.errors import InvalidInput

__all__ = ["write_snapshot", "load_snapshot", "expect_of"]

Expect = dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]


def write_snapshot(root: Path, tensors: dict[str, dict[str, torch.Tensor]], meta: dict[str, Any], step: int, *,
                   outer_step: int | None = None, fingerprint: str = "", name: str | None = None,
                   threads: int = 2) -> Path:
    """Write a committed snapshot `<root>/<name>` atomically; returns its path.

    `tensors` maps file name (`*.safetensors`) to that file's tensors; `meta` is any JSON object.
    Files are written by `threads` threads (hashing releases the GIL). A snapshot of the same name
    is replaced.
    """
    name = check_snapshot_name(name or snapshot_name(step))
    for file_name in tensors:
        check_file_name(file_name)
    try:
        meta = json.loads(json.dumps(meta))
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"snapshot meta must be JSON-serializable: {e}") from None
    tmp = tmp_dir(Path(root), name)
    try:
        with ThreadPoolExecutor(max(1, min(threads, len(tensors)))) as pool:
            entries = dict(zip(tensors, pool.map(lambda f: write_tensor_file(tmp / f, tensors[f]), tensors)))
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)  # a half-written part on a full disk frees its space
        raise
    manifest = Manifest(name, step, outer_step, fingerprint, time.time(), entries, meta)
    return commit(tmp, manifest)


def expect_of(tensors: dict[str, dict[str, torch.Tensor]]) -> Expect:
    """The `expect` argument of load_snapshot describing these tensors (e.g. the live model's)."""
    return {f: {n: (tuple(t.shape), t.dtype) for n, t in ts.items()} for f, ts in tensors.items()}


def load_snapshot(path: Path, expect: Expect | None = None, *, files: list[str] | None = None,
                  verify: bool = True) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """Load a committed snapshot's tensors and meta.

    `expect` (file -> tensor -> (shape, dtype)) must match exactly: a missing, extra or different
    tensor is an InvalidInput naming it. Only the files in `expect` (else `files`, else all) are
    loaded; with `verify` their sha256 checksums are checked first.
    """
    path = Path(path)
    manifest = read_manifest(path)
    wanted = list(expect) if expect is not None else files if files is not None else list(manifest.files)
    for file_name in wanted:
        if file_name not in manifest.files:
            raise InvalidInput(f"{path}: snapshot has no file {file_name} (it has {', '.join(manifest.files)})")
    if verify:
        verify_snapshot(path, wanted)
    out = {f: _load_file(path, manifest, f, None if expect is None else expect[f]) for f in wanted}
    return out, manifest.meta


def _load_file(path: Path, manifest: Manifest, file_name: str,
               expect: dict[str, tuple[tuple[int, ...], torch.dtype]] | None) -> dict[str, torch.Tensor]:
    where = f"{path / file_name}"
    with safe_open(str(path / file_name), framework="pt") as f:
        header = {k: TensorInfo(f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
        if header != manifest.files[file_name].tensors:
            raise CorruptSnapshot(f"{where}: tensor table differs from the manifest (corrupted snapshot)")
        if expect is not None:
            _check_expect(where, header, expect)
        return {k: f.get_tensor(k) for k in header}


def _check_expect(where: str, header: dict[str, TensorInfo], expect: dict[str, tuple]) -> None:
    for name, (shape, dtype) in expect.items():
        info = header.get(name)
        if info is None:
            raise InvalidInput(f"{where}: tensor {name} is missing from the snapshot")
        if info.shape != tuple(shape) or info.dtype != dtype_code(dtype):
            got = f"{list(info.shape)} {DTYPE_OF_CODE.get(info.dtype, info.dtype)}"
            raise InvalidInput(f"{where}: tensor {name} is {got} in the snapshot, expected {list(shape)} {dtype}")
    extra = sorted(set(header) - set(expect))
    if extra:
        raise InvalidInput(f"{where}: unexpected tensor {extra[0]} in the snapshot"
                           + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
