"""What each value of diloco.overlap is: the facts about a mode that the config, the node and the
training loop ask (does an average travel behind the inner steps, are there fragments, what it
refuses and warns about). Behaviour lives in the algorithm each mode names (zb.diloco.algorithms);
these facts live here, in a base module, because the config is checked before anything of DiLoCo
is imported (zb.config loads it; the layers of docs/architecture.md keep config below diloco).

Nothing outside this module and zb.diloco.algorithms compares a mode's name: ask its class.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, Protocol

_FRAGMENT_KEYS = ("fragments", "fragment_delay", "fragment_alpha")


class DilocoSettings(Protocol):
    """The [diloco] keys a mode's checks read (zb.config_schema.DilocoConfig)."""

    inner_steps: int
    fragments: int
    fragment_delay: int
    fragment_alpha: float

    def momentum(self) -> float: ...


class Mode:
    """A value of diloco.overlap."""

    name: ClassVar[str]
    in_flight: ClassVar[bool] = False     # an average travels behind the inner steps and is applied at a later boundary
    fragmented: ClassVar[bool] = False    # the model syncs in diloco.fragments parts (the fragment_* keys apply)
    memory_note: ClassVar[str] = ""       # what its extra CPU memory holds, for the start line

    @classmethod
    def round_parts(cls, d: DilocoSettings) -> int:
        """Boundaries in one round of a round budget (diloco.round_seconds)."""
        return 1

    @classmethod
    def problems(cls, d: DilocoSettings, adaptive: bool) -> Iterator[tuple[str, str]]:
        """(key, what is wrong) for settings this mode cannot run; `adaptive`: diloco.round_seconds is set."""
        return iter(())

    @classmethod
    def advisories(cls, d: DilocoSettings) -> Iterator[tuple[str, str]]:
        """(key, why it is probably not what was meant) for settings it runs but that look mistaken."""
        return iter(())


class Blocking(Mode):
    name = "none"


class Eager(Mode):
    name = "eager"
    in_flight = True
    memory_note = "buffers in flight, the eager term"

    @classmethod
    def advisories(cls, d: DilocoSettings) -> Iterator[tuple[str, str]]:
        yield "diloco.overlap", ("eager lost 14-37% in loss against blocking DiLoCo, best setting against best, on every "
                                 "model we could train on a CPU (0.15M-6.6M params), and 4% at 53M on a GPU, where "
                                 "streaming was within 1% or better (BENCHMARKS.md, \"Eager across the regime\", "
                                 "\"Fidelity at scale\"): prefer diloco.overlap = streaming unless a short run of your "
                                 "own model says otherwise")
        if d.momentum() > 0:
            yield "diloco.outer_momentum", ("with diloco.overlap = eager, outer momentum made eager 84-99% worse than "
                                            "blocking DiLoCo in our CPU sweep and 27-34% worse at 53M on a GPU, where "
                                            "momentum 0 with diloco.outer_lr 0.7 was eager's best (BENCHMARKS.md, \"Eager "
                                            "across the regime\", \"Fidelity at scale\"): set diloco.outer_momentum = 0")


class Streaming(Mode):
    name = "streaming"
    in_flight = True
    fragmented = True
    memory_note = "buffers in flight"

    @classmethod
    def round_parts(cls, d: DilocoSettings) -> int:
        return d.fragments

    @classmethod
    def problems(cls, d: DilocoSettings, adaptive: bool) -> Iterator[tuple[str, str]]:
        """Fixed rounds cut into fragments' steps (with diloco.round_seconds the clock cuts them: zb.diloco.rounds)."""
        if not adaptive and d.inner_steps % d.fragments:
            yield "diloco.fragments", f"must divide diloco.inner_steps ({d.inner_steps}): each fragment syncs once a round"
        elif not adaptive and d.fragment_delay >= d.inner_steps // d.fragments:
            yield "diloco.fragment_delay", (f"must be below inner_steps / fragments ({d.inner_steps // d.fragments}): a "
                                            "fragment's all-reduce must end before the next one starts")
        if not 0.0 <= d.fragment_alpha <= 1.0:
            yield "diloco.fragment_alpha", "must be between 0 and 1"


class Delayed(Mode):
    name = "delayed"
    in_flight = True
    memory_note = "buffers in flight"

    @classmethod
    def advisories(cls, d: DilocoSettings) -> Iterator[tuple[str, str]]:
        yield "diloco.overlap", ("delayed is the naive one-round delay, the baseline overlap is measured against: the "
                                 "eager paper measured it 12.7% above blocking DiLoCo in loss (arXiv 2502.12996, "
                                 "Table 2, 500M, H = 30); prefer diloco.overlap = streaming for a run")


MODES: dict[str, type[Mode]] = {m.name: m for m in (Blocking, Eager, Streaming, Delayed)}


def mode_of(name: str) -> type[Mode]:
    """The mode a diloco.overlap value names (the config's choices are MODES' names)."""
    return MODES[name]


def unused_fragment_keys(mode: type[Mode], d: DilocoSettings, defaults: DilocoSettings) -> Iterator[tuple[str, str]]:
    """The fragment_* keys set away from their defaults under a mode without fragments."""
    if mode.fragmented:
        return
    for key in _FRAGMENT_KEYS:
        if getattr(d, key) != getattr(defaults, key):
            yield f"diloco.{key}", f"has no effect with diloco.overlap = {mode.name} (streaming only)"
