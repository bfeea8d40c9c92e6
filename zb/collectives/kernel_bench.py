"""Kernel speed per scheme (int8, int4, int2, and the sparse top-k scheme at chunk 4096, k 64): memory
traffic (bytes read + written per second) and values per second, against memcpy and the twins.

Used by `zb bench-allreduce --kernels` and scripts/bench_kernels.py. Run in one process; the kernels
use `kernels.threads()` threads (torch's thread count as set by the caller, capped by the usable
cores); every number is a median over interleaved repeats.

The report's "schemes" holds every scheme's kernels; "kernels" is int8's (the historical layout).
Sparse ("schemes"["sparse"], its chunk and k in "sparse"): compress with error feedback (beta 0.95) reads
x and the residual and writes the residual and the payload; decode_add reads the payload and reads and
writes the k values per chunk it adds to. Its values per second count the whole tensor (n / seconds).
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from zb.collectives import kernels
from zb.collectives.sparse_twins import SparseScheme
from zb.collectives.twins import Scheme

SPARSE = SparseScheme(4096, 64)   # the sparse scheme's defaults (SparseLoCo's chunk and k)
SPARSE_BETA = 0.95


def _time(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


Cases = dict[str, tuple[Callable[[], object], int]]


def _cases(n: int, scheme: Scheme, cpp: bool) -> Cases:
    """kernel name -> (call, bytes read + written per call)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g)
    acc = torch.randn(n, generator=g)
    out = torch.empty(n)
    nb, cb = kernels.num_blocks(n, scheme.block), kernels.code_bytes(n, scheme)
    codes, scales = torch.empty(cb, dtype=torch.uint8), torch.empty(nb)
    codes2, scales2 = torch.empty(cb, dtype=torch.uint8), torch.empty(nb)
    kernels.quantize(x, codes, scales, scheme=scheme, cpp=cpp)
    q = kernels.wire_bytes(n, scheme)  # bytes of one quantized form
    return {
        "quantize": (lambda: kernels.quantize(x, codes2, scales2, scheme=scheme, cpp=cpp), 4 * n + q),
        "dequantize": (lambda: kernels.dequantize(codes, scales, out, scheme=scheme, cpp=cpp), q + 4 * n),
        "dequantize_add": (lambda: kernels.dequantize_add(codes, scales, acc, scheme=scheme, cpp=cpp), q + 8 * n),
        "reduce_quantize": (lambda: kernels.reduce_quantize(codes, scales, acc, codes2, scales2, scheme=scheme,
                                                            cpp=cpp), q + 4 * n + q),
    }


def _sparse_cases(n: int, scheme: SparseScheme, cpp: bool) -> Cases:
    """kernel name -> (call, bytes read + written per call), for the sparse scheme."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g)
    acc = torch.randn(n, generator=g)
    residual = torch.zeros(n)
    payload, payload2 = (torch.empty(scheme.payload_bytes(n), dtype=torch.uint8) for _ in range(2))
    kernels.sparse_compress(x, payload, scheme, cpp=cpp)
    p, sent = scheme.payload_bytes(n), min(n, scheme.chunks(n) * scheme.k)  # payload bytes, values it carries
    return {
        "compress": (lambda: kernels.sparse_compress(x, payload2, scheme, residual=residual, beta=SPARSE_BETA,
                                                     cpp=cpp), 12 * n + p),
        "decode_add": (lambda: kernels.sparse_decode_add(payload, acc, scheme, cpp=cpp), p + 8 * sent),
    }


def run_kernel_bench(numel: int = 1 << 24, repeats: int = 7, twin_numel: int = 1 << 22,
                     schemes: tuple[str, ...] = tuple(kernels.SCHEMES), sparse: bool = True) -> dict:
    """{"memcpy_gbps", "threads", "schemes": {scheme: {kernel: row}}, "kernels": int8's rows}; a row is
    {gbps, gvals, vs_memcpy, twin_gbps, vs_twin} (gbps, gvals and the ratios only with the C++ kernels).
    With `sparse`, "schemes" also holds "sparse" (compress, decode_add at SPARSE's chunk and k)."""
    src, dst = torch.randn(numel), torch.empty(numel)
    cpp = kernels.use_cpp()
    cpp_cases = {s: _cases(numel, kernels.SCHEMES[s], True) for s in schemes} if cpp else {}
    # the twins are slow: a smaller size, same per-byte rate
    twin_cases = {s: _cases(twin_numel, kernels.SCHEMES[s], False) for s in schemes}
    if sparse:
        if cpp:
            cpp_cases["sparse"] = _sparse_cases(numel, SPARSE, True)
        twin_cases["sparse"] = _sparse_cases(twin_numel, SPARSE, False)
    times: dict[str, list[float]] = {"memcpy": [], "memmove": []}
    for _ in range(repeats):  # interleaved: noise hits every kernel alike
        times["memcpy"] += _time(lambda: dst.copy_(src), 1)  # torch's copy, on all threads
        times["memmove"] += _time(lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), 4 * numel), 1)
        for s, cases in twin_cases.items():
            for name in cases:
                if cpp_cases:
                    times.setdefault(f"{s}/{name}", []).extend(_time(cpp_cases[s][name][0], 1))
                times.setdefault(f"{s}/twin_{name}", []).extend(_time(cases[name][0], 1))
    # the baseline is the faster of libc memmove (one thread) and torch's parallel copy
    memcpy = 8 * numel / min(statistics.median(times["memcpy"]), statistics.median(times["memmove"])) / 1e9
    result: dict[str, Any] = {"numel": numel, "threads": kernels.threads(), "memcpy_gbps": memcpy, "cpp": cpp,
                              "schemes": {}}
    if sparse:
        result["sparse"] = {"chunk": SPARSE.chunk, "k": SPARSE.k, "beta": SPARSE_BETA}
    for s, cases in twin_cases.items():
        rows: dict[str, dict[str, float]] = {}
        for name in cases:
            twin_s = statistics.median(times[f"{s}/twin_{name}"])
            twin = cases[name][1] / twin_s / 1e9
            row = {"twin_gbps": twin, "twin_gvals": twin_numel / twin_s / 1e9}
            if cpp_cases:
                seconds = statistics.median(times[f"{s}/{name}"])
                gbps = cpp_cases[s][name][1] / seconds / 1e9
                row.update(gbps=gbps, gvals=numel / seconds / 1e9, vs_memcpy=gbps / memcpy, vs_twin=gbps / twin)
            rows[name] = row
        result["schemes"][s] = rows
    result["kernels"] = result["schemes"].get("int8", {})
    return result
