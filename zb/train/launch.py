"""`zb train --nproc-per-node N`: start N local ranks through torch's own launcher (torchrun).

Equivalent to `torchrun --standalone --nproc_per_node N -m zb train <same args>`; the launcher
supervises the ranks, so a rank that dies takes the node down instead of leaving orphans. Unlike bare
torchrun, a Ctrl-C ends with the ranks' own clean stop and exit code 130 (143 for SIGTERM): no
traceback, no launcher warnings, and the ranks get the time their final checkpoint is allowed.
"""

from __future__ import annotations

import logging
import math
import sys

from zb.errors import EnvironmentFailure

# torch's launcher modules that log a warning per rank when they pass a death signal on.
_LAUNCHER_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")
# What a rank may need after the signal besides its final checkpoint: the step (or outer step) under
# way. Past grace period + this, the launcher SIGKILLs the ranks (torch's own default is 30 s in all).
STOP_MARGIN_S = 60


class _QuietSignalShutdown(logging.Filter):
    """Drops torch's "Received SIGINT death signal, shutting down workers" and the "Sending process
    N closing signal" lines that follow it: a Ctrl-C reaches the ranks from the terminal too, and each
    rank already says it stops; the launcher's lines only repeated that with torch's log format.
    Closing lines after a failed rank (no signal received) stay."""

    def __init__(self) -> None:
        super().__init__()
        self.signalled = False

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        if msg.startswith("Received %s death signal"):
            self.signalled = True
            return False
        return not (self.signalled and msg.startswith("Sending process %s closing signal"))


def _strip_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out


def launch_local_ranks(nproc: int, argv: list[str] | None = None, grace_period_s: float = 30.0) -> None:
    """`grace_period_s`: ckpt.grace_period, what each rank may spend on its final checkpoint after a
    signal; the launcher waits that plus STOP_MARGIN_S before it SIGKILLs a rank."""
    import os

    from torch.distributed.run import get_args_parser, run

    from zb.log import level_for_children

    argv = list(sys.argv[1:] if argv is None else argv)
    level = level_for_children()
    if level is not None:
        os.environ["ZB_LOG_LEVEL"] = level  # -v/-q reach the ranks as log.level
    rest = _strip_nproc(argv[argv.index("train") + 1:] if "train" in argv else argv)
    parser = get_args_parser()
    launcher = ["--standalone", "--nproc-per-node", str(nproc)]
    # Newer torch has the option; older launchers keep their 30 s.
    if any("--shutdown-timeout" in action.option_strings for action in parser._actions):
        launcher += ["--shutdown-timeout", str(math.ceil(grace_period_s) + STOP_MARGIN_S)]
    args = parser.parse_args([*launcher, "-m", "zb", "train", *rest])
    quiet = _QuietSignalShutdown()
    for name in _LAUNCHER_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        run(args)
    except SignalException as e:
        # Ctrl-C reached the launcher too; the ranks have stopped cleanly (or been stopped by it).
        sys.exit(128 + int(e.sigval))
    except ChildFailedError as e:
        # The rank's own one-line error is already on stderr; keep its exit code (2 = invalid input).
        codes = [f.exitcode for f in e.failures.values() if f.exitcode and f.exitcode > 0]
        sys.exit(max(codes) if codes else 1)
    except Exception as e:
        raise EnvironmentFailure(f"could not launch {nproc} local ranks: {e}") from None
