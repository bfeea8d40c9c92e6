"""Typed wrappers over the int8 kernels: torch.ops.zb.* when built, else the PyTorch twins.

A quantized piece of n float32 values is `codes` (n uint8) plus `scales` (one float32 per block
of BLOCK values); `wire_bytes(n)` is its size. All functions work in place on contiguous CPU
tensors and return None.
"""

from __future__ import annotations

import torch

from zb.collectives import twins
from zb.collectives.build import use_cpp

__all__ = ["BLOCK", "num_blocks", "wire_bytes", "quantize", "dequantize", "dequantize_add", "reduce_quantize", "use_cpp"]

BLOCK = 256
"""Values per scale. Chosen by error at equal wire bytes (BENCHMARKS.md: quantization schemes)."""


def num_blocks(n: int, block: int = BLOCK) -> int:
    return -(-n // block)


def wire_bytes(n: int, block: int = BLOCK) -> int:
    """Bytes of the quantized form of n values: one code each plus a float32 scale per block."""
    return n + 4 * num_blocks(n, block)


def _ops(cpp: bool | None):
    if cpp is None:
        cpp = use_cpp()
    return torch.ops.zb if cpp else twins


def quantize(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, block: int = BLOCK,
             cpp: bool | None = None) -> None:
    """codes, scales = quantized float32 x."""
    _ops(cpp).quantize(x, codes, scales, block)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, block: int = BLOCK,
               cpp: bool | None = None) -> None:
    """out = dequantized (codes, scales)."""
    _ops(cpp).dequantize(codes, scales, out, block)


def dequantize_add(codes: torch.Tensor, scales: torch.Tensor, acc: torch.Tensor, *, block: int = BLOCK,
                   cpp: bool | None = None) -> None:
    """acc += dequantized (codes, scales), in fp32."""
    _ops(cpp).dequantize_add(codes, scales, acc, block)


def reduce_quantize(in_codes: torch.Tensor, in_scales: torch.Tensor, acc: torch.Tensor,
                    out_codes: torch.Tensor, out_scales: torch.Tensor, *, divisor: float = 1.0,
                    write_back: bool = False, block: int = BLOCK, cpp: bool | None = None) -> None:
    """out = quantize((acc + dequantize(in)) / divisor); with write_back, acc = dequantize(out)."""
    _ops(cpp).reduce_quantize(in_codes, in_scales, acc, out_codes, out_scales, block, float(divisor),
                              bool(write_back))
