"""The C++ int8 kernels against their PyTorch twins, bit for bit, on odd sizes and odd values."""

from __future__ import annotations

import math

import pytest
import torch

from zb.collectives import kernels
from zb.collectives.build import use_cpp

pytestmark = pytest.mark.skipif(not use_cpp(), reason="C++ kernels unavailable (no compiler or ZB_USE_CPP=0)")

SIZES = [1, 7, 255, 256, 257, 1000, 4097, 100_003]


def _values(kind: str, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    if kind == "random":
        return torch.randn(n, generator=g) * 3.0
    if kind == "heavy":
        # Student-t with 2 degrees of freedom: z / sqrt(chi2_2 / 2), chi2_2 / 2 = -log(u)
        return torch.randn(n, generator=g) / (-torch.rand(n, generator=g).clamp(min=1e-12).log()).sqrt()
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "constant":
        return torch.full((n,), -0.3)
    if kind == "huge":
        return torch.randn(n, generator=g) * 3e38
    if kind == "tiny":
        return torch.randn(n, generator=g) * 1e-35
    if kind == "nonfinite":
        x = torch.randn(n, generator=g)
        x[:: max(1, n // 5)] = float("nan")
        x[n // 2] = float("inf")
        x[-1] = float("-inf")
        return x
    raise ValueError(kind)


KINDS = ["random", "heavy", "zeros", "constant", "huge", "tiny", "nonfinite"]


def _quantized(x: torch.Tensor, cpp: bool, block: int = kernels.BLOCK):
    codes = torch.full((x.numel(),), 7, dtype=torch.uint8)
    scales = torch.full((kernels.num_blocks(x.numel(), block),), 7.0)
    kernels.quantize(x, codes, scales, block=block, cpp=cpp)
    return codes, scales


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality, NaN included."""
    return torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                       b.view(torch.int32) if b.dtype == torch.float32 else b)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", SIZES)
def test_quantize_dequantize_match_twin(kind: str, n: int) -> None:
    x = _values(kind, n)
    (c1, s1), (c2, s2) = _quantized(x, True), _quantized(x, False)
    assert _same(c1, c2) and _same(s1, s2)
    out1, out2 = torch.empty(n), torch.empty(n)
    kernels.dequantize(c1, s1, out1, cpp=True)
    kernels.dequantize(c2, s2, out2, cpp=False)
    assert _same(out1, out2)
    acc1, acc2 = torch.linspace(-1, 1, n), torch.linspace(-1, 1, n)
    kernels.dequantize_add(c1, s1, acc1, cpp=True)
    kernels.dequantize_add(c2, s2, acc2, cpp=False)
    assert _same(acc1, acc2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("divisor,write_back", [(1.0, False), (3.0, True)])
def test_reduce_quantize_matches_twin(kind: str, n: int, divisor: float, write_back: bool) -> None:
    codes, scales = _quantized(_values("random", n), False)
    results = []
    for cpp in (True, False):
        acc = _values(kind, n).clone()
        out_c, out_s = _quantized(torch.zeros(n), False)
        kernels.reduce_quantize(codes, scales, acc, out_c, out_s, divisor=divisor, write_back=write_back, cpp=cpp)
        results.append((acc, out_c, out_s))
    for a, b in zip(*results):
        assert _same(a, b)


@pytest.mark.parametrize("block", [1, 3, 256, 4096])
def test_other_block_sizes_match_twin(block: int) -> None:
    x = _values("heavy", 10_001)
    (c1, s1), (c2, s2) = _quantized(x, True, block), _quantized(x, False, block)
    assert _same(c1, c2) and _same(s1, s2)


def test_error_within_half_step() -> None:
    x = _values("heavy", 100_000)
    codes, scales = _quantized(x, True)
    out = torch.empty_like(x)
    kernels.dequantize(codes, scales, out)
    step = scales.repeat_interleave(kernels.BLOCK)[: x.numel()]
    assert torch.all((out - x).abs() <= step * (0.5 + 1e-5))


def test_special_blocks() -> None:
    x = torch.zeros(3 * kernels.BLOCK)
    x[0] = float("inf")  # block 0: non-finite -> all NaN
    x[kernels.BLOCK + 5] = 1e-31  # block 1: below 2^-100 -> all zero
    x[2 * kernels.BLOCK:] = torch.linspace(-2, 2, kernels.BLOCK)  # block 2: exact extremes
    codes, scales = _quantized(x, True)
    out = torch.empty_like(x)
    kernels.dequantize(codes, scales, out)
    assert torch.isnan(out[: kernels.BLOCK]).all()
    assert torch.equal(out[kernels.BLOCK: 2 * kernels.BLOCK], torch.zeros(kernels.BLOCK))
    assert codes[2 * kernels.BLOCK] == 1 and codes[-1] == 255
    assert math.isclose(out[-1].item(), 2.0, rel_tol=1e-6)


def test_zero_stays_exact() -> None:
    x = torch.randn(4096)
    x[::3] = 0.0
    codes, scales = _quantized(x, True)
    out = torch.empty_like(x)
    kernels.dequantize(codes, scales, out)
    assert torch.equal(out[::3], torch.zeros_like(out[::3]))


def test_bad_arguments_are_rejected() -> None:
    x = torch.randn(10)
    with pytest.raises(RuntimeError, match="scales"):
        kernels.quantize(x, torch.empty(10, dtype=torch.uint8), torch.empty(5), cpp=True)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.quantize(x.double(), torch.empty(10, dtype=torch.uint8), torch.empty(1), cpp=True)


def test_twin_path_forced(monkeypatch) -> None:
    from zb.collectives import build

    monkeypatch.setenv("ZB_USE_CPP", "0")
    monkeypatch.setattr(build, "_state", {})
    assert build.use_cpp() is False
    monkeypatch.setenv("ZB_USE_CPP", "maybe")
    monkeypatch.setattr(build, "_state", {})
    from zb.errors import InvalidInput

    with pytest.raises(InvalidInput):
        build.use_cpp()


def test_the_kernel_line_counts_threads_in_english():
    """"1 threads" (issue 30, minor)."""
    from zb.collectives.build import cpp_kernels_line

    assert cpp_kernels_line(1, True) == "C++ (torch.ops.zb, 1 thread, OpenMP)"
    assert cpp_kernels_line(2, False) == "C++ (torch.ops.zb, 2 threads, std::threads)"
