"""What each shape of the quantized all-reduce costs on links of one delay and one bandwidth: the model the
`auto` shape is chosen by (zb.collectives.allreduce.pick_shape) and scripts/bench_reduce_shapes.py prints.

Each step costs the one-way delay once plus the biggest message any rank sends in it over the bandwidth (a
step waits for its slowest pair), summed over the steps, with the layouts the code itself uses
(zb.collectives.pieces.Layout for the ring, zb.collectives.halving.Plan for halving-doubling). Ring: 2 (W - 1)
steps of a chunk. Halving: 2 log2 P steps of shrinking, then growing, halves (P the largest power of two <= W),
plus the fold and the unfold of the whole tensor when W is not a power of two. Left out: the kernels' time, a
pipeline's fill and TCP's slow start (BENCHMARKS.md "Scale" sets the model beside loopback measurements)."""

from __future__ import annotations

from functools import lru_cache

from zb.collectives.halving import Plan
from zb.collectives.kernels import SCHEMES
from zb.collectives.pieces import Layout


@lru_cache(maxsize=64)
def ring_steps(n: int, world: int, piece_values: int, compression: str) -> tuple[int, ...]:
    """Bytes of the biggest message of each of the ring's 2 (W - 1) steps (a whole chunk, all its pieces)."""
    layout = Layout(n, world, piece_values, SCHEMES[compression])
    chunk = max(sum(p.nbytes for p in c if p.numel) for c in layout.chunks)
    return (chunk,) * (2 * (world - 1))


@lru_cache(maxsize=64)
def halving_steps(n: int, world: int, piece_values: int, compression: str) -> tuple[int, ...]:
    """Bytes of the biggest message (over ranks: all its pieces) of each halving-doubling step."""
    plans = [Plan(n, world, r, piece_values, SCHEMES[compression]) for r in range(world)]
    per_step = [0] * plans[0].steps
    for plan in plans:
        sent = [0] * plan.steps
        for m in plan.sends:
            sent[m.step] += m.piece.nbytes
        per_step = [max(a, b) for a, b in zip(per_step, sent)]
    return tuple(per_step)


def modelled(steps: tuple[int, ...], delay_s: float, mbps: float) -> float:
    """Seconds of `steps` (bytes of each step's biggest message) on links of `delay_s` one way and `mbps`."""
    return sum(delay_s + b * 8 / (mbps * 1e6) for b in steps)


def faster_shape(n: int, world: int, piece_values: int, compression: str, delay_s: float, mbps: float) -> str:
    """"halving" when the model says it takes less time than the ring for `n` values over `world` ranks, else
    "ring"."""
    ring = modelled(ring_steps(n, world, piece_values, compression), delay_s, mbps)
    halving = modelled(halving_steps(n, world, piece_values, compression), delay_s, mbps)
    return "halving" if halving < ring else "ring"
