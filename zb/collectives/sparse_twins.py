"""Pure-PyTorch twins of the sparse kernels (csrc/zb_quant.cpp, `sparse_*`): they define what the kernels mean.

The sparse scheme (diloco.compression = sparse; SparseLoCo, arXiv 2508.15706) cuts n float32 values into chunks
of C values (the last may be shorter: L values) and sends, per chunk, the K' = min(K, L) entries of largest
magnitude of the error-feedback accumulator, each as an index and a 2-bit code, plus one float32 scale:

  acc   = beta * e + x                 (two IEEE roundings, in this order; e: the residual, absent: acc = x)
  pick  = the K' entries of largest |acc|, ties to the lower index; sent in ascending index order
  a     = |acc_p0| + |acc_p1| + ...    (the picked, ascending index, one fp32 addition at a time)
  scale = a / K'                       (one IEEE division: the picked entries' mean magnitude)
  code  = 2 * (acc < 0) + (|acc| >= scale * 9/8)
  value = +-(scale * 7/8) for code 0/2, +-(scale * 11/8) for code 1/3   (one multiplication, exact factors)
  e     = acc - value at the picked entries, acc elsewhere (so sent + kept = accumulated, to one rounding)

Sign and two magnitudes, not a ternary code: every picked entry is among the chunk's largest, so a zero level
would waste a quarter of the codes; 7/8 and 11/8 of the mean magnitude are the pair that fit the top 64 of 4096
heavy-tailed values best (Laplace and Student-t(3) samples: 1-10% of their energy off; error feedback sends the
rest again). A chunk holding a NaN or an Inf sends scale NaN and indices 0 .. K'-1 (its values arrive as NaN,
never as finite numbers); a chunk whose scale is below 2^-100 sends scale 0.

Every NaN written (a scale, a residual entry, a decoded sum) is the default quiet NaN, bits 0x7fc00000: when both
operands are NaNs, IEEE leaves which one's sign and payload the result keeps to the hardware and the operand order
(torch's x + y and x - y keep y's here, as it computes x + 1 * y; x86 code for x + y keeps x's; a compiler may swap
an addition's operands), so a NaN chunk's residual (beta * e + x with NaN in both; acc - NaN), or a decode onto
NaNs, would otherwise differ between these functions, the kernels, CPUs and torch builds.

Payload of a call (`payload_bytes`): every chunk's scale (float32, chunk order), then every chunk's index field
(`index_bytes`), then every chunk's K codes (2 bits each, four to a byte, value j in bits 2 (j % 4)). A chunk's
K' ascending indices travel in the Elias-Fano code (l = `low_bits`, the largest l with K 2^l <= C): first the K
low parts i_j mod 2^l (l bits each, a little-endian bit stream), then K + C / 2^l bits with bit floor(i_j / 2^l) + j
set for every live slot j (bit b in byte b // 8 at position b % 8). At C = 4096 and K = 64 that is 64 bytes
where 12-bit indices took 96: 84 bytes a chunk, 195x fewer than fp32. Slots past K' of a short last chunk are
zero bits. C is a power of two and K a multiple of 8, so every chunk's fields end on a byte.

`decode_add` adds one payload's values to an fp32 tensor, chunk by chunk, slot by slot (one rounding per
addition). A peer's bytes are untrusted: a payload with a chunk whose high-part bits are not exactly K' ones, or
that names an index past its chunk's end, is refused whole: it returns False and adds nothing (low parts of
slots past K' are not read). The C++ kernels and these functions agree bit for bit; tests hold one against the
other.
"""

from __future__ import annotations

import torch

from zb.sparse_scheme import SparseScheme

__all__ = ["SparseScheme", "compress", "decode_add", "marks", "TINY", "LOW", "HIGH", "SPLIT", "MARK"]

TINY = 2.0**-100
LOW, HIGH, SPLIT = 0.875, 1.375, 1.125   # the two magnitudes and the boundary, in units of the scale (exact in fp32)
MARK = 7.0                               # what a payload's marks add at an entry it sends: LOW at scale 8, exact


def _sections(payload: torch.Tensor, n: int, s: SparseScheme) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scales float32[chunks], indices uint8[chunks, index_bytes], codes uint8[chunks, code_bytes])."""
    nc = s.chunks(n)
    a, b = 4 * nc, 4 * nc + nc * s.index_bytes()
    return (payload[:a].view(torch.float32), payload[a:b].view(nc, s.index_bytes()),
            payload[b:b + nc * s.code_bytes()].view(nc, s.code_bytes()))


def _pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Rows of int64 values < 2^bits as little-endian bit streams: uint8[rows, cols * bits / 8]."""
    rows, cols = values.shape
    shifts = torch.arange(bits, dtype=torch.int64)
    stream = ((values[:, :, None] >> shifts) & 1).reshape(rows, cols * bits // 8, 8)
    return (stream << torch.arange(8, dtype=torch.int64)).sum(dim=2).to(torch.uint8)


def _unpack_bits(packed: torch.Tensor, cols: int, bits: int) -> torch.Tensor:
    rows = packed.shape[0]
    stream = ((packed.to(torch.int64)[:, :, None] >> torch.arange(8, dtype=torch.int64)) & 1).reshape(rows, cols, bits)
    return (stream << torch.arange(bits, dtype=torch.int64)).sum(dim=2)


def _encode_indices(picked: torch.Tensor, live: torch.Tensor, s: SparseScheme) -> torch.Tensor:
    """uint8[chunks, index_bytes]: the Elias-Fano fields of int64[chunks, K] ascending indices (live slots)."""
    nc, k, low = picked.shape[0], s.k, s.low_bits
    lows = torch.where(live, picked & ((1 << low) - 1), torch.zeros_like(picked))
    high = torch.zeros(nc, k + s.buckets, dtype=torch.int64)
    rows = torch.arange(nc)[:, None].expand(nc, k)
    high[rows[live], ((picked >> low) + torch.arange(k))[live]] = 1
    return torch.cat([_pack_bits(lows, low), _pack_bits(high, 1)], dim=1)


def _decode_indices(field: torch.Tensor, kk: torch.Tensor, s: SparseScheme) -> torch.Tensor | None:
    """int64[chunks, K] (slots past K' zero) of uint8[chunks, index_bytes]; None when a chunk's high-part bits are
    not exactly K' ones."""
    nc, k, low = field.shape[0], s.k, s.low_bits
    lows = _unpack_bits(field[:, :s.low_bytes()], k, low)
    high = _unpack_bits(field[:, s.low_bytes():], k + s.buckets, 1)
    if not torch.equal(high.sum(dim=1), kk):
        return None
    rows, bits = torch.nonzero(high, as_tuple=True)          # row by row, ascending bit
    slots = torch.arange(rows.numel()) - (torch.cumsum(kk, 0) - kk)[rows]
    picked = torch.zeros(nc, k, dtype=torch.int64)
    picked[rows, slots] = ((bits - slots) << low) | lows[rows, slots]
    return picked


def _lengths(n: int, s: SparseScheme) -> torch.Tensor:
    nc = s.chunks(n)
    lengths = torch.full((nc,), s.chunk, dtype=torch.int64)
    if nc and n % s.chunk:
        lengths[-1] = n % s.chunk
    return lengths


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """t with every NaN the default quiet NaN (0x7fc00000), whatever its sign and payload."""
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)


def _values(scale: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """float32[chunks, K] of 2-bit codes under per-chunk scales."""
    low = scale * torch.tensor(LOW)
    high = scale * torch.tensor(HIGH)
    mag = torch.where((codes & 1).bool(), high[:, None], low[:, None])
    return torch.where((codes & 2).bool(), -mag, mag)


def compress(x: torch.Tensor, payload: torch.Tensor, scheme: SparseScheme, residual: torch.Tensor | None = None,
             beta: float = 1.0) -> None:
    """payload[:] = the sparse form of float32 x (with `residual`: of beta * residual + x, and residual then keeps
    what was not sent)."""
    n = x.numel()
    if n == 0:
        return
    s, k = scheme, scheme.k
    acc = torch.full_like(residual, beta) * residual + x if residual is not None else x.clone()
    nc, lengths = s.chunks(n), _lengths(n, scheme)
    mat = torch.cat([acc, acc.new_zeros(nc * s.chunk - n)]).view(nc, s.chunk)
    mag = mat.abs()
    mag.view(-1)[n:] = -1.0                          # the padding is never picked before a value
    bad = ~torch.isfinite(mat).all(dim=1)
    mag[bad] = 0.0                                   # ties: the first K' in index order
    order = torch.sort(mag, dim=1, descending=True, stable=True).indices[:, :k]
    picked = torch.sort(order, dim=1).values        # ascending index
    kk = torch.clamp(lengths, max=k)
    live = torch.arange(k)[None, :] < kk[:, None]   # slots past K' of a short last chunk
    picked = torch.where(live, picked, torch.zeros_like(picked))
    vals = torch.gather(mat, 1, picked)
    total = torch.zeros(nc)
    for j in range(k):                               # ascending index, one rounding per addition
        total = torch.where(live[:, j], total + vals[:, j].abs(), total)
    scale = total / kk.to(torch.float32)
    scale = torch.where(scale < TINY, torch.zeros_like(scale), scale)
    scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    split = scale * torch.tensor(SPLIT)
    codes = (vals < 0).to(torch.int64) * 2 + (vals.abs() >= split[:, None]).to(torch.int64)
    codes = torch.where(live & ~bad[:, None], codes, torch.zeros_like(codes))
    scales, indices, packed = _sections(payload, n, s)
    scales.copy_(scale)
    indices.copy_(_encode_indices(picked, live, s))
    packed.copy_(_pack_bits(codes, 2))
    if residual is not None:
        sent = torch.where(live, _values(scale, codes), torch.zeros(nc, k))
        kept = mat.clone()
        rows = torch.arange(nc)[:, None].expand(nc, k)
        kept[rows[live], picked[live]] = vals[live] - sent[live]
        residual.copy_(_canonical(kept.view(-1)[:n]))


def decode_add(payload: torch.Tensor, acc: torch.Tensor, scheme: SparseScheme) -> bool:
    """acc += the values one payload stands for; False (and acc untouched) when its index fields are not canonical
    Elias-Fano codes of K' indices or it names an index past its chunk's end."""
    n = acc.numel()
    if n == 0:
        return True
    s, k = scheme, scheme.k
    nc, lengths = s.chunks(n), _lengths(n, scheme)
    scales, indices, packed = _sections(payload, n, s)
    kk = torch.clamp(lengths, max=k)
    live = torch.arange(k)[None, :] < kk[:, None]
    picked = _decode_indices(indices, kk, s)
    if picked is None or bool((live & (picked >= lengths[:, None])).any()):
        return False
    codes = _unpack_bits(packed, k, 2)
    vals = _values(scales, codes)
    flat = torch.cat([acc, acc.new_zeros(nc * s.chunk - n)]).view(nc, s.chunk)
    for j in range(k):                               # slot order: a repeated index adds in the same order everywhere
        rows = torch.nonzero(live[:, j]).view(-1)
        cols = picked[rows, j]
        flat[rows, cols] = _canonical(flat[rows, cols] + vals[rows, j])
    acc.copy_(flat.view(-1)[:n])
    return True


def marks(payload: torch.Tensor, n: int, scheme: SparseScheme) -> torch.Tensor:
    """A copy of one payload of n values that `decode_add` turns into MARK at every entry it sends and nothing
    elsewhere: every code 0, and scale 8 in each chunk that sends values (a finite, nonzero scale), 0 in the others
    (a chunk of zeros, as a joiner's, or one holding a NaN). Decoding every rank's marks counts each entry's
    senders (diloco.sparse_average = senders) with the decode kernel itself: one pass over the sent entries, not
    over the whole vector."""
    out = payload.clone()
    if n == 0:
        return out
    scales, _, codes = _sections(out, n, scheme)
    sends = torch.isfinite(scales) & (scales != 0)
    scales.copy_(torch.where(sends, torch.full_like(scales, 8.0), torch.zeros_like(scales)))
    codes.zero_()
    return out
