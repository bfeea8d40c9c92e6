"""The sparse scheme's shape (diloco.compression = sparse): chunk size, entries per chunk, the payload's bytes
and what makes a scheme invalid. Torch-free and outside zb.collectives (whose package imports torch), so the
config checks can use it; what the bytes mean is zb.collectives.sparse_twins."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SparseScheme:
    """Chunk size C (a power of two, 16 .. 65536) and entries sent per chunk K (a multiple of 8, at most C)."""

    chunk: int = 4096
    k: int = 64

    @property
    def index_bits(self) -> int:
        """Bits of one index written out whole: log2(C)."""
        return self.chunk.bit_length() - 1

    @property
    def low_bits(self) -> int:
        """The low bits an index keeps in the Elias-Fano code of a chunk's indices: the largest l with K 2^l <= C."""
        low = 0
        while self.k << (low + 1) <= self.chunk:
            low += 1
        return low

    @property
    def buckets(self) -> int:
        """C / 2^l: the values an index's high part can take."""
        return self.chunk >> self.low_bits

    def chunks(self, n: int) -> int:
        return -(-n // self.chunk)

    def low_bytes(self) -> int:
        return self.k * self.low_bits // 8

    def index_bytes(self) -> int:
        """Bytes of one chunk's indices: K low parts of l bits, then K + C / 2^l bits of high parts in unary (at
        most K (log2(C / K) + 2) bits, against K log2(C) written out whole)."""
        return self.low_bytes() + (self.k + self.buckets) // 8

    def code_bytes(self) -> int:
        return self.k // 4

    def payload_bytes(self, n: int) -> int:
        return self.chunks(n) * (4 + self.index_bytes() + self.code_bytes())

    def problem(self) -> tuple[str, str] | None:
        """(the field that is wrong: "chunk" or "k", why in words); None when the scheme is valid."""
        if self.chunk < 16 or self.chunk > 65536 or self.chunk & (self.chunk - 1):
            return "chunk", (f"a chunk of {self.chunk} values: it must be a power of two from 16 to 65536 (the "
                             "indices pack log2(chunk) bits each)")
        if self.k < 8 or self.k % 8 or self.k > self.chunk:
            return "k", (f"k = {self.k} entries per chunk: it must be a multiple of 8 (indices and codes pack to "
                         f"whole bytes) from 8 to the chunk ({self.chunk})")
        return None
