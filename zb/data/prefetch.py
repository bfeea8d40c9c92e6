"""Batches made ahead of time in a background thread, ready to copy to the device.

    loader = Prefetcher(build_dataloader(...), depth=2, pin_device=torch.cuda.current_device())
    batch = next(loader)              # contiguous (and pinned) tensors, the same as the inner loader's
    state = loader.state_dict()       # the position after the last batch *taken*, not the last made

Tokenizing and packing run while the device computes the current step. Each batch is made
contiguous (the inner loader yields strided views of one buffer) and, for a CUDA run, pinned, so
that `.to(device, non_blocking=True)` is a real asynchronous copy. The state travels with each
batch, so a checkpoint or a slot hand-over resumes exactly after the batches the trainer consumed;
batches made but not taken are made again after a resume.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, TypeVar

import torch

from zb.data.loader import Batch

_END = object()
_MaybeTensor = TypeVar("_MaybeTensor", torch.Tensor, None)   # a batch's field: cu_seqlens may be None


class Prefetcher:
    def __init__(self, loader, *, depth: int = 2, pin_device: int | None = None):
        """pin_device: the rank's CUDA device index to pin batches for (None: no pinning)."""
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, not {depth}")
        self.loader, self.depth, self.pin_device = loader, depth, pin_device
        self.exact_resume = loader.exact_resume
        self.resume_note = loader.resume_note
        self._state = loader.state_dict()
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def __iter__(self) -> Prefetcher:
        return self

    def _start(self) -> None:
        self._stop.clear()
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=self._work, args=(self._queue,), name="zb-batches", daemon=True)
        self._thread.start()

    def _work(self, q: queue.Queue) -> None:
        try:
            if self.pin_device is not None:
                # A new thread's current device is 0: pinning there would open a CUDA context on
                # GPU 0 for every rank.
                torch.cuda.set_device(self.pin_device)
            while not self._stop.is_set():
                batch = next(self.loader)
                self._put(q, (Batch(*map(self._ready, batch)), self.loader.state_dict()))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(q, (_END, e))

    def _put(self, q: queue.Queue, item) -> None:
        """Queue `item`, waiting for room, unless the consumer stopped this thread meanwhile."""
        while not self._stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _ready(self, t: _MaybeTensor) -> _MaybeTensor:
        if t is None:  # a batch without document boundaries
            return None
        t = t.contiguous()
        return t if self.pin_device is None else t.pin_memory()

    def __next__(self) -> Batch:
        if self._thread is None:
            self._start()
        assert self._queue is not None  # _start made it
        batch, state = self._queue.get()
        if batch is _END:
            self._thread = None
            raise state
        self._state = state
        return batch

    def state_dict(self) -> dict[str, Any]:
        return self._state

    def release(self, state: dict[str, Any]) -> None:
        self.loader.release(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()
        self.loader.load_state_dict(state)
        self._state = self.loader.state_dict()

    def close(self) -> None:
        """Stop the thread and drop what it made; the inner loader then stands at an unknown batch,
        so the next use restarts from the last taken position."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.loader.load_state_dict(self._state)
