"""The ordered document stream of one shard and one split, restartable from any document.

Documents are numbered by a running `count` over the parts of an epoch; this shard keeps
documents whose count is `rr_index` modulo `rr_count` (document-level round robin), and of those
the held-out ones (split "eval") or the others (split "train"). Whether a document is held out
depends only on (its part's name, its index in the part), so the split is the same on every rank,
node and sharding. A position {"epoch", "part", "doc", "count"} names a document; restarting the
stream at a position yields that document first.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from zb.data.grammar import GRAMMAR
from zb.data.hashing import mix64, unit
from zb.errors import InvalidInput

EVAL_SALT = 0x5EED_E7A1


class Part(Protocol):
    name: str
    key: int

    def iter_raw(self, start: int) -> Iterator[tuple[int, Any]]: ...

    def text(self, raw: Any) -> str: ...


class BuiltinPart:
    """The infinite built-in stream: document i is GRAMMAR.document(seed, i)."""

    name = "builtin"
    key = 0

    def __init__(self, seed: int):
        self.seed = seed

    def iter_raw(self, start: int) -> Iterator[tuple[int, Any]]:
        index = start
        while True:
            yield index, index
            index += 1

    def text(self, raw: Any) -> str:
        return GRAMMAR.document(self.seed, raw)[0]


POSITION = ("epoch", "part", "doc", "count")


def is_held_out(part_key: int, doc: int, eval_fraction: float) -> bool:
    return unit(part_key, doc, EVAL_SALT) < eval_fraction


class DocStream:
    kind = "documents"  # of the loader state it resumes from

    def __init__(self, parts: list[Part], rr_index: int, rr_count: int, eval_fraction: float, held_out: bool,
                 source: str, on_release: Callable[[int], None] | None = None):
        if held_out and eval_fraction <= 0:
            raise InvalidInput("data.eval_fraction = 0: there are no held-out documents to evaluate on; "
                               "set it above 0 or turn evaluation off (eval.interval = -1)")
        if not parts:
            raise InvalidInput(f"data.dataset_name_or_paths = {source!r}: this rank has no files to read")
        self.parts, self.rr_index, self.rr_count = parts, rr_index, rr_count
        self.eval_fraction, self.held_out, self.source = eval_fraction, held_out, source
        self._on_release = on_release  # the streamed-file cache's eviction hook (zb.data.evict), if any

    @staticmethod
    def start() -> dict[str, int]:
        return dict.fromkeys(POSITION, 0)

    @staticmethod
    def position(state: dict[str, Any]) -> dict[str, int]:
        """The position in a saved loader state."""
        return {k: int(state[k]) for k in POSITION}

    @staticmethod
    def salt(pos: dict[str, int]) -> tuple[int, ...]:
        """What seeds a shuffle buffer opened at `pos`."""
        return pos["epoch"], pos["count"]

    def release(self, saved: dict[str, int], current: dict[str, int]) -> None:
        """No run will resume before position `saved`; the reader is at `current`: the parts before
        the saved one may go. A saved position from an earlier epoch than the one being read releases
        nothing: the new epoch reads the early parts again."""
        if self._on_release is not None:
            self._on_release(saved["part"] if saved["epoch"] == current["epoch"] else 0)

    def _mine(self, part: Part, doc: int, count: int) -> bool:
        return count % self.rr_count == self.rr_index and \
            is_held_out(part.key, doc, self.eval_fraction) == self.held_out

    def check_nonempty(self) -> None:
        """Raise now, not at the first read, when this shard of this split holds no document."""
        next(self.documents(self.start()))

    def documents(self, pos: dict[str, int]) -> Iterator[tuple[dict[str, int], str]]:
        """(position, text) of this shard's documents from `pos` on; wraps around epochs forever."""
        epoch, first_part, first_doc, count = pos["epoch"], pos["part"], pos["doc"], pos["count"]
        while True:
            found = False
            for p in range(first_part, len(self.parts)):
                part = self.parts[p]
                for doc, raw in part.iter_raw(first_doc if p == first_part else 0):
                    if self._mine(part, doc, count):
                        found = True
                        yield {"epoch": epoch, "part": p, "doc": doc, "count": count}, part.text(raw)
                    count += 1
            if not found and first_part == 0 and first_doc == 0:
                raise InvalidInput(self._none_mine(count))
            epoch, first_part, first_doc, count = epoch + 1, 0, 0, 0

    def _none_mine(self, count: int) -> str:
        """The line for a shard without a document; `count`: the documents of the files this rank reads."""
        docs = f"{count} document{'s' * (count != 1)}"
        where = (f"(shard {self.rr_index} of {self.rr_count}, data.eval_fraction = {self.eval_fraction}, {docs} "
                 "in the files this rank reads)")
        if not self.held_out:
            return (f"data.dataset_name_or_paths = {self.source!r}: no training documents for this rank {where}; "
                    "add data, use fewer ranks or change data.eval_fraction")
        return (f"data.dataset_name_or_paths = {self.source!r} has too few documents to hold out an eval split for "
                f"every rank: none is held out for this rank {where}; add documents (a .txt file's are separated by "
                "blank lines), raise data.eval_fraction, use fewer ranks, or turn evaluation off (eval.interval = -1)")


def shuffled(docs: Iterator[tuple[dict[str, int], str]], size: int, seed: int
             ) -> Iterator[tuple[dict[str, int], str]]:
    """A streaming shuffle buffer. Yields (position of the last document READ, text): resuming there
    skips what was still in the buffer, which is why a shuffled stream cannot resume exactly."""
    rng = random.Random(mix64(seed, size))
    buffer: list[str] = []
    for pos, text in docs:
        if len(buffer) < size:
            buffer.append(text)
            continue
        i = rng.randrange(size)
        out, buffer[i] = buffer[i], text
        yield pos, out
