"""Digest of a rank's outer params: the check-in compares nodes' digests (zb.diloco.checkin), so a
node whose params differ from the run's receives the state instead of contributing, and
`train.log_model_hash` logs it so agreement can be checked from outside.

The outer params change only at an outer step, so their digest is computed in a thread right after
one (hashlib drops the GIL) and is ready long before the next check-in needs it.
"""

from __future__ import annotations

import hashlib
import threading

import torch


def digest(flat: torch.Tensor) -> bytes:
    """sha256 of the buffer's bytes, read in place (a copy through tobytes() took twice as long)."""
    return hashlib.sha256(flat.detach().contiguous().numpy().data.cast("B")).digest()


class BackgroundDigest:
    """digest(flat) computed in a thread; `flat` must not change until result() returned."""

    def __init__(self, flat: torch.Tensor) -> None:
        self._value: bytes | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(flat,), name="zb-params-digest", daemon=True)
        self._thread.start()

    def _run(self, flat: torch.Tensor) -> None:
        try:
            self._value = digest(flat)
        except BaseException as e:  # noqa: BLE001 - handed to the caller of result()
            self._error = e

    def result(self) -> bytes:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._value is not None  # the thread ended without an error: it set the digest
        return self._value
