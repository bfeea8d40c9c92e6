"""Kernel speed: memory traffic (bytes read + written per second) against memcpy and the twins.

Used by `zb bench-allreduce --kernels` and scripts/bench_kernels.py. Run in one process, with
torch's thread count as set by the caller; every number is a median over interleaved repeats.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from typing import Any, Callable

import torch

from zb.collectives import kernels


def _time(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _cases(n: int, cpp: bool) -> dict[str, tuple[Callable[[], None], int]]:
    """kernel name -> (call, bytes read + written per call)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g)
    acc = torch.randn(n, generator=g)
    out = torch.empty(n)
    nb = kernels.num_blocks(n)
    codes, scales = torch.empty(n, dtype=torch.uint8), torch.empty(nb)
    codes2, scales2 = torch.empty(n, dtype=torch.uint8), torch.empty(nb)
    kernels.quantize(x, codes, scales)
    q = n + 4 * nb  # bytes of one quantized form
    return {
        "quantize": (lambda: kernels.quantize(x, codes2, scales2, cpp=cpp), 4 * n + q),
        "dequantize": (lambda: kernels.dequantize(codes, scales, out, cpp=cpp), q + 4 * n),
        "dequantize_add": (lambda: kernels.dequantize_add(codes, scales, acc, cpp=cpp), q + 8 * n),
        "reduce_quantize": (lambda: kernels.reduce_quantize(codes, scales, acc, codes2, scales2, cpp=cpp),
                            q + 4 * n + q),
    }


def run_kernel_bench(numel: int = 1 << 24, repeats: int = 7, twin_numel: int = 1 << 22) -> dict:
    """{"memcpy_gbps", "threads", "kernels": {name: {gbps, vs_memcpy, twin_gbps, vs_twin}}}."""
    src, dst = torch.randn(numel), torch.empty(numel)
    cpp_cases = _cases(numel, True) if kernels.use_cpp() else {}
    twin_cases = _cases(twin_numel, False)  # the twins are slow: a smaller size, same per-byte rate
    times: dict[str, list[float]] = {"memcpy": []}
    for name in twin_cases:
        times[name], times["twin_" + name] = [], []
    times["memmove"] = []
    for _ in range(repeats):  # interleaved: noise hits every kernel alike
        times["memcpy"] += _time(lambda: dst.copy_(src), 1)  # torch's copy, on all threads
        times["memmove"] += _time(lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), 4 * numel), 1)
        for name in twin_cases:
            if cpp_cases:
                times[name] += _time(cpp_cases[name][0], 1)
            times["twin_" + name] += _time(twin_cases[name][0], 1)
    # the baseline is the faster of libc memmove (one thread) and torch's parallel copy
    memcpy = 8 * numel / min(statistics.median(times["memcpy"]), statistics.median(times["memmove"])) / 1e9
    result: dict[str, Any] = {"numel": numel, "threads": torch.get_num_threads(), "memcpy_gbps": memcpy,
                              "cpp": bool(cpp_cases), "kernels": {}}
    for name, (_, nbytes) in twin_cases.items():
        twin = nbytes / statistics.median(times["twin_" + name]) / 1e9
        row = {"twin_gbps": twin}
        if cpp_cases:
            gbps = cpp_cases[name][1] / statistics.median(times[name]) / 1e9
            row.update(gbps=gbps, vs_memcpy=gbps / memcpy, vs_twin=gbps / twin)
        result["kernels"][name] = row
    return result
