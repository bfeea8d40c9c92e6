"""The C++ quantization kernels (int8, int4, int2) against their PyTorch twins, bit for bit, on odd
sizes, odd block sizes and odd values, on 1 and 2 threads, with and without error feedback."""

from __future__ import annotations

import math

import pytest
import torch

from zb.collectives import kernels, twins
from zb.collectives.build import use_cpp
from zb.collectives.twins import Scheme

pytestmark = pytest.mark.skipif(not use_cpp(), reason="C++ kernels unavailable (no compiler or ZB_USE_CPP=0)")

SCHEMES = list(kernels.SCHEMES.values())
SCHEME_IDS = list(kernels.SCHEMES)
# 100_003 values are more than one task (32768 values), so 2 threads really split the blocks.
SIZES = [1, 7, 257, 4097, 100_003]
KINDS = ["random", "heavy", "zeros", "constant", "huge", "tiny", "nonfinite", "denormal", "one_huge"]
THREADS = [1, 2]


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
        return torch.randn(n, generator=g) * 3e38  # int2's sums overflow: NaN scales
    if kind == "tiny":
        return torch.randn(n, generator=g) * 1e-35
    if kind == "nonfinite":
        x = torch.randn(n, generator=g)
        x[:: max(1, n // 5)] = float("nan")
        x[n // 2] = float("inf")
        x[-1] = float("-inf")
        return x
    if kind == "denormal":
        # subnormal values (below 2^-126) beside normal ones, and runs of subnormals only (scale 0)
        x = torch.randn(n, generator=g) * 1e-39
        x[: n // 2: 2] = torch.randn(len(range(0, n // 2, 2)), generator=g) * 1e-3
        return x
    if kind == "one_huge":
        # one huge value per 300 values: it takes its block's scale, the rest round to zero or near it
        x = torch.randn(n, generator=g) * 1e-2
        x[::300] = 3e38
        x[150::300] = -1e20
        return x
    raise ValueError(kind)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality, NaN included."""
    return torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                       b.view(torch.int32) if b.dtype == torch.float32 else b)


def _empty(n: int, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales filled with junk: a kernel must write every byte of them."""
    codes = torch.full((kernels.code_bytes(n, scheme),), 0xA7, dtype=torch.uint8)
    return codes, torch.full((kernels.num_blocks(n, scheme.block),), 7.0)


# Every kernel once: the twin when threads is None, else torch.ops.zb on that many threads.

def _quantize(x, scheme, threads, residual=None):
    codes, scales = _empty(x.numel(), scheme)
    if threads is None:
        twins.quantize(x, codes, scales, scheme, residual)
    else:
        torch.ops.zb.quantize(x, codes, scales, scheme.block, scheme.bits, residual, threads)
    return codes, scales


def _dequantize(codes, scales, out, scheme, threads, add):
    if threads is None:
        (twins.dequantize_add if add else twins.dequantize)(codes, scales, out, scheme)
    else:
        op = torch.ops.zb.dequantize_add if add else torch.ops.zb.dequantize
        op(codes, scales, out, scheme.block, scheme.bits, threads)


def _reduce_quantize(in_codes, in_scales, acc, scheme, threads, divisor, write_back, residual):
    out_codes, out_scales = _empty(acc.numel(), scheme)
    if threads is None:
        twins.reduce_quantize(in_codes, in_scales, acc, out_codes, out_scales, scheme, divisor, write_back, residual)
    else:
        torch.ops.zb.reduce_quantize(in_codes, in_scales, acc, out_codes, out_scales, scheme.block, scheme.bits,
                                     divisor, write_back, residual, threads)
    return out_codes, out_scales


# (divisor, write_back, residual): each option both ways
HOPS = [(1.0, False, False), (3.0, True, True), (3.0, False, False), (1.0, True, True)]


def _all_kernels(x: torch.Tensor, scheme: Scheme, threads: int | None) -> list[torch.Tensor]:
    """Every output of every kernel on x, with and without a residual."""
    n = x.numel()
    g = torch.Generator().manual_seed(n + 1)
    res0 = torch.randn(n, generator=g) * 0.01
    acc0 = x.flip(0) + torch.randn(n, generator=g)
    outs: list[torch.Tensor] = []
    codes, scales = _quantize(x, scheme, threads)
    residual = res0.clone()
    outs += [codes, scales, *_quantize(x, scheme, threads, residual), residual]
    out = torch.full((n,), 5.0)
    _dequantize(codes, scales, out, scheme, threads, add=False)
    acc = acc0.clone()
    _dequantize(codes, scales, acc, scheme, threads, add=True)
    outs += [out, acc]
    for divisor, write_back, with_residual in HOPS:
        acc, residual = acc0.clone(), res0.clone()
        oc, os_ = _reduce_quantize(codes, scales, acc, scheme, threads, divisor, write_back,
                                   residual if with_residual else None)
        outs += [oc, os_, acc, residual]
    return outs


def _assert_match(x: torch.Tensor, scheme: Scheme) -> None:
    want = _all_kernels(x, scheme, None)
    for threads in THREADS:
        got = _all_kernels(x, scheme, threads)
        bad = [i for i, (a, b) in enumerate(zip(got, want)) if not _same(a, b)]
        assert not bad, f"{scheme}, {x.numel()} values, {threads} thread(s): outputs {bad} differ from the twin"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scheme", SCHEMES, ids=SCHEME_IDS)
def test_every_kernel_matches_its_twin(scheme: Scheme, kind: str) -> None:
    for n in SIZES:
        _assert_match(_values(kind, n), scheme)


@pytest.mark.parametrize("block", [1, 2, 3, 5, 6, 7, 9, 130, 600, 5000])
@pytest.mark.parametrize("scheme", SCHEMES, ids=SCHEME_IDS)
def test_odd_block_sizes_match_the_twin(scheme: Scheme, block: int) -> None:
    """Blocks that are not a multiple of the codes per byte (a byte then straddles two blocks, and a
    thread's run of blocks must start at a byte boundary), and blocks too big for the stack buffer."""
    odd = Scheme(scheme.name, scheme.bits, block)
    for n in (1, 2, 3, 13, 5001, 70_001):
        _assert_match(_values("heavy", n), odd)
    _assert_match(_values("nonfinite", 10_007), odd)


def test_empty_tensors() -> None:
    for scheme in SCHEMES:
        x = torch.empty(0)
        codes, scales = _quantize(x, scheme, 2, torch.empty(0))
        assert codes.numel() == scales.numel() == 0
        torch.ops.zb.dequantize(codes, scales, torch.empty(0), scheme.block, scheme.bits, 1)
        torch.ops.zb.reduce_quantize(codes, scales, torch.empty(0), codes, scales, scheme.block, scheme.bits, 3.0,
                                     True, torch.empty(0), 2)


def test_the_wrappers_use_the_kernels() -> None:
    """kernels.* (scheme keyword, kernels.threads() threads) give the twins' bits."""
    x = _values("heavy", 50_001)
    for scheme in SCHEMES:
        out = []
        for cpp in (True, False):
            codes, scales = _empty(x.numel(), scheme)
            residual = torch.full_like(x, 0.01)
            kernels.quantize(x, codes, scales, scheme=scheme, residual=residual, cpp=cpp)
            acc = x.clone()
            kernels.dequantize_add(codes, scales, acc, scheme=scheme, cpp=cpp)
            oc, os_ = _empty(x.numel(), scheme)
            kernels.reduce_quantize(codes, scales, acc, oc, os_, scheme=scheme, divisor=2.0, write_back=True,
                                    residual=residual, cpp=cpp)
            deq = torch.empty_like(x)
            kernels.dequantize(oc, os_, deq, scheme=scheme, cpp=cpp)
            out.append((codes, scales, residual, acc, oc, os_, deq))
        assert all(_same(a, b) for a, b in zip(*out)), scheme


@pytest.mark.parametrize("scheme", SCHEMES, ids=SCHEME_IDS)
def test_error_within_half_a_step(scheme: Scheme) -> None:
    """Absmax (int8, int4): every value within half a step (the scale) of its input. int2 (mean scale):
    within half a step for |x| <= 1.5 scale; beyond, clamped to +-scale."""
    x = _values("heavy", 100_000)
    codes, scales = _quantize(x, scheme, 2)
    out = torch.empty_like(x)
    _dequantize(codes, scales, out, scheme, 2, add=False)
    step = scales.repeat_interleave(scheme.block)[: x.numel()]
    err = (out - x).abs()
    if scheme.mean_scale:
        inside = x.abs() <= 1.5 * step
        assert torch.all(err[inside] <= step[inside] * (0.5 + 1e-5))
        assert torch.equal(out[~inside], x[~inside].sign() * step[~inside])
        assert inside.float().mean() > 0.5
    else:
        assert torch.all(err <= step * (0.5 + 1e-5))
        assert torch.all(out.abs() <= x.abs().max())


def _hand(scheme: Scheme, block: int, values: list[float], packed: list[int], scales: torch.Tensor,
          levels: list[int]) -> None:
    """Quantize values in blocks of `block`: the packed bytes, scales and dequantized levels * scale."""
    s = Scheme(scheme.name, scheme.bits, block)
    x = torch.tensor(values, dtype=torch.float32)
    for threads in (None, 1, 2):
        codes, sc = _quantize(x, s, threads)
        assert codes.tolist() == packed, (threads, [hex(b) for b in codes.tolist()])
        assert torch.equal(sc, scales), threads
        out = torch.empty_like(x)
        _dequantize(codes, sc, out, s, threads, add=False)
        assert torch.equal(out, torch.tensor(levels, dtype=torch.float32) * scales.repeat_interleave(block)[: len(x)])


def test_int4_packing_by_hand() -> None:
    """Two codes per byte, value i in bits 4 (i % 2); code = level + 7; the last byte's high bits zero."""
    int4 = kernels.SCHEMES["int4"]
    # block 4: [7, -7, 1, 0] m = 7, levels 7 -7 1 0 -> codes 14 0 8 7 -> bytes 0x0E 0x78;
    # [-2] m = 2, inv = 3.5, level -7 -> code 0 -> byte 0x00
    _hand(int4, 4, [7, -7, 1, 0, -2], [0x0E, 0x78, 0x00], torch.tensor([7.0, 2.0]) / 7, [7, -7, 1, 0, -7])
    # block 3 (bytes straddle blocks): [7, -7, 1] -> 14 0 8; [2, -2, 1] inv 3.5: 7 -7 3.5 (half to even: 4)
    # -> 14 0 11; [0.5] -> 14: codes 14 0 | 8 14 | 0 11 | 14 -> 0x0E 0xE8 0xB0 0x0E
    _hand(int4, 3, [7, -7, 1, 2, -2, 1, 0.5], [0x0E, 0xE8, 0xB0, 0x0E], torch.tensor([7.0, 2.0, 0.5]) / 7,
          [7, -7, 1, 7, -7, 4, 7])
    # ties round half to even: [7, 2.5, -2.5, 0.5] inv 1 -> levels 7 2 -2 0 -> codes 14 9 5 7 -> 0x9E 0x75
    _hand(int4, 4, [7, 2.5, -2.5, 0.5], [0x9E, 0x75], torch.tensor([1.0]), [7, 2, -2, 0])


def test_int2_packing_by_hand() -> None:
    """Four codes per byte, value i in bits 2 (i % 4); code = level + 1; scale = 2 mean |x|."""
    int2 = kernels.SCHEMES["int2"]
    # block 4: [2, -2, 0, 0] mean 1, scale 2: levels 1 -1 0 0 -> codes 2 0 1 1 -> 0x52;
    # [4, 0, 0, -0.5] mean 1.125, scale 2.25: 4 / 2.25 > 1.5 clamps to 1 -> codes 2 1 1 1 -> 0x56;
    # [3] scale 6, y = 0.5 rounds half to even: level 0 -> code 1 -> 0x01
    _hand(int2, 4, [2, -2, 0, 0, 4, 0, 0, -0.5, 3], [0x52, 0x56, 0x01], torch.tensor([2.0, 2.25, 6.0]),
          [1, -1, 0, 0, 1, 0, 0, 0, 0])
    # block 3 (bytes straddle blocks): [3, 0, 0] scale 2, y = 1.5 -> 2, clamped: 2 1 1; [-3, 0, 0] -> 0 1 1;
    # [1] scale 2, y = 0.5 -> 0: 1. codes 2 1 1 0 | 1 1 1 -> 0x16 0x15
    _hand(int2, 3, [3, 0, 0, -3, 0, 0, 1], [0x16, 0x15], torch.tensor([2.0, 2.0, 2.0]), [1, 0, 0, -1, 0, 0, 0])
    # ties: [0.5, 1, 0] sum 1.5, scale (1.5 / 3) * 2 = 1 in fp32, so y = x: 0.5 -> 0 (half to even), 1 -> 1;
    # [1.5, 0, 0] scale 1: 1.5 -> 2, clamped to 1. codes 1 2 1 | 2 1 1 -> 0x99 0x05
    _hand(int2, 3, [0.5, 1, 0, 1.5, 0, 0], [0x99, 0x05], torch.tensor([1.0, 1.0]), [0, 1, 0, 1, 0, 0])


def test_special_blocks() -> None:
    for scheme in SCHEMES:
        b = scheme.block
        x = torch.zeros(3 * b)
        x[0] = float("inf")  # block 0: non-finite -> all NaN
        x[b + 5] = 1e-31  # block 1: below 2^-100 -> all zero
        x[2 * b:] = torch.linspace(-2, 2, b)  # block 2: exact extremes
        codes, scales = _quantize(x, scheme, 2)
        out = torch.empty_like(x)
        _dequantize(codes, scales, out, scheme, 2, add=False)
        assert torch.isnan(out[:b]).all() and math.isnan(scales[0].item())
        assert torch.equal(out[b: 2 * b], torch.zeros(b)) and scales[1].item() == 0.0
        zero = {8: 128, 4: 0x77, 2: 0x55}[scheme.bits]  # zero codes fill the special blocks' bytes
        assert torch.all(codes[: 2 * b // scheme.per_byte] == zero)
        if scheme.bits == 8:
            assert codes[2 * b] == 1 and codes[-1] == 255
        if not scheme.mean_scale:
            assert math.isclose(out[-1].item(), 2.0, rel_tol=1e-6) and math.isclose(out[2 * b].item(), -2.0,
                                                                                      rel_tol=1e-6)


def test_zero_stays_exact() -> None:
    for scheme in SCHEMES:
        x = torch.randn(4096)
        x[::3] = 0.0
        codes, scales = _quantize(x, scheme, 1)
        out = torch.empty_like(x)
        _dequantize(codes, scales, out, scheme, 1, add=False)
        assert torch.equal(out[::3], torch.zeros_like(out[::3]))


def _ulps(v: torch.Tensor) -> torch.Tensor:
    """One fp32 rounding of v, as a float64 bound (subnormals included)."""
    return v.double().abs() * 2.0**-24 + 2.0**-149


@pytest.mark.parametrize("scheme", SCHEMES, ids=SCHEME_IDS)
def test_residual_keeps_what_quantization_dropped(scheme: Scheme) -> None:
    """quantize: x + old residual == dequantized + new residual, up to the roundings of t = x + r and of
    the new residual; reduce_quantize: acc + r + in == dequantized * divisor + new residual, likewise.
    Over rounds, the dequantized values sum to the inputs' sum plus what the residual holds."""
    n = 10_007
    g = torch.Generator().manual_seed(3)
    x, r0 = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1
    r = r0.clone()
    codes, scales = _quantize(x, scheme, 2, r)
    v = torch.empty(n)
    _dequantize(codes, scales, v, scheme, 2, add=False)
    t = x.double() + r0.double()
    assert torch.all((v.double() + r.double() - t).abs() <= _ulps(t) + _ulps(r))
    assert _same(r, (x + r0) - v)  # exactly the twin's t - value

    acc = torch.randn(n, generator=g)
    for divisor in (1.0, 3.0):
        r1 = r0.clone()
        oc, os_ = _reduce_quantize(codes, scales, acc.clone(), scheme, 2, divisor, False, r1)
        sent = torch.empty(n)
        _dequantize(oc, os_, sent, scheme, 2, add=False)
        s = (acc + r0) + v  # the fp32 sum the kernel quantizes (divided by the divisor)
        sd = sent.double() * divisor
        assert torch.all((sd + r1.double() - s.double()).abs() <= _ulps(sd) * (divisor != 1.0) + _ulps(r1))

    # error feedback over rounds: sum of what was sent == sum of inputs + r0 - final residual (to fp32 noise)
    r = r0.clone()
    sent_total, x_total = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for _ in range(8):
        xk = torch.randn(n, generator=g)
        codes, scales = _quantize(xk, scheme, 1, r)
        _dequantize(codes, scales, v, scheme, 1, add=False)
        sent_total += v.double()
        x_total += xk.double()
    drift = (sent_total - (x_total + r0.double() - r.double())).abs()
    assert drift.max() < 1e-4, drift.max()


def test_bad_arguments_are_rejected() -> None:
    x = torch.randn(10)
    with pytest.raises(RuntimeError, match="scales"):
        kernels.quantize(x, torch.empty(10, dtype=torch.uint8), torch.empty(5), cpp=True)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.quantize(x.double(), torch.empty(10, dtype=torch.uint8), torch.empty(1), cpp=True)
    int4 = kernels.SCHEMES["int4"]
    with pytest.raises(RuntimeError, match="codes"):  # int4 packs 10 values in 5 bytes
        kernels.quantize(x, torch.empty(10, dtype=torch.uint8), torch.empty(1), scheme=int4, cpp=True)
    with pytest.raises(RuntimeError, match="residual"):
        kernels.quantize(x, torch.empty(5, dtype=torch.uint8), torch.empty(1), scheme=int4,
                         residual=torch.empty(9), cpp=True)
    with pytest.raises(RuntimeError, match="bits"):
        torch.ops.zb.quantize(x, torch.empty(4, dtype=torch.uint8), torch.empty(1), 128, 3, None, 1)
    with pytest.raises(RuntimeError, match="threads"):
        torch.ops.zb.dequantize(torch.empty(10, dtype=torch.uint8), torch.empty(1), x, 128, 8, 0)
    with pytest.raises(RuntimeError, match="block"):
        torch.ops.zb.dequantize(torch.empty(10, dtype=torch.uint8), torch.empty(1), x, 0, 8, 1)


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


def test_the_logged_thread_count_is_the_kernels(monkeypatch):
    """build.py logs the threads a kernel call gets (kernels.threads()), without importing kernels.py."""
    from zb.collectives import build

    assert build._threads() == kernels.threads()
    monkeypatch.setattr(kernels, "_colocated", 64)  # 64 ranks share this host: 1 thread each
    assert build._threads() == kernels.threads() == 1


def test_threads_are_the_hosts_cores_shared_by_its_colocated_ranks(monkeypatch):
    """Ranks that share a host split its cores (torchrun's LOCAL_WORLD_SIZE, or set_colocated), never
    above torch's thread count: two ranks on two cores get one thread each (issue 25: 0.31x oversubscribed)."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(kernels, "_colocated", None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert kernels.threads() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert kernels.threads() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert kernels.threads() == 1
    kernels.set_colocated(1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert kernels.threads() == 3
