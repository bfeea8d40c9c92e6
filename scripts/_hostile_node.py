"""A hostile DiLoCo node for the benchmarks and the chaos harness (never part of zb itself): `zb train` whose
pseudo-gradient is multiplied by FACTOR before it is sent (x1000: an outsized update; -1: a sign flip).

    python scripts/_hostile_node.py FACTOR train ...   (the rest as for `python -m zb`)
"""

from __future__ import annotations

import sys

from zb.diloco.outer import OuterState


def main() -> None:
    factor = float(sys.argv.pop(1))
    honest = OuterState.pseudo_gradient_of

    def hostile(self: OuterState, index: int):
        return honest(self, index).mul_(factor)

    OuterState.pseudo_gradient_of = hostile   # type: ignore[method-assign]
    from zb.cli import main as zb_main

    zb_main()


if __name__ == "__main__":
    main()
