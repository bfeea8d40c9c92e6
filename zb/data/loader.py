"""Packing documents into batches, with a resumable position.

Documents are tokenized, each followed by EOS, concatenated, and cut into windows of
seq_length + 1 tokens; inputs are a window's first seq_length tokens, labels its last seq_length.
The state is where the stream stands: the document being consumed and how many of its tokens were
used, so `load_state_dict` makes the loader yield exactly the batches it would have yielded.

With document masking, each batch also says where its documents start (`cu_seqlens`, see
zb.models.docmask). A document's segment starts at the EOS that ends the document before it: that
EOS, as an input, predicts the document's first token, so it works as the document's BOS, and it
is the same token whatever came before; so nothing in a segment depends on an earlier document.
A document cut by a window's end goes on as the first segment of the next row.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from zb.data.hashing import mix64
from zb.data.stream import shuffled
from zb.errors import InvalidInput

log = logging.getLogger("zb.data")

AFTER = -1  # offset meaning "resume after this document" (shuffled streams)

KINDS = {"documents": "one source", "mixture": "a mixture of sources (data.dataset_ratio)",
         "fake": "random tokens (data.fake)"}


def check_kind(state: dict[str, Any], kind: str) -> None:
    """A saved position resumes only a loader of its own kind of source."""
    if state.get("kind") != kind:
        saved = KINDS.get(state.get("kind", ""), f"unknown kind {state.get('kind')!r}")
        raise InvalidInput(f"the saved data position is for {saved} but this run reads {KINDS[kind]}: the data "
                           "settings changed since it was saved; use the settings it was saved with to resume")


class Batch(NamedTuple):
    """One micro batch on the CPU: inputs and labels are LongTensors [micro_bs, seq_length];
    cu_seqlens (int32, zb.models.docmask) says where documents start, None when no row holds a
    boundary or document masking is off."""

    inputs: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor | None = None


def cu_seqlens(eos_at: list[int], micro_bs: int, seq_length: int) -> torch.Tensor | None:
    """Segment starts of a micro batch from where the documents' EOS tokens sit in its window
    stream (micro_bs windows of seq_length + 1 tokens): every row start and every input position
    holding an EOS. None when there is nothing but row starts (the kernels' plain causal path)."""
    width = seq_length + 1
    starts = {row * seq_length for row in range(micro_bs)}
    # An EOS in a window's last slot is only a label: the next row starts a segment anyway.
    starts.update(s // width * seq_length + s % width for s in eos_at if s % width < seq_length)
    if len(starts) == micro_bs:
        return None
    return torch.tensor(sorted(starts) + [micro_bs * seq_length], dtype=torch.int32)


class DataLoader:
    """Infinite iterator of Batch (inputs, labels, cu_seqlens) over a document stream
    (zb.data.stream.DocStream, or zb.data.mixture.MixedStream)."""

    def __init__(self, stream, tokenizer, *, micro_bs: int, seq_length: int, shard: int, num_shards: int,
                 split: str, shuffle_buffer: int = 0, seed: int = 0, resume_note: str = "", version: str = "",
                 document_mask: bool = True):
        self.stream, self.tokenizer = stream, tokenizer
        self.micro_bs, self.seq_length, self.document_mask = micro_bs, seq_length, document_mask
        self.shard, self.num_shards, self.split = shard, num_shards, split
        self.shuffle_buffer, self.seed, self.version = shuffle_buffer, seed, version
        self.exact_resume = shuffle_buffer == 0
        self.resume_note = resume_note or ("" if self.exact_resume else
                                           f"data.shuffle_buffer = {shuffle_buffer}: resuming skips the documents "
                                           "still in the shuffle buffer")
        self._pos, self._off = stream.start(), 0
        self._tokens: list[int] = []
        self._docs: Iterator | None = None
        self._resume_offset: int | None = 0  # not None: (re)open the stream at self._pos first

    def __iter__(self) -> DataLoader:
        return self

    def check_nonempty(self) -> None:
        """Raise InvalidInput now when this rank's shard holds no document of its split, which reading would
        find only at the first batch (for the held-out split: at the first evaluation, after training)."""
        self.stream.check_nonempty()

    def _open(self) -> None:
        offset, self._resume_offset = self._resume_offset, None
        docs = self.stream.documents(self._pos)
        if offset == AFTER:
            next(docs)  # read into the shuffle buffer before the state was saved
        if self.shuffle_buffer:
            docs = shuffled(docs, self.shuffle_buffer, mix64(self.seed, self.shard, *self.stream.salt(self._pos)))
        self._docs, self._tokens, self._off = docs, [], 0
        if offset and offset != AFTER:
            self._next_doc()  # the document being consumed at the saved position
            self._off = offset

    def _next_doc(self) -> None:
        assert self._docs is not None  # _open comes first
        pos, text = next(self._docs)
        self._pos = pos
        self._tokens = self.tokenizer.encode(text)
        self._tokens.append(self.tokenizer.eos_id)
        self._off = 0

    def __next__(self) -> Batch:
        if self._resume_offset is not None:
            self._open()
        need = self.micro_bs * (self.seq_length + 1)
        out: list[int] = []
        eos_at: list[int] = []  # where in `out` each document's closing EOS landed
        while len(out) < need:
            if self._off >= len(self._tokens):
                self._next_doc()
            take = min(need - len(out), len(self._tokens) - self._off)
            out.extend(self._tokens[self._off:self._off + take])
            self._off += take
            if self._off == len(self._tokens):
                eos_at.append(len(out) - 1)
        windows = torch.tensor(out, dtype=torch.long).view(self.micro_bs, self.seq_length + 1)
        spans = cu_seqlens(eos_at, self.micro_bs, self.seq_length) if self.document_mask else None
        return Batch(windows[:, :-1], windows[:, 1:], spans)

    def state_dict(self) -> dict[str, Any]:
        offset = self._off if self.exact_resume else AFTER
        if self._resume_offset is not None:
            offset = self._resume_offset
        return {"kind": self.stream.kind, **self._pos, "offset": offset, "shard": self.shard,
                "num_shards": self.num_shards, "split": self.split, "version": self.version}

    def release(self, state: dict[str, Any]) -> None:
        """No run will resume before `state` (one of this loader's states): the streamed files behind
        it may go (zb.data.evict)."""
        self.stream.release(self.stream.position(state), self._pos)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_kind(state, self.stream.kind)
        if (state.get("shard"), state.get("num_shards")) != (self.shard, self.num_shards):
            log.info("data state from shard %s of %s loaded into shard %s of %s: continuing at its position",
                     state.get("shard"), state.get("num_shards"), self.shard, self.num_shards)
        if state.get("version", "") != self.version:
            log.warning("data changed since this state was saved (%s, now %s): resuming at the same position of "
                        "the new file list, which is not the exact continuation", state.get("version"), self.version)
        self._pos = self.stream.position(state)
        self._resume_offset = int(state["offset"])
        self._docs = None


class FakeLoader:
    """Random tokens for throughput runs: batch k is a pure function of (seed, shard, split, k).
    They hold no documents, so batches carry no document boundaries."""

    exact_resume = True
    resume_note = ""

    def __init__(self, vocab_size: int, *, micro_bs: int, seq_length: int, shard: int, split: str, seed: int = 0):
        self.vocab_size, self.micro_bs, self.seq_length = vocab_size, micro_bs, seq_length
        self.shard, self.split, self.seed = shard, split, seed
        self.batch = 0

    def __iter__(self) -> FakeLoader:
        return self

    def check_nonempty(self) -> None:
        """Fake batches are made, not read: never empty."""

    def __next__(self) -> Batch:
        salt = 1 if self.split == "eval" else 0
        gen = torch.Generator().manual_seed(mix64(self.seed, self.shard, salt, self.batch) & (2**63 - 1))
        self.batch += 1
        windows = torch.randint(0, self.vocab_size, (self.micro_bs, self.seq_length + 1), generator=gen)
        return Batch(windows[:, :-1], windows[:, 1:])  # no documents: nothing to mask

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "fake", "batch": self.batch}

    def release(self, state: dict[str, Any]) -> None:
        """Nothing to let go: fake batches are made, not read."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_kind(state, "fake")
        self.batch = int(state["batch"])
