"""Expected failures, each with the exit code DESIGN.md promises.

A library function raises one of these with a message that says what went wrong and what to do;
the CLI prints that one line and exits with the code. Anything else is a bug and gets a traceback.
"""

from __future__ import annotations

import shutil
from pathlib import Path


class ZbError(Exception):
    """Base class of expected failures; `exit_code` is what the CLI exits with."""

    exit_code = 1


class InvalidInput(ZbError):
    """The invocation is invalid: usage, config, values, missing or incompatible input files."""

    exit_code = 2


class EnvironmentFailure(ZbError):
    """The environment failed the command: port in use, store or peers unreachable, disk full."""

    exit_code = 1


class RunFinishedWithout(EnvironmentFailure):
    """The run this node belongs to reached its end in a later world than the node's (it was cut off or
    stopped meanwhile): the node stops, and writes no final model of its own."""


class LeavingRun(ZbError):
    """This node already said goodbye (its deathrattle is in the store, after SIGTERM/SIGINT), so it
    takes no further part in the run: the caller stops as it would on the signal."""

    exit_code = 1


def free_space(path: str | Path | None) -> str:
    """'N MB free' (or kB, GB) on the disk that holds `path` (or its nearest existing ancestor): what a
    message about a full disk tells, so that the user sees how far from enough it is."""
    probe = Path(path) if path is not None else Path(".")
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return "free space unknown"
    unit, scale = next((u, s) for u, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("bytes", 1)) if free >= s or s == 1)
    return f"{free / scale:,.1f} {unit} free" if scale > 1 else f"{free} bytes free"


def missing_extra(feature: str, package: str, extra: str) -> EnvironmentFailure:
    """The error for an optional package that is not installed: names the extra that brings it."""
    return EnvironmentFailure(f"{feature} needs {package}, which is not installed: pip install 'zb[{extra}]'")


# What zb's exit codes mean (docs/reference.md is generated from this): the codes of the errors above,
# plus success and a stop on a signal.
EXIT_CODES: tuple[tuple[str, str], ...] = (
    ("0", "Success."),
    (str(EnvironmentFailure.exit_code), "The environment failed the command (port in use, store or peers "
                                        "unreachable, disk full, a missing optional package; zb ckpt verify: a "
                                        "damaged or missing part): one line says what. Also a bug, with a traceback."),
    (str(InvalidInput.exit_code), "The invocation is invalid: usage, config, values, missing or incompatible "
                                  "input files; also a node the run refused (settings that differ from the "
                                  "run's) or evicted."),
    ("130", "Interrupted by SIGINT (Ctrl-C), at any moment of any command: one line says so and what the stop "
            "left (`error: interrupted by SIGINT before training started: no step was taken and no checkpoint "
            "written`); temporary files are removed on the way out and no thread holds the exit. zb train in its loop "
            "stops cleanly after the current step instead, with a final checkpoint (within ckpt.grace_period) when "
            "it writes checkpoints. A second signal during a stop's cleanup leaves at once. zb store, zb status "
            "--watch or --serve and zb ckpt-serve run until a signal: for them it is the normal end, exit 0 "
            "with its line."),
    ("143", "Stopped by SIGTERM, as by SIGINT: a stop on a signal exits 128 + its number."),
)
