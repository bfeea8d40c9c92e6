"""The sidecar's shared secret: derived from the run secret (elastic.secret_file) when the run has one, else from
a file or the ZB_CKPT_TOKEN environment variable; never the store."""

from __future__ import annotations

import logging
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from zb.errors import InvalidInput
from zb.secret import sidecar_token

log = logging.getLogger("zb.ckpt")

TOKEN_ENV = "ZB_CKPT_TOKEN"
MIN_LENGTH = 16


def read_token(token_file: str | Path | None = None, environ: Mapping[str, str] | None = None,
               secret: bytes | None = None) -> str:
    """The token derived from the run `secret` if given, else from `token_file`, else from $ZB_CKPT_TOKEN;
    InvalidInput if there is none."""
    environ = os.environ if environ is None else environ
    if secret is not None:
        ignored = [name for name, given in (("--token-file", token_file), (TOKEN_ENV, environ.get(TOKEN_ENV)))
                   if given]
        if ignored:
            log.warning("%s has no effect: with a run secret (elastic.secret_file) the sidecar's token derives from it",
                        " and ".join(ignored))
        return sidecar_token(secret)
    if token_file is not None:
        token = _from_file(Path(token_file))
    else:
        token = environ.get(TOKEN_ENV, "").strip()
        if not token:
            raise InvalidInput(f"no sidecar token: set {TOKEN_ENV} or pass --token-file "
                               f"(make one with: python -c 'import secrets; print(secrets.token_hex(32))')")
    if not token.isascii():  # it goes into an HTTP header; never echoed: it is a secret
        where = TOKEN_ENV if token_file is None else token_file
        raise InvalidInput(f"the sidecar token ({where}) holds bytes that are not ASCII text; make one "
                           "with: python -c 'import secrets; print(secrets.token_hex(32))'")
    if len(token) < MIN_LENGTH:
        log.warning("the sidecar token has only %d characters; use at least %d random ones", len(token), MIN_LENGTH)
    return token


def _from_file(path: Path) -> str:
    try:
        token = path.read_text().strip()
        mode = path.stat().st_mode
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidInput(f"cannot read the token file {path}: {getattr(e, 'strerror', None) or e}") from None
    if not token:
        raise InvalidInput(f"the token file {path} is empty")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("token file %s is readable by other users: chmod 600 it", path)
    return token


def new_token() -> str:
    return secrets.token_hex(32)
