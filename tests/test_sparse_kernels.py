"""The C++ sparse kernels (torch.ops.zb.sparse_compress, sparse_decode_add) against their PyTorch twins
(zb/collectives/sparse_twins.py), bit for bit: payload bytes, residual bits (NaN patterns included) and decoded
sums, over chunk sizes, short last chunks, decays, ties, special values and forged payloads, on 1 and 2 threads."""

from __future__ import annotations

import pytest
import torch
from test_kernels import _same, _ulps

from zb.collectives import kernels, sparse_twins
from zb.collectives.build import use_cpp
from zb.collectives.sparse_twins import SparseScheme

pytestmark = pytest.mark.skipif(not use_cpp(), reason="C++ kernels unavailable (no compiler or ZB_USE_CPP=0)")

SCHEMES = [SparseScheme(4096, 64), SparseScheme(16, 8), SparseScheme(1024, 32), SparseScheme(65536, 64)]
SCHEME_IDS = [f"{s.chunk}/{s.k}" for s in SCHEMES]
BETAS = [None, 0.0, 0.95, 1.0]   # None: no residual (acc = x)
THREADS = [1, 2]


def _sizes(s: SparseScheme) -> list[int]:
    """n < k; a last chunk shorter than k; one between k and the chunk; a whole number of chunks; and enough
    chunks for 2 threads to split (a task is 32768 values, or one chunk when chunks are bigger: the twin's sort of
    65536-value chunks is slow, so they get two chunks at most)."""
    c, k = s.chunk, s.k
    sizes = [k - 3, c + k // 2, c + (c + k) // 2]
    if c <= 4096:
        sizes += [2 * c, 40_003]
    return sorted(set(sizes))


def _laplace(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.empty(n).exponential_(generator=g) - torch.empty(n).exponential_(generator=g)) * scale


def _set_bits(t: torch.Tensor, i: int | slice, bits: int) -> None:
    """t[i] = the float32 of these bits (a NaN's sign and payload kept)."""
    t.view(torch.int32)[i] = bits - (1 << 32) if bits >> 31 else bits


def _compress(x: torch.Tensor, s: SparseScheme, threads: int | None, residual: torch.Tensor | None = None,
              beta: float = 1.0) -> torch.Tensor:
    """The payload (filled with junk first: a kernel must write every byte); the twin when threads is None."""
    payload = torch.full((s.payload_bytes(x.numel()),), 0xA7, dtype=torch.uint8)
    if threads is None:
        sparse_twins.compress(x, payload, s, residual, beta)
    else:
        torch.ops.zb.sparse_compress(x, payload, s.chunk, s.k, residual, beta, threads)
    return payload


def _decode_add(payload: torch.Tensor, acc: torch.Tensor, s: SparseScheme, threads: int | None) -> bool:
    if threads is None:
        return sparse_twins.decode_add(payload, acc, s)
    return bool(torch.ops.zb.sparse_decode_add(payload, acc, s.chunk, s.k, threads))


def _outputs(x: torch.Tensor, s: SparseScheme, beta: float | None, e: torch.Tensor, acc0: torch.Tensor,
             threads: int | None) -> list[torch.Tensor]:
    """Payload, residual, and the payload decoded onto acc0 (plus whether decode accepted it)."""
    residual = None if beta is None else e.clone()
    payload = _compress(x, s, threads, residual, 1.0 if beta is None else beta)
    acc = acc0.clone()
    ok = _decode_add(payload, acc, s, threads)
    return [payload, e if residual is None else residual, acc, torch.tensor(ok)]


def _assert_match(x: torch.Tensor, s: SparseScheme, e: torch.Tensor | None = None,
                  acc0: torch.Tensor | None = None, betas: list[float | None] = BETAS) -> None:
    n = x.numel()
    e = _laplace(n, n + 1, 0.3) if e is None else e
    acc0 = _laplace(n, n + 2) if acc0 is None else acc0
    for beta in betas:
        want = _outputs(x, s, beta, e, acc0, None)
        for threads in THREADS:
            got = _outputs(x, s, beta, e, acc0, threads)
            bad = [name for name, a, b in zip(("payload", "residual", "decoded", "accepted"), got, want)
                   if not _same(a, b)]
            assert not bad, f"{s}, {n} values, beta {beta}, {threads} thread(s): {bad} differ from the twin"


@pytest.mark.parametrize("scheme", SCHEMES, ids=SCHEME_IDS)
def test_laplace_matches_the_twin(scheme: SparseScheme) -> None:
    for n in _sizes(scheme):
        _assert_match(_laplace(n, n), scheme)


@pytest.mark.parametrize("scheme", SCHEMES[:3], ids=SCHEME_IDS[:3])
def test_ties_and_special_values_match_the_twin(scheme: SparseScheme) -> None:
    """Ties (all zeros, a few repeated values: the lower index wins), scales below 2^-100 (sent as 0), subnormal
    values, sums that overflow to Inf, and chunks with NaN and Inf, in x and in the residual (NaN in both at
    once, of either sign: every NaN written is the default one)."""
    c, k = scheme.chunk, scheme.k
    n = 2 * c + (c + k) // 2
    g = torch.Generator().manual_seed(7)
    repeated = torch.randint(-3, 4, (n,), generator=g).float() * 0.5
    tiny = _laplace(n, 8) * 1e-32
    denormal = _laplace(n, 9) * 1e-40
    huge = _laplace(n, 10).sign() * 3e38
    special = _laplace(n, 11)
    e = _laplace(n, 12, 0.3)
    special[5] = float("nan")                     # chunk 0: NaN in x
    special[c + 3] = float("inf")                 # chunk 1: Inf in x (beta * e + Inf: Inf)
    e[c + 7] = float("-inf")                      # and -Inf in e (beta * -Inf + x: -Inf; beta 0: NaN)
    _set_bits(e, 2 * c + 1, 0xFFC00001)          # chunk 2: NaN in both, of either sign and any payload
    _set_bits(special, 2 * c + 1, 0x7FC00123)
    _set_bits(e, 2 * c + k + 2, 0x7FC00456)
    special[2 * c + k + 2] = float("nan")
    special[-1] = float("-inf")                   # chunk 2 is the short last one
    acc0 = _laplace(n, 13)
    _set_bits(acc0, 1, 0xFFC00789)                # decode onto a NaN
    for x in (torch.zeros(n), repeated, tiny, denormal, huge):
        _assert_match(x, scheme)
    _assert_match(special, scheme, e, acc0)
    _assert_match(special[: k - 3], scheme, e[: k - 3], acc0[: k - 3])   # n < k, with a NaN


@pytest.mark.parametrize("scheme", [SparseScheme(16, 16), SparseScheme(32, 24), SparseScheme(256, 128),
                                    SparseScheme(2048, 8)], ids=["16/16", "32/24", "256/128", "2048/8"])
def test_k_near_the_chunk_and_ordered_values_match_the_twin(scheme: SparseScheme) -> None:
    """k up to the whole chunk (the kernel's block maxima then bound nothing), and orders that defeat a running
    threshold: ascending and descending magnitudes, one loud block per chunk, ties straddling the k-th place."""
    c, k = scheme.chunk, scheme.k
    n = 5 * c + k // 2 + 1
    ramp = torch.arange(n, dtype=torch.float32) * torch.tensor([1.0, -1.0]).repeat(n)[:n]
    loud = _laplace(n, 60) * 0.01
    loud[(torch.arange(n) % c) // 16 == 3] *= 1e4
    ties = torch.zeros(n)
    ties[torch.arange(n) % 3 == 0] = 2.0           # more 2s than k in a chunk: the first ones win
    ties[torch.arange(n) % 7 == 0] = -5.0
    for x in (ramp, ramp.flip(0), loud, ties):
        _assert_match(x, scheme, betas=[None, 0.95])


def test_packing_by_hand() -> None:
    """chunk 16, k 8, 21 values: the payload's bytes as the twin's docstring lays them out, on both paths."""
    s = SparseScheme(16, 8)
    x = torch.tensor([1, -4, 2, 2, 0, 3, -3, 2, 0.5, 2, 0, 0, -2, 0, 0, 5,
                      -1, 0, 0.5, -0.25, 0], dtype=torch.float32)
    # chunk 0: |x| 5 (15), 4 (1), 3 (5, 6), then 2 at 2, 3, 7, 9 (12 loses the tie); sum 23, scale 23 / 8 = 2.875,
    # split 3.234375: codes -4 -> 3, 3 -> 0, -3 -> 2, 5 -> 1, 2 -> 0. chunk 1 (5 values): all picked, scale 1.75 / 5,
    # codes -1 -> 3, 0 -> 0, 0.5 -> 1, -0.25 -> 2, 0 -> 0; slots 5 .. 7 zero.
    scale1 = torch.tensor(1.75) / torch.tensor(5.0)
    scales = torch.stack([torch.tensor(2.875), scale1]).view(torch.uint8).tolist()
    # Elias-Fano with l = 1 (8 x 2 <= 16): chunk 0's indices 1 2 3 5 6 7 9 15 have low bits 1 0 1 1 0 1 1 1 (0xED)
    # and high parts 0 1 1 2 3 3 4 7, so bits 0 2 3 5 7 8 10 14 of 16 (0xAD 0x45); chunk 1's 0 .. 4: low bits
    # 0 1 0 1 0 (0x0A), high parts 0 0 1 1 2 at bits 0 1 3 4 6 (0x5B 0x00).
    indices = [0xED, 0xAD, 0x45, 0x0A, 0x5B, 0x00]
    codes = [0x03, 0x42, 0x93, 0x00]
    lo, hi = 2.875 * 0.875, 2.875 * 1.375
    want = torch.zeros(21)
    want[[1, 2, 3, 5, 6, 7, 9, 15]] = torch.tensor([-hi, lo, lo, lo, -lo, lo, lo, hi])
    want[16:21] = torch.stack([-scale1 * 1.375, scale1 * 0.875, scale1 * 1.375, -scale1 * 0.875, scale1 * 0.875])
    for threads in (None, 1, 2):
        payload = _compress(x, s, threads)
        assert payload.tolist() == scales + indices + codes, (threads, [hex(b) for b in payload.tolist()])
        out = torch.zeros(21)
        assert _decode_add(payload, out, s, threads)
        assert _same(out, want), threads


@pytest.mark.parametrize("scheme", SCHEMES, ids=SCHEME_IDS)
def test_sent_plus_kept_is_the_accumulated(scheme: SparseScheme) -> None:
    """decoded + residual == beta * e + x (the fp32 acc) to the one rounding of acc - value; the K' largest |acc|
    of each chunk are the ones sent."""
    n = 2 * scheme.chunk + scheme.k // 2
    x, e0 = _laplace(n, 20), _laplace(n, 21, 0.3)
    for beta in (0.0, 0.95, 1.0):
        acc = torch.full_like(e0, beta) * e0 + x
        e = e0.clone()
        payload = _compress(x, scheme, 2, e, beta)
        sent = torch.zeros(n)
        assert _decode_add(payload, sent, scheme, 2)
        err = (sent.double() + e.double() - acc.double()).abs()
        assert torch.all(err <= _ulps(e)), (beta, err.max())
        assert torch.equal(e[sent == 0], acc[sent == 0])
        for c in range(scheme.chunks(n)):
            a, d = acc[c * scheme.chunk:(c + 1) * scheme.chunk], sent[c * scheme.chunk:(c + 1) * scheme.chunk]
            assert int((d != 0).sum()) == min(scheme.k, a.numel())
            if bool((d == 0).any()):
                assert a.abs()[d != 0].min() >= a.abs()[d == 0].max()


def _short_tail_payload(s: SparseScheme) -> tuple[torch.Tensor, int]:
    n = 2 * s.chunk + s.k // 2 + 3          # a last chunk of k/2 + 3 values
    return _compress(_laplace(n, 30), s, 1), n


def _field(s: SparseScheme, bits: list[int], lows: list[int]) -> torch.Tensor:
    """A chunk's index field written by hand: the high-part bits set at `bits`, low parts `lows` in slot order."""
    low = sum(v << (j * s.low_bits) for j, v in enumerate(lows)).to_bytes(s.low_bytes(), "little")
    high = sum(1 << b for b in bits).to_bytes(s.index_bytes() - s.low_bytes(), "little")
    return torch.tensor(list(low + high), dtype=torch.uint8)


def _field_of(s: SparseScheme, indices: list[int]) -> torch.Tensor:
    """The Elias-Fano field of these indices (any order: slot j's high part at bit high + j)."""
    mask = (1 << s.low_bits) - 1
    return _field(s, [(i >> s.low_bits) + j for j, i in enumerate(indices)], [i & mask for i in indices])


def _with_field(payload: torch.Tensor, n: int, s: SparseScheme, c: int, field: torch.Tensor) -> torch.Tensor:
    out = payload.clone()
    at = 4 * s.chunks(n) + c * s.index_bytes()
    out[at:at + s.index_bytes()] = field
    return out


def _refused_everywhere(payload: torch.Tensor, acc0: torch.Tensor, s: SparseScheme) -> bool:
    for threads in (None, 1, 2):
        acc = acc0.clone()
        if _decode_add(payload, acc, s, threads) is not False or not _same(acc, acc0):
            return False
    return True


@pytest.mark.parametrize("scheme", SCHEMES[:3], ids=SCHEME_IDS[:3])
def test_forged_index_fields_are_refused_whole(scheme: SparseScheme) -> None:
    """Both paths refuse the payload whole (acc untouched, bit for bit): an index past the short last chunk's end,
    one past a whole chunk's end (a high part the code can carry but no chunk has), and high-part bits that are
    not exactly K' ones; the same fields written honestly are accepted, and low parts past K' are not read."""
    payload, n = _short_tail_payload(scheme)
    s, c, k, tail = scheme, scheme.chunk, scheme.k, n - 2 * scheme.chunk
    acc0 = _laplace(n, 31)
    last = list(range(tail - 1))
    honest = _with_field(payload, n, s, 2, _field_of(s, [*last, tail - 1]))
    forged = {
        "past the last chunk's end": _with_field(payload, n, s, 2, _field_of(s, [*last, tail])),
        "every slot past the end": _with_field(payload, n, s, 2, _field_of(s, list(range(tail, 2 * tail)))),
        "past a whole chunk's end": _with_field(payload, n, s, 0, _field_of(s, [*range(k - 1), c])),
        "one 1 too few": _with_field(payload, n, s, 0, _field(s, list(range(k - 1)), [0] * k)),
        "one 1 too many": _with_field(payload, n, s, 1, _field(s, list(range(k + 1)), [0] * k)),
        "a 1 past the last chunk's K'": _with_field(payload, n, s, 2, _field(s, list(range(tail + 1)), [0] * k)),
    }
    for what, bad in forged.items():
        assert _refused_everywhere(bad, acc0, s), what
    junk_lows = honest.clone()      # junk in the low parts of the slots past K' (tail .. k - 1) is ignored
    at = 4 * 3 + 2 * s.index_bytes()
    if s.low_bits:
        stream = int.from_bytes(bytes(junk_lows[at:at + s.low_bytes()].tolist()), "little")
        stream |= ((1 << ((k - tail) * s.low_bits)) - 1) << (tail * s.low_bits)
        junk_lows[at:at + s.low_bytes()] = torch.tensor(list(stream.to_bytes(s.low_bytes(), "little")),
                                                        dtype=torch.uint8)
    results = []
    for p in (honest, junk_lows):
        for threads in (None, 1, 2):
            acc = acc0.clone()
            assert _decode_add(p, acc, s, threads), threads
            results.append(acc)
    assert all(_same(r, results[0]) for r in results)


@pytest.mark.parametrize("scheme", SCHEMES[:3], ids=SCHEME_IDS[:3])
def test_forged_payloads_decode_alike(scheme: SparseScheme) -> None:
    """Random bytes: index fields of any bits, repeated and unordered indices (added in slot order), any code, scales
    of any bits (NaN of any sign and payload, Inf, subnormal); refused or added identically on every path."""
    g = torch.Generator().manual_seed(40)
    accepted = 0
    for n in (40_003, 3 * scheme.chunk, scheme.k - 3):
        for trial in range(4):
            payload = torch.randint(0, 256, (scheme.payload_bytes(n),), dtype=torch.uint8, generator=g)
            if trial % 2:   # every chunk's K' high parts 0 and random low parts: repeats abound, most accepted
                live = min(scheme.k, n)
                for c in range(scheme.chunks(n)):
                    kk = min(live, n - c * scheme.chunk)
                    lows = torch.randint(0, 1 << scheme.low_bits, (scheme.k,), generator=g).tolist()
                    payload = _with_field(payload, n, scheme, c, _field(scheme, list(range(kk)), lows))
            scales = payload[:4 * scheme.chunks(n)].view(torch.float32)
            if trial < 2:   # a -NaN with a payload and an Inf among the scales; decoded onto NaNs
                _set_bits(scales, 0, 0xFFC00001)
                _set_bits(scales, -1, 0x7F800000)
            acc0 = _laplace(n, trial)
            _set_bits(acc0, slice(None, None, 7), 0x7FC00ABC)
            results = []
            for threads in (None, 1, 2):
                acc = acc0.clone()
                results.append((_decode_add(payload, acc, scheme, threads), acc))
            assert all(ok == results[0][0] and _same(acc, results[0][1]) for ok, acc in results), (n, trial)
            if not results[0][0]:
                assert _same(results[0][1], acc0)
            accepted += results[0][0]
    assert accepted >= 3


def test_empty_tensors() -> None:
    s = SparseScheme(16, 8)
    x, payload = torch.empty(0), torch.empty(0, dtype=torch.uint8)
    for threads in (None, 1, 2):
        residual = torch.empty(0)
        if threads is None:
            sparse_twins.compress(x, payload, s, residual, 0.5)
        else:
            torch.ops.zb.sparse_compress(x, payload, s.chunk, s.k, residual, 0.5, threads)
            torch.ops.zb.sparse_compress(x, payload, s.chunk, s.k, None, 1.0, threads)
        assert _decode_add(payload, torch.empty(0), s, threads) is True


def test_the_wrappers_use_the_kernels() -> None:
    s = SparseScheme()
    x = _laplace(50_001, 50)
    out = []
    for cpp in (True, False):
        payload = torch.empty(s.payload_bytes(x.numel()), dtype=torch.uint8)
        residual = _laplace(x.numel(), 51, 0.3)
        kernels.sparse_compress(x, payload, s, residual=residual, beta=0.9, cpp=cpp)
        acc = x.clone()
        assert kernels.sparse_decode_add(payload, acc, s, cpp=cpp) is True
        out.append((payload, residual, acc))
    assert all(_same(a, b) for a, b in zip(*out))


def test_bad_arguments_are_rejected() -> None:
    x = torch.randn(100)
    payload = torch.empty(SparseScheme(16, 8).payload_bytes(100), dtype=torch.uint8)
    op = torch.ops.zb.sparse_compress
    with pytest.raises(RuntimeError, match="chunk"):
        op(x, payload, 24, 8, None, 1.0, 1)
    with pytest.raises(RuntimeError, match="chunk"):
        op(x, payload, 8, 8, None, 1.0, 1)
    with pytest.raises(RuntimeError, match="k must"):
        op(x, payload, 16, 12, None, 1.0, 1)
    with pytest.raises(RuntimeError, match="k must"):
        op(x, payload, 16, 24, None, 1.0, 1)
    with pytest.raises(RuntimeError, match="threads"):
        op(x, payload, 16, 8, None, 1.0, 0)
    with pytest.raises(RuntimeError, match="payload"):
        op(x, payload[1:], 16, 8, None, 1.0, 1)
    with pytest.raises(RuntimeError, match="float32"):
        op(x.double(), payload, 16, 8, None, 1.0, 1)
    with pytest.raises(RuntimeError, match="residual"):
        op(x, payload, 16, 8, torch.zeros(99), 1.0, 1)
    with pytest.raises(RuntimeError, match="payload"):
        torch.ops.zb.sparse_decode_add(payload.float(), x, 16, 8, 1)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.zb.sparse_decode_add(payload, x[::2], 16, 8, 1)
