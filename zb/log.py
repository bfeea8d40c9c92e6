"""stdlib logging for training processes: one fixed-field line per event, prefixed with node and rank.

The level comes from -v/-q, else log.level (ZB_LOG_LEVEL, Prime's ZERO_BAND_LOG_LEVEL or log_level),
else INFO; the variables are read before the config so that config errors log at that level too.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

_FORMAT = "%(asctime)s %(levelname).1s [%(zb_node)s r%(zb_rank)s] %(name)s: %(message)s"


class _IdentityFilter(logging.Filter):
    """Stamps every record with the node id and local rank so multi-process logs can be merged."""

    node = os.environ.get("GLOBAL_UNIQUE_ID", "-")

    def filter(self, record: logging.LogRecord) -> bool:
        record.zb_node = self.node
        record.zb_rank = os.environ.get("LOCAL_RANK", "0")
        return True


def set_uid(uid: str) -> None:
    """Called once the node's unique id is known (it may be generated after logging starts)."""
    _IdentityFilter.node = uid


_verbosity = 0  # -v/-q as given: they beat log.level


def level_from_env(environ: Mapping[str, str] | None = None) -> int:
    """log.level from its env twins (ZB_LOG_LEVEL wins over Prime's ZERO_BAND_LOG_LEVEL), read by the
    config's own rule so that the two agree on every value: one the config refuses is refused here
    too (InvalidInput, exit 2), for every command, instead of being ignored."""
    environ = os.environ if environ is None else environ
    name = next((n for n in ("ZB_LOG_LEVEL", "ZERO_BAND_LOG_LEVEL") if n in environ), None)
    if name is None:
        return logging.INFO
    from zb.config import parse_value  # only when set: zb.config is not needed for `zb store` otherwise

    return getattr(logging, parse_value("log.level", environ[name], f"env {name}"))


def setup_logging(verbosity: int = 0) -> None:
    """verbosity: 0 = INFO (or ZB_LOG_LEVEL / ZERO_BAND_LOG_LEVEL), >0 = DEBUG, <0 = WARNING."""
    global _verbosity
    _verbosity = verbosity
    level = level_from_env()  # checked even under -v/-q: a wrong value is refused, never ignored
    level = logging.DEBUG if verbosity > 0 else logging.WARNING if verbosity < 0 else level
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(_IdentityFilter())
    root = logging.getLogger("zb")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def retarget_stream(stream) -> None:
    """Point zb's log handler at `stream` (rich swaps sys.stderr while a progress bar is live)."""
    for handler in logging.getLogger("zb").handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(stream)


def level_for_children() -> str | None:
    """The log level -v/-q asked for, as ZB_LOG_LEVEL spells it, for processes started from this one
    (the local ranks torch's launcher starts do not see our command line flags)."""
    return None if _verbosity == 0 else "DEBUG" if _verbosity > 0 else "WARNING"


def apply_log_config(level: str, all_ranks: bool, local_rank: int) -> None:
    """The config's log.level (unless -v/-q was given); local ranks other than 0 log warnings and
    errors only, unless log.all_ranks: a node's ranks train in lockstep, so one rank's info lines
    tell the node's story."""
    root = logging.getLogger("zb")
    if _verbosity == 0:
        root.setLevel(getattr(logging, level))
    if local_rank != 0 and not all_ranks:
        root.setLevel(max(logging.WARNING, root.level))
