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
        return self.chunk.bit_length() - 1

    def chunks(self, n: int) -> int:
        return -(-n // self.chunk)

    def index_bytes(self) -> int:
        """Bytes of one chunk's indices."""
        return self.k * self.index_bits // 8

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
