"""Messages between stage workers: raw tensors behind a small checked header, over TCP, with deadlines.

Never a pickle: a peer's bytes become tensors only through a fixed header, a JSON object of small
fields and raw buffers of declared dtype and shape, all covered by a CRC-32.

    header  <4s B B H q q I>  magic b"ZBSW", version, kind, tensor count, step, micro-batch id, meta length
    meta    JSON object (utf-8), at most MAX_META bytes
    per tensor <B B> dtype code, ndim, then ndim x <q> dims
    payloads  the tensors' bytes, in order, C-contiguous, little-endian
    trailer <I>  CRC-32 of everything before it

Every read and write runs against one deadline (the hop's), so a peer that stalls mid-message costs
at most that deadline, never a hang.
"""

from __future__ import annotations

import json
import socket
import struct
import time
import zlib
from dataclasses import dataclass, field

import torch

MAGIC, VERSION = b"ZBSW", 1
HEADER = struct.Struct("<4sBBHqqI")
TRAILER = struct.Struct("<I")
MAX_META = 1 << 16
MAX_TENSORS = 16
MAX_NDIM = 8
MAX_BYTES = 1 << 34  # 16 GiB per message: anything larger is a corrupt header, not a micro-batch

# kinds
FORWARD, BACKWARD, LOSS, EVAL, STEP, REPLY, NOT_READY, ERROR = range(1, 9)
KIND_NAMES = {FORWARD: "forward", BACKWARD: "backward", LOSS: "loss", EVAL: "eval", STEP: "step", REPLY: "reply",
              NOT_READY: "not-ready", ERROR: "error"}

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.float64]
_CODES = {d: i for i, d in enumerate(_DTYPES)}


class WireError(ConnectionError):
    """The peer sent something that is not a valid message, or the link broke or timed out."""


@dataclass
class Message:
    kind: int
    step: int = 0
    mb: int = 0
    meta: dict = field(default_factory=dict)
    tensors: list[torch.Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def encode(msg: Message) -> list[bytes | memoryview]:
    """The message as buffers to send in order (tensor payloads are not copied)."""
    if len(msg.tensors) > MAX_TENSORS:
        raise ValueError(f"{len(msg.tensors)} tensors in one message (at most {MAX_TENSORS})")
    meta = json.dumps(msg.meta, separators=(",", ":")).encode()
    parts: list[bytes | memoryview] = [HEADER.pack(MAGIC, VERSION, msg.kind, len(msg.tensors), msg.step, msg.mb,
                                                   len(meta)), meta]
    payloads = []
    for t in msg.tensors:
        t = t.detach().to("cpu").contiguous()
        if t.dtype not in _CODES:
            raise ValueError(f"dtype {t.dtype} cannot go on the wire")
        parts.append(struct.pack(f"<BB{t.dim()}q", _CODES[t.dtype], t.dim(), *t.shape))
        # bf16 has no numpy twin: ship its bits as uint8 (the receiver reinterprets by the dtype code).
        payloads.append(t.view(torch.uint8).numpy().data.cast("B") if t.numel() else b"")
    parts += payloads
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    parts.append(TRAILER.pack(crc))
    return parts


def send(sock: socket.socket, msg: Message, deadline: float) -> int:
    """Send `msg` before `deadline` (time.monotonic()); returns the bytes sent."""
    total = 0
    for part in encode(msg):
        view = memoryview(part).cast("B")
        while view:
            sock.settimeout(_remaining(deadline))
            try:
                n = sock.send(view)
            except TimeoutError:
                raise WireError("send timed out") from None
            except OSError as e:
                raise WireError(f"send failed: {e.strerror or e}") from None
            view = view[n:]
            total += n
    return total


def receive(sock: socket.socket, deadline: float) -> tuple[Message, int]:
    """One message before `deadline`; (message, bytes read). WireError on anything malformed."""
    crc = 0

    def read(n: int) -> bytearray:
        nonlocal crc
        buf = _read_exact(sock, n, deadline)
        crc = zlib.crc32(buf, crc)
        return buf

    magic, version, kind, count, step, mb, meta_len = HEADER.unpack(read(HEADER.size))
    if magic != MAGIC:
        raise WireError("not a zb swarm message (bad magic)")
    if version != VERSION:
        raise WireError(f"wire version {version}, this zb speaks {VERSION}: run the same zb version on every worker")
    if kind not in KIND_NAMES or count > MAX_TENSORS or meta_len > MAX_META:
        raise WireError(f"malformed header (kind {kind}, {count} tensors, meta {meta_len} bytes)")
    try:
        meta = json.loads(bytes(read(meta_len))) if meta_len else {}
    except ValueError:
        raise WireError("malformed meta") from None
    specs, total = [], 0
    for _ in range(count):
        code, ndim = struct.unpack("<BB", read(2))
        if code >= len(_DTYPES) or ndim > MAX_NDIM:
            raise WireError(f"malformed tensor header (dtype code {code}, {ndim} dims)")
        shape = struct.unpack(f"<{ndim}q", read(8 * ndim))
        if any(d < 0 for d in shape):
            raise WireError("negative tensor dimension")
        dtype = _DTYPES[code]
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        total += nbytes
        if total > MAX_BYTES:
            raise WireError("message larger than any micro-batch")
        specs.append((dtype, shape, nbytes))
    tensors = []
    for dtype, shape, nbytes in specs:
        raw = read(nbytes)
        tensors.append(torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape) if nbytes
                       else torch.empty(shape, dtype=dtype))
    expected = crc
    (got,) = TRAILER.unpack(_read_exact(sock, TRAILER.size, deadline))
    if got != expected:
        raise WireError("checksum mismatch: the message was corrupted in transit")
    size = HEADER.size + meta_len + TRAILER.size + sum(2 + 8 * len(s) + n for _, s, n in specs)
    return Message(kind, step, mb, meta, tensors), size


def _read_exact(sock: socket.socket, n: int, deadline: float) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        sock.settimeout(_remaining(deadline))
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            raise WireError("receive timed out") from None
        except OSError as e:
            raise WireError(f"receive failed: {e.strerror or e}") from None
        if k == 0:
            raise WireError("connection closed by peer")
        got += k
    return buf


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise WireError("deadline passed")
    return left


def deadline_in(seconds: float) -> float:
    return time.monotonic() + seconds
