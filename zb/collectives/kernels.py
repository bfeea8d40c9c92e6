"""Typed wrappers over the quantization kernels: torch.ops.zb.* when built, else the PyTorch twins.

A quantized piece of n float32 values under a scheme (int8, int4, int2: zb.collectives.twins) is
`codes` (the packed codes: n, n / 2 or n / 4 bytes, rounded up) plus `scales` (one float32 per
block); `wire_bytes(n, scheme)` is its size. All functions work in place on contiguous CPU tensors
and return None. `residual` (error feedback) is a float32 tensor of n values, updated in place.
The sparse pair (zb.collectives.sparse_twins): `sparse_compress` writes one payload of
`SparseScheme.payload_bytes(n)` bytes, `sparse_decode_add` adds one payload's values and returns False
(adding nothing) for a payload whose index fields are forged (not the code of K' indices inside their chunk).

Threads: the kernels split their blocks over `threads()` threads, the cores this process may use
divided by the ranks that share its host (`set_colocated`; by default torchrun's LOCAL_WORLD_SIZE),
so ranks that run their all-reduce at once on one host never oversubscribe its cores.
"""

from __future__ import annotations

import os

import torch

from zb.collectives import sparse_twins, twins
from zb.collectives.build import use_cpp
from zb.collectives.twins import Scheme
from zb.sparse_scheme import SparseScheme

__all__ = ["SCHEMES", "Scheme", "BLOCK", "num_blocks", "code_bytes", "wire_bytes", "quantize", "dequantize",
           "dequantize_add", "reduce_quantize", "use_cpp", "set_colocated", "threads", "SparseScheme",
           "sparse_compress", "sparse_decode_add"]

# Values per scale, chosen by error at the wire bytes each width can spend (BENCHMARKS.md, "Fewer bits").
SCHEMES = {"int8": Scheme("int8", 8, 256), "int4": Scheme("int4", 4, 128), "int2": Scheme("int2", 2, 256)}
INT8 = SCHEMES["int8"]
BLOCK = INT8.block

_colocated: int | None = None   # None: LOCAL_WORLD_SIZE, as torchrun and zb's launchers set it


def num_blocks(n: int, block: int = BLOCK) -> int:
    return -(-n // block)


def code_bytes(n: int, scheme: Scheme = INT8) -> int:
    return twins.code_bytes(n, scheme)


def wire_bytes(n: int, scheme: Scheme = INT8) -> int:
    """Bytes of the quantized form of n values: the packed codes plus a float32 scale per block."""
    return code_bytes(n, scheme) + 4 * num_blocks(n, scheme.block)


def set_colocated(ranks: int) -> None:
    """How many ranks of this host run their all-reduce at once (a node's local ranks; every rank of a
    loopback benchmark): each gets its share of the host's cores."""
    global _colocated
    _colocated = max(1, ranks)


def threads() -> int:
    """Threads per kernel call: this process's usable cores over the co-located ranks, at least 1,
    never more than torch's intra-op thread count."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # macOS has no affinity mask
        cores = os.cpu_count() or 1
    colocated = _colocated
    if colocated is None:
        value = os.environ.get("LOCAL_WORLD_SIZE", "")
        colocated = max(1, int(value)) if value.isdigit() else 1
    return max(1, min(torch.get_num_threads(), cores // colocated))


def _cpp(cpp: bool | None) -> bool:
    return use_cpp() if cpp is None else cpp


def quantize(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, scheme: Scheme = INT8,
             residual: torch.Tensor | None = None, cpp: bool | None = None) -> None:
    """codes, scales = quantized float32 x (+ residual, which keeps what was dropped)."""
    if _cpp(cpp):
        torch.ops.zb.quantize(x, codes, scales, scheme.block, scheme.bits, residual, threads())
    else:
        twins.quantize(x, codes, scales, scheme, residual)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, scheme: Scheme = INT8,
               cpp: bool | None = None) -> None:
    """out = dequantized (codes, scales)."""
    if _cpp(cpp):
        torch.ops.zb.dequantize(codes, scales, out, scheme.block, scheme.bits, threads())
    else:
        twins.dequantize(codes, scales, out, scheme)


def dequantize_add(codes: torch.Tensor, scales: torch.Tensor, acc: torch.Tensor, *, scheme: Scheme = INT8,
                   cpp: bool | None = None) -> None:
    """acc += dequantized (codes, scales), in fp32."""
    if _cpp(cpp):
        torch.ops.zb.dequantize_add(codes, scales, acc, scheme.block, scheme.bits, threads())
    else:
        twins.dequantize_add(codes, scales, acc, scheme)


def reduce_quantize(in_codes: torch.Tensor, in_scales: torch.Tensor, acc: torch.Tensor,
                    out_codes: torch.Tensor, out_scales: torch.Tensor, *, scheme: Scheme = INT8,
                    divisor: float = 1.0, write_back: bool = False, residual: torch.Tensor | None = None,
                    cpp: bool | None = None) -> None:
    """out = quantize((acc (+ residual) + dequantize(in)) / divisor); with write_back, acc = dequantize(out);
    with residual, residual = what out dropped, times the divisor."""
    if _cpp(cpp):
        torch.ops.zb.reduce_quantize(in_codes, in_scales, acc, out_codes, out_scales, scheme.block, scheme.bits,
                                     float(divisor), bool(write_back), residual, threads())
    else:
        twins.reduce_quantize(in_codes, in_scales, acc, out_codes, out_scales, scheme, float(divisor),
                              bool(write_back), residual)


def sparse_compress(x: torch.Tensor, payload: torch.Tensor, scheme: SparseScheme, *,
                    residual: torch.Tensor | None = None, beta: float = 1.0, cpp: bool | None = None) -> None:
    """payload = the sparse form (zb.collectives.sparse_twins) of x, or of beta * residual + x with `residual`,
    which then keeps what was not sent."""
    if _cpp(cpp):
        torch.ops.zb.sparse_compress(x, payload, scheme.chunk, scheme.k, residual, float(beta), threads())
    else:
        sparse_twins.compress(x, payload, scheme, residual, float(beta))


def sparse_decode_add(payload: torch.Tensor, acc: torch.Tensor, scheme: SparseScheme, *,
                      cpp: bool | None = None) -> bool:
    """acc += the values of one sparse payload; False (acc untouched) when the payload is malformed."""
    if _cpp(cpp):
        return bool(torch.ops.zb.sparse_decode_add(payload, acc, scheme.chunk, scheme.k, threads()))
    return sparse_twins.decode_add(payload, acc, scheme)
