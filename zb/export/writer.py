"""Write an export directory safely: everything goes into a temporary sibling, which is renamed into
place only when complete, so OUT never holds half an export and an existing OUT is never
overwritten unless asked (--force), and then only when it is an earlier export (it holds
zb_export.json): never a directory of something else.

Weights are safetensors with Hugging Face's {"format": "pt"} metadata: one `model.safetensors`, or,
above the shard size, `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`
(total_size and a weight_map), as `save_pretrained` writes them.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Literal

import torch

from zb.ckpt.format.tensorfile import write_tensor_file
from zb.errors import EnvironmentFailure, InvalidInput, free_space
from zb.stop_signals import Interrupted, held

PROVENANCE = "zb_export.json"
INDEX = "model.safetensors.index.json"
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}


def parse_size(text: str) -> int:
    """"5GB" (10^9), "500MiB" (2^20), "1000000" (bytes) -> bytes; ValueError otherwise."""
    m = _SIZE.fullmatch(text)
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 5GB, 500MB, 2GiB)")
    size = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])
    if size <= 0:
        raise ValueError(f"{text!r} is not a positive size")
    return size


def check_out(out: Path, force: bool) -> None:
    """Refuse an OUT that exists (unless --force and it is an earlier export, or it is an empty directory)."""
    if not out.exists() and not out.is_symlink():
        # Missing parents are made (as mkdir -p would); one that exists as something else is an error.
        ancestor = out.parent
        while not ancestor.exists() and ancestor != ancestor.parent:
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise InvalidInput(f"output directory {out}: {ancestor} is not a directory")
        return
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        return
    if not force:
        raise InvalidInput(f"output directory {out} exists; choose a new one (nothing was written), or pass --force "
                           "to replace an earlier export")
    if not (out.is_dir() and not out.is_symlink() and (out / PROVENANCE).is_file()):
        raise InvalidInput(f"output directory {out} exists and is not an earlier zb export (no {PROVENANCE}); "
                           "refusing to replace it even with --force")


def shard_plan(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Names per shard, in order, each shard at most max_bytes (a single larger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_weights(tmp: Path, tensors: dict[str, torch.Tensor], max_bytes: int) -> dict[str, str]:
    """The safetensors file(s) (and index) into tmp; returns {file name: sha256} of the weight files
    (hashed while written: zb_export.json records them, so a copy or an upload can be checked)."""
    plan = shard_plan(tensors, max_bytes)
    meta = {"format": "pt"}
    if len(plan) == 1:
        return {"model.safetensors": write_tensor_file(tmp / "model.safetensors", tensors, meta).sha256}
    digests, weight_map = {}, {}
    for i, shard in enumerate(plan, 1):
        file_name = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
        digests[file_name] = write_tensor_file(tmp / file_name, {n: tensors[n] for n in shard}, meta).sha256
        weight_map.update({n: file_name for n in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return digests


def write_json(path: Path, document: dict) -> None:
    path.write_text(json.dumps(document, indent=2) + "\n")


class Staging:
    """A temporary sibling of OUT; `commit` renames it into place (replacing an earlier export when
    forced), and leaving the `with` block without a commit removes it. A stop signal never cuts the
    renames in two, nor a removal (zb.stop_signals)."""

    def __init__(self, out: Path, force: bool):
        self.out, self.force = out, force
        self.tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
        self.committed = False

    def stopped(self) -> str:
        """What a stop signal left, for the CLI's line (asked after the cleanup)."""
        if self.committed:
            return f"after the export was written to {self.out}"
        return f"before the export was complete: {self.out} is as it was and nothing was left behind"

    def __enter__(self) -> Path:
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.tmp.mkdir()
        except OSError as e:
            raise _os_failure(self.out, e) from None
        return self.tmp

    def commit(self) -> None:
        old = None
        with held():   # OUT is never seen half replaced, and `committed` says which side a signal fell on
            if self.out.exists() and any(self.out.iterdir()):
                old = self.out.parent / f".old-{self.out.name}-{uuid.uuid4().hex[:8]}"
                os.rename(self.out, old)
            elif self.out.exists():
                self.out.rmdir()  # an empty directory: nothing to keep
            os.rename(self.tmp, self.out)
            self.committed = True
        if old is not None:
            _remove(old)

    def __exit__(self, kind, error, tb) -> Literal[False]:
        if self.tmp.exists():
            _remove(self.tmp)
        if isinstance(error, OSError):
            raise _os_failure(self.out, error) from None
        return False


def _remove(path: Path) -> None:
    """rmtree that a first stop signal does not cut short: the removal is that signal's own cleanup (a
    second signal still leaves at once)."""
    try:
        shutil.rmtree(path, ignore_errors=True)
    except Interrupted:
        shutil.rmtree(path, ignore_errors=True)
        raise


def _os_failure(out: Path, e: OSError) -> Exception:
    why = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return EnvironmentFailure(f"writing the export {out} failed ({why}; {free_space(out.parent)} there); free "
                                  "space or choose another disk (nothing was left behind)")
    return InvalidInput(f"cannot write the export {out} ({why}); choose a writable directory (nothing was left behind)")
