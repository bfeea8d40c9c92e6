"""Write one safetensors file straight from tensor memory, hashing it on the way.

Why not `safetensors.torch.save_file`: it copies every tensor to bytes first, and the file must then
be read again to hash it. Measured on 400 MB of fp32 in /dev/shm (2 cores): save_file 1.45 s +
sha256 0.40 s, this writer 0.50 s in total. The format is simple and is read back by the
safetensors library itself (tests hold the two against each other): 8-byte little-endian header
length, a JSON header padded with spaces to a multiple of 8, then the tensors' raw bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from zb.ckpt.format.manifest import FileEntry, TensorInfo
from zb.errors import InvalidInput

_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _CODES[getattr(torch, _name)] = _code
DTYPE_OF_CODE = {code: dtype for dtype, code in _CODES.items()}


def dtype_code(dtype: torch.dtype) -> str:
    try:
        return _CODES[dtype]
    except KeyError:
        raise InvalidInput(f"dtype {dtype} cannot be stored in a snapshot (supported: "
                           f"{', '.join(str(d) for d in _CODES)})") from None


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy when it is already a contiguous CPU tensor."""
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data


def _header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
            ) -> tuple[bytes, dict[str, TensorInfo]]:
    table: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    infos: dict[str, TensorInfo] = {}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise InvalidInput(f"snapshot tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        nbytes = t.numel() * t.element_size()
        infos[name] = TensorInfo(dtype_code(t.dtype), tuple(t.shape))
        table[name] = {"dtype": infos[name].dtype, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header = json.dumps(table, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header, infos


def write_tensor_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
                      ) -> FileEntry:
    """Write `tensors` as a safetensors file at `path`, fsync it; returns size, sha256, tensor table.
    `metadata`: the header's optional string map (Hugging Face expects {"format": "pt"})."""
    prefix, infos = _header(tensors, metadata)
    digest = hashlib.sha256(prefix)
    size = len(prefix)
    with open(path, "wb", buffering=0) as f:
        _write_all(f, memoryview(prefix))
        for name in sorted(tensors):
            data = _raw_bytes(tensors[name])
            digest.update(data)
            _write_all(f, data)
            size += data.nbytes
        os.fsync(f.fileno())
    return FileEntry(size, digest.hexdigest(), infos)


def _write_all(f, data: memoryview) -> None:
    """A raw write may be short (Linux caps one write at ~2 GB): loop until all bytes are out."""
    data = data.cast("B")
    while data:
        data = data[f.write(data):]
