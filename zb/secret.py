"""The run secret (elastic.secret_file): reading it, making one, and the keys derived from it.

A secret is any bytes the user keeps in a file (`zb store --new-secret FILE` writes 32 random bytes as hex);
it never travels. What it keys: the authentication of every store record (zb.signed_store) and the
checkpoint sidecar's token (zb.ckpt.sidecar.token), each under its own label, so one derived value never
stands in for another."""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import secrets
import stat
from pathlib import Path

from zb.errors import InvalidInput

log = logging.getLogger("zb")

SECRET_ENV = "ZB_ELASTIC_SECRET_FILE"
MIN_BYTES = 16
SCRYPT_N = 1 << 14
WHERE = f"elastic.secret_file, --secret-file or {SECRET_ENV}"


def read_secret(path: str | Path) -> bytes:
    """The secret in `path` (surrounding whitespace dropped); InvalidInput when it cannot be read or is empty."""
    path = Path(path).expanduser()
    try:
        data = path.read_bytes().strip()
        mode = path.stat().st_mode
    except OSError as e:
        raise InvalidInput(f"cannot read the run secret {path}: {e.strerror or e} ({WHERE}; make one with "
                           f"`zb store --new-secret {path}`)") from None
    if not data:
        raise InvalidInput(f"the run secret {path} is empty; make one with `zb store --new-secret FILE`")
    if len(data) < MIN_BYTES:
        raise InvalidInput(f"the run secret {path} has only {len(data)} bytes: at least {MIN_BYTES} are needed, and "
                           "random ones (a short secret falls to guessing); make one with `zb store --new-secret FILE`")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the run secret %s is readable by other users: chmod 600 it", path)
    return data


def write_new_secret(path: str | Path) -> bytes:
    """Write 32 random bytes, as hex, to a new file readable by its owner only; an existing file is never
    overwritten (it may be the secret of a run in progress)."""
    path = Path(path).expanduser()
    text = secrets.token_hex(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise InvalidInput(f"{path} exists: a run's secret is never overwritten; remove it or name a new file") from None
    except OSError as e:
        raise InvalidInput(f"cannot create the run secret {path}: {e.strerror or e}") from None
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return text.encode()


def derive(secret: bytes, label: str, context: bytes = b"") -> bytes:
    """A key for one purpose (`label`), bound to `context`: HMAC-SHA256 under the stretched secret."""
    return hmac.new(stretched(secret), label.encode() + b"\x00" + context, hashlib.sha256).digest()


@functools.lru_cache(maxsize=8)
def stretched(secret: bytes) -> bytes:
    """The secret through scrypt (16 MiB, ~0.1-0.3 s, once per process and secret): everything derived from it
    is public in part (the store's marker holds a nonce and its proof, records their MACs, the sidecar's token
    crosses the network), so each guess of a secret tested against them offline costs this much, not one HMAC
    (about 528,000 guesses per second on one core before)."""
    return hashlib.scrypt(secret, salt=b"zb run secret v1", n=SCRYPT_N, r=8, p=1, maxmem=64 << 20, dklen=32)


def sidecar_token(secret: bytes) -> str:
    """The checkpoint sidecar's bearer token of a run with this secret (what ZB_CKPT_TOKEN is otherwise)."""
    return derive(secret, "zb ckpt sidecar token").hex()
