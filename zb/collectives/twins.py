"""Pure-PyTorch twins of the C++ kernels in csrc/zb_quant.cpp: they define what the kernels mean.

Three schemes, each blockwise with one float32 scale per block of `block` values (the last block
may be shorter), L = 2^(bits - 1) - 1 levels on each side of zero:

  int8 (L = 127) and int4 (L = 7): absmax.
    m     = max |x|                      (fp32)
    scale = m / L                        (one IEEE division, fp32)
    inv   = L / m                        (one IEEE division, fp32)
  int2 (L = 1, ternary): the scale is 2 x the block's mean |x| (values above the mean |x| leave as
    +-2 mean |x|, the rest wait in the error-feedback residual). Absmax rounds most values of a
    heavy-tailed block to zero and trained far worse; 1, 1.5 and 2.5 x the mean trained worse than 2,
    3.5 and 5 diverged (BENCHMARKS.md, "Fewer bits on the wire"):
    a     = |x_0| + |x_1| + ... in index order, one fp32 addition at a time
    scale = (a / count) * 2              (count: the block's values; two IEEE operations)
    inv   = 1 / scale
  then, for every scheme:
    code  = clamp(round_half_even(x * inv), -L, L) + L     (absmax never needs the clamp)
    value = float(code - L) * scale      (one IEEE multiplication)

A block holding a NaN or an Inf gets scale = NaN, so all of its values come back as NaN (never as
finite numbers); a block whose m (int2: scale) is below 2^-100 gets scale = 0 (inv could overflow).
Both get code L (zero).

Codes are packed little-endian: int8 one per byte (code + 1 - L: in [1, 255], the historical int8
layout), int4 two per byte (value i in bits 4 (i % 2) .. of byte i // 2), int2 four per byte;
unused bits of the last byte are zero.

Error feedback (`residual`, the values this rank's quantizations dropped so far): `quantize` sends
t = x + residual and keeps residual = t - value; `reduce_quantize` adds it to the partial sum it
re-quantizes and keeps what that quantization dropped, times the divisor (in the units of the
sum). The C++ kernels and these functions agree bit for bit; tests hold one against the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TINY = 2.0**-100
INT2_MEAN_SCALE = 2.0   # int2's scale over the block's mean |x| (kInt2MeanScale in the C++)


@dataclass(frozen=True)
class Scheme:
    """One width: its bits per value, levels each side of zero and values per scale."""

    name: str
    bits: int
    block: int

    @property
    def levels(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    @property
    def mean_scale(self) -> bool:
        return self.bits == 2


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x as a (blocks, block) matrix, the tail padded with zeros (zeros never change max |x| or the sum)."""
    nb = -(-x.numel() // block)
    pad = nb * block - x.numel()
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(nb, block)


def _counts(n: int, block: int, device: torch.device) -> torch.Tensor:
    """Values per block, as fp32 (the last block may be shorter)."""
    nb = -(-n // block)
    counts = torch.full((nb,), float(block), device=device)
    if nb and n % block:
        counts[-1] = float(n % block)
    return counts


def _scales(mat: torch.Tensor, scheme: Scheme, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (scale, inv) with the special cases of the scheme."""
    if scheme.mean_scale:
        a = mat.new_zeros(mat.shape[0])
        for j in range(mat.shape[1]):          # index order, one rounding per addition
            a = a + mat[:, j].abs()
        m = (a / _counts(n, scheme.block, a.device)) * torch.full_like(a, INT2_MEAN_SCALE)
    else:
        m = mat.abs().amax(dim=1) if mat.numel() else mat.new_zeros(mat.shape[0])
    bad = ~torch.isfinite(m)  # NaN propagates through amax and the sum; Inf too
    tiny = m < TINY
    special = bad | tiny
    if scheme.mean_scale:
        safe = torch.where(special, torch.ones_like(m), m)
        scale = torch.where(tiny, torch.zeros_like(m), safe)
        inv = torch.where(special, torch.zeros_like(m), torch.ones_like(m) / safe)
    else:
        levels = torch.full_like(m, float(scheme.levels))
        safe = torch.where(special, levels, m)
        scale = torch.where(tiny, torch.zeros_like(m), safe / levels)
        inv = torch.where(special, torch.zeros_like(m), levels / safe)
    scale = torch.where(bad, torch.full_like(m, float("nan")), scale)
    return scale, inv


def _offset(scheme: Scheme) -> int:
    """What a stored code minus its level is: L, except int8's historical code + 1 (128 for zero)."""
    return 128 if scheme.bits == 8 else scheme.levels


def _codes(mat: torch.Tensor, inv: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """Unpacked codes in [0, 2L] (int8: in [1, 255]) as int32, one per value of the matrix."""
    y = mat * inv[:, None]
    y = torch.where(torch.isfinite(y), y, torch.zeros_like(y))  # special blocks have inv == 0
    levels = scheme.levels
    return torch.round(y).clamp_(-levels, levels).to(torch.int32) + _offset(scheme)


def _pack(codes: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    if scheme.bits == 8:
        return codes.to(torch.uint8)
    per = scheme.per_byte
    pad = -codes.numel() % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    lanes = codes.view(-1, per)
    out = torch.zeros(lanes.shape[0], dtype=torch.int32, device=codes.device)
    for k in range(per):
        out |= lanes[:, k] << (k * scheme.bits)
    return out.to(torch.uint8)


def _unpack(packed: torch.Tensor, n: int, scheme: Scheme) -> torch.Tensor:
    """The n codes in packed bytes, as int32."""
    raw = packed.to(torch.int32)
    if scheme.bits == 8:
        return raw[:n]
    mask = (1 << scheme.bits) - 1
    lanes = torch.stack([(raw >> (k * scheme.bits)) & mask for k in range(scheme.per_byte)], dim=1)
    return lanes.reshape(-1)[:n]


def code_bytes(n: int, scheme: Scheme) -> int:
    return -(-n // scheme.per_byte)


def _decode(packed: torch.Tensor, scales: torch.Tensor, n: int, scheme: Scheme) -> torch.Tensor:
    mat = _blocks(_unpack(packed, n, scheme) - _offset(scheme), scheme.block).to(torch.float32)
    return (mat * scales[:, None]).reshape(-1)[:n]


def quantize(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, scheme: Scheme,
             residual: torch.Tensor | None = None) -> None:
    """codes[:] and scales[:] = the quantized form of float32 x (plus `residual`, which then keeps what
    this quantization dropped)."""
    if x.numel() == 0:
        return
    t = x + residual if residual is not None else x
    mat = _blocks(t, scheme.block)
    scale, inv = _scales(mat, scheme, t.numel())
    scales.copy_(scale)
    codes.copy_(_pack(_codes(mat, inv, scheme).reshape(-1)[: t.numel()], scheme))
    if residual is not None:
        residual.copy_(t - _decode(codes, scales, t.numel(), scheme))


def dequantize(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, scheme: Scheme) -> None:
    """out[:] = the values that (codes, scales) stand for."""
    if out.numel():
        out.copy_(_decode(codes, scales, out.numel(), scheme))


def dequantize_add(codes: torch.Tensor, scales: torch.Tensor, acc: torch.Tensor, scheme: Scheme) -> None:
    """acc += the values that (codes, scales) stand for (one rounding per addition)."""
    if acc.numel():
        acc.add_(_decode(codes, scales, acc.numel(), scheme))


def reduce_quantize(in_codes: torch.Tensor, in_scales: torch.Tensor, acc: torch.Tensor,
                    out_codes: torch.Tensor, out_scales: torch.Tensor, scheme: Scheme,
                    divisor: float, write_back: bool, residual: torch.Tensor | None = None) -> None:
    """One ring hop: s = acc (+ residual) + dequantize(in); t = s / divisor; quantize t into out.

    With write_back, acc = dequantize(out) (the owner keeps exactly what it sends); otherwise acc is
    left unchanged. With `residual`: residual = s - dequantize(out) * divisor.
    """
    n = acc.numel()
    if n == 0:
        return
    s = acc + residual if residual is not None else acc.clone()
    s = s + _decode(in_codes, in_scales, n, scheme)
    t = s / torch.full_like(s, divisor) if divisor != 1.0 else s
    quantize(t, out_codes, out_scales, scheme)
    sent = _decode(out_codes, out_scales, n, scheme)
    if residual is not None:
        residual.copy_(s - sent * torch.full_like(sent, divisor) if divisor != 1.0 else s - sent)
    if write_back:
        acc.copy_(sent)
