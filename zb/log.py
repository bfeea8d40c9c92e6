"""stdlib logging for training processes: one fixed-field line per event, prefixed with node and rank.

The level comes from -v/-q, else ZERO_BAND_LOG_LEVEL (Prime's name), else INFO.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname).1s [%(zb_node)s r%(zb_rank)s] %(name)s: %(message)s"


class _IdentityFilter(logging.Filter):
    """Stamps every record with the node id and local rank so multi-process logs can be merged."""

    node = os.environ.get("GLOBAL_UNIQUE_ID", "-")

    def filter(self, record: logging.LogRecord) -> bool:
        record.zb_node = self.node
        record.zb_rank = os.environ.get("LOCAL_RANK", "0")
        return True


def set_node_id(node_id: str) -> None:
    """Called once the node's unique id is known (it may be generated after logging starts)."""
    _IdentityFilter.node = node_id


def _level_from_env() -> int:
    value = os.environ.get("ZERO_BAND_LOG_LEVEL", "").strip().upper()
    if value in ("DEBUG", "TRUE", "1"):
        return logging.DEBUG
    if value in ("INFO", "WARNING", "ERROR", "CRITICAL"):
        return getattr(logging, value)
    return logging.INFO


def setup_logging(verbosity: int = 0) -> None:
    """verbosity: 0 = INFO (or ZERO_BAND_LOG_LEVEL), >0 = DEBUG, <0 = WARNING."""
    level = logging.DEBUG if verbosity > 0 else logging.WARNING if verbosity < 0 else _level_from_env()
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


def quiet_follower_ranks(local_rank: int) -> None:
    """Local ranks other than 0 log warnings and errors only, unless ZB_LOG_ALL_RANKS (or Prime's
    ZERO_BAND_LOG_ALL_RANK) is true: a node's ranks train in lockstep, so one rank's info lines tell
    the node's story."""
    wanted = os.environ.get("ZB_LOG_ALL_RANKS") or os.environ.get("ZERO_BAND_LOG_ALL_RANK") or ""
    if local_rank != 0 and wanted.strip().lower() not in ("1", "true", "yes"):
        logging.getLogger("zb").setLevel(max(logging.WARNING, logging.getLogger("zb").level))
