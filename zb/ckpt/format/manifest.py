"""The snapshot manifest: what a snapshot holds, in plain JSON that is safe to take from a peer.

Layout of a snapshot directory `<root>/<name>/`:

    <file>.safetensors ...   tensors, one or more files
    manifest.json            this module's Manifest, serialized deterministically
    COMMITTED                sha256 (hex) of manifest.json, written last

A manifest read from a peer is untrusted input: `Manifest.from_json` checks every field's type and
every name against strict patterns, so no peer can make us open a path outside a snapshot.
Torch-free on purpose: the sidecar (`zb ckpt-serve`) serves snapshots without importing torch.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from zb.errors import InvalidInput

FORMAT = "zb-snapshot"
VERSION = 1
MANIFEST = "manifest.json"
MARKER = "COMMITTED"
TMP_PREFIX = ".tmp-"

# A snapshot or file name is one path component: no separators, no leading dot (so never `..`
# nor a temporary directory), no `%` or NUL, so no encoding can smuggle a traversal through it.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,115}\.safetensors")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# safetensors dtype codes that zb writes and reads.
DTYPES = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2",
          "U16", "U32", "U64")


def snapshot_name(step: int) -> str:
    """The directory name of a step's snapshot (and of a checkpoint's step directory); zero-padded
    so names sort like steps."""
    return f"step-{step:09d}"


def is_snapshot_name(name: str) -> bool:
    return bool(_NAME.fullmatch(name))


def is_file_name(name: str) -> bool:
    return bool(_FILE.fullmatch(name))


def check_file_name(name: str) -> str:
    if not is_file_name(name):
        raise InvalidInput(f"snapshot file name {name!r} is invalid: use letters, digits, '.', '_', '-' "
                           "and the .safetensors suffix (e.g. model.safetensors)")
    return name


def check_snapshot_name(name: str) -> str:
    if not is_snapshot_name(name):
        raise InvalidInput(f"snapshot name {name!r} is invalid: use letters, digits, '.', '_', '-' "
                           "(at most 128, not starting with '.')")
    return name


@dataclass(frozen=True)
class TensorInfo:
    dtype: str               # safetensors code: F32, BF16, ...
    shape: tuple[int, ...]


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str
    tensors: dict[str, TensorInfo]


@dataclass(frozen=True)
class Manifest:
    name: str
    step: int
    outer_step: int | None
    fingerprint: str
    created: float
    files: dict[str, FileEntry]
    meta: dict[str, Any] = field(default_factory=dict)
    version: int = VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_dict(self) -> dict[str, Any]:
        files = {name: {"size": e.size, "sha256": e.sha256,
                        "tensors": {t: {"dtype": i.dtype, "shape": list(i.shape)} for t, i in e.tensors.items()}}
                 for name, e in self.files.items()}
        return {"format": FORMAT, "version": self.version, "name": self.name, "step": self.step,
                "outer_step": self.outer_step, "fingerprint": self.fingerprint, "created": self.created,
                "files": files, "meta": self.meta}

    def to_json(self) -> bytes:
        """Deterministic bytes (sorted keys), so the commit marker is a function of the content."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str, source: str) -> Manifest:
        """Parse and validate; anything malformed is an InvalidInput naming `source`."""
        try:
            doc = json.loads(data)
            return cls._from_dict(doc)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise InvalidInput(f"{source}: not a valid zb snapshot manifest ({e})") from None

    @classmethod
    def _from_dict(cls, doc: dict[str, Any]) -> Manifest:
        if doc.get("format") != FORMAT:
            raise ValueError(f"format is {doc.get('format')!r}, expected {FORMAT!r}")
        if _int(doc["version"]) > VERSION:
            raise ValueError(f"format version {doc['version']} is newer than this zb ({VERSION}): upgrade zb")
        name = doc["name"]
        if not isinstance(name, str) or not is_snapshot_name(name):
            raise ValueError(f"bad snapshot name {name!r}")
        outer = doc.get("outer_step")
        meta = doc.get("meta", {})
        if not isinstance(meta, dict) or not isinstance(doc["fingerprint"], str):
            raise ValueError("meta must be an object and fingerprint a string")
        files = {_check(n, is_file_name, "file name"): _entry(e) for n, e in _dict(doc["files"]).items()}
        return cls(name, _int(doc["step"]), None if outer is None else _int(outer), doc["fingerprint"],
                   float(doc["created"]), files, meta, _int(doc["version"]))


def _entry(doc: Any) -> FileEntry:
    doc = _dict(doc)
    sha = doc["sha256"]
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise ValueError(f"bad sha256 {sha!r}")
    tensors = {}
    for tname, info in _dict(doc["tensors"]).items():
        info = _dict(info)
        dtype = _check(info["dtype"], lambda d: d in DTYPES, "dtype")
        shape = info["shape"]
        if not isinstance(shape, list):
            raise ValueError(f"shape of {tname!r} is not a list")
        tensors[tname] = TensorInfo(dtype, tuple(_int(d) for d in shape))
    return FileEntry(_int(doc["size"]), sha, tensors)


def _dict(value: Any) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"expected an object, got {type(value).__name__}")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


def _check(value: Any, ok, what: str) -> Any:
    if not isinstance(value, str) or not ok(value):
        raise ValueError(f"bad {what} {value!r}")
    return value


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
