"""A hostile DiLoCo node for the benchmarks, the chaos harness and the insider tests (never part of zb itself):
`zb train` patched to send or claim what an honest node would not.

    python scripts/_hostile_node.py MODE train ...   (the rest as for `python -m zb`)

MODE:
  FACTOR     a number: the pseudo-gradient is multiplied by it before it is sent, and its norm stated as it is
             (x1000: an outsized update that diloco.clip scales down; -1: a sign flip)
  quiet:F    sends F x its pseudo-gradient while stating its honest norm (the sender clips itself: issue 40)
  nan        sends NaN while stating a small finite norm
  ahead      states an outer step 1000 past its own at every check-in (it wants to be the donor)
"""

from __future__ import annotations

import math
import sys

from zb.diloco import checkin
from zb.diloco.outer import OuterState
from zb.diloco.outer_step import OuterSteps


def scale_sent(factor: float) -> None:
    honest = OuterState.pseudo_gradient_of

    def hostile(self: OuterState, index: int):
        return honest(self, index).mul_(factor)

    OuterState.pseudo_gradient_of = hostile   # type: ignore[method-assign]


def state_norm(norm_of) -> None:
    """The norm this node states at the check-in: `norm_of(the norm of what it sends)`."""
    honest = OuterSteps._norm

    def stated(self: OuterSteps) -> float:
        return norm_of(honest(self))

    OuterSteps._norm = stated   # type: ignore[method-assign]


def claim_ahead(by: int) -> None:
    honest = checkin.check_in

    def ahead(*args, outer_step: int, **kwargs):
        return honest(*args, outer_step=outer_step + by, **kwargs)

    checkin.check_in = ahead   # type: ignore[assignment]


def main() -> None:
    mode = sys.argv.pop(1)
    if mode == "ahead":
        claim_ahead(1000)
    elif mode == "nan":
        scale_sent(math.nan)
        state_norm(lambda _: 0.01)
    elif mode.startswith("quiet:"):
        factor = float(mode.split(":", 1)[1])
        scale_sent(factor)
        state_norm(lambda sent: sent / factor)
    else:
        scale_sent(float(mode))
    from zb.cli import main as zb_main

    zb_main()


if __name__ == "__main__":
    main()
