"""A mixture of sources (data.dataset_ratio): each document is drawn from one source, by weight.

Draws are per document, before packing, as in Prime: a ratio means the same there and here, and
every packed row mixes sources. A source's share of tokens is its weight times its mean document
length, over the weighted mean of all sources' lengths.

Draw k of a shard picks the source whose cumulative weight first exceeds unit(seed, k): a pure
function of the seed (of the run and the shard) and k, so the sampler's whole state is the plain
number k, and a resume needs no replay (Prime kept a random.Random and replayed every draw).
Each source is its own DocStream, sharded over ranks on its own and with its own epochs: a source
that runs out starts its next epoch while the others go on (Prime's sources were infinite too), so
the weights hold for the whole run and a small source repeats more often.

A position names one document: {"draws": k, "sources": [...]}, one {"epoch", "part", "doc",
"count", "skip"} per source, where the document's own source stands at the document and every
other source after the last document taken from it ("skip": 1) or at its start.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from typing import Any

from zb.data.hashing import unit
from zb.data.stream import POSITION, DocStream
from zb.errors import InvalidInput

MIX_SALT = 0x313C_0D5E


class MixedStream:
    kind = "mixture"  # of the loader state it resumes from

    def __init__(self, streams: list[DocStream], weights: list[float], seed: int):
        if len(streams) != len(weights) or not all(w > 0 for w in weights):
            raise ValueError(f"{len(streams)} sources need as many positive weights, not {weights}")
        self.streams, self.seed = streams, seed
        total = sum(weights)
        self.cumulative = [c / total for c in itertools.accumulate(weights)]

    def pick(self, draw: int) -> int:
        """The source of draw `draw`."""
        # min(): the last cumulative weight may round to just below 1.
        return min(bisect.bisect_right(self.cumulative, unit(self.seed, MIX_SALT, draw)), len(self.streams) - 1)

    def start(self) -> dict[str, Any]:
        return {"draws": 0, "sources": [{**DocStream.start(), "skip": 0} for _ in self.streams]}

    def position(self, state: dict[str, Any]) -> dict[str, Any]:
        """The position in a saved loader state."""
        sources = state.get("sources")
        if not isinstance(sources, list) or len(sources) != len(self.streams):
            saved = len(sources) if isinstance(sources, list) else "no"
            raise InvalidInput(f"the saved data position mixes {saved} sources but data.dataset_name_or_paths "
                               f"names {len(self.streams)}; use the sources it was saved with to resume")
        return {"draws": int(state["draws"]),
                "sources": [{k: int(p[k]) for k in (*POSITION, "skip")} for p in sources]}

    def release(self, saved: dict[str, Any], current: dict[str, Any]) -> None:
        """Each source's streamed files before its saved position may go (see DocStream.release)."""
        for stream, at_save, now in zip(self.streams, saved["sources"], current["sources"]):
            stream.release(at_save, now)

    @staticmethod
    def salt(pos: dict[str, Any]) -> tuple[int, ...]:
        """What seeds a shuffle buffer opened at `pos`."""
        return (pos["draws"],)

    def check_nonempty(self) -> None:
        """Raise now when a source's shard holds no document (a draw would find it later)."""
        for stream in self.streams:
            stream.check_nonempty()

    def documents(self, pos: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str]]:
        """(position, text) of the mixed documents from `pos` on, forever."""
        draws, at = pos["draws"], [dict(p) for p in pos["sources"]]
        opened: dict[int, Iterator] = {}  # a source is opened (its file fetched) when first drawn
        while True:
            s = self.pick(draws)
            if s not in opened:
                opened[s] = self._open(s, at[s])
            doc_pos, text = next(opened[s])
            at[s] = {**doc_pos, "skip": 0}
            yield {"draws": draws, "sources": [dict(p) for p in at]}, text
            at[s]["skip"] = 1
            draws += 1

    def _open(self, s: int, pos: dict[str, int]) -> Iterator[tuple[dict[str, int], str]]:
        docs = self.streams[s].documents({k: pos[k] for k in POSITION})
        if pos["skip"]:
            next(docs)  # the last document taken from this source
        return docs
