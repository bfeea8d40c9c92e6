"""Metric backends beside metrics.jsonl: Weights & Biases and TensorBoard (`log.backends`).

    backends = open_backends(cfg, node="node-a")     # [] unless log.backends names wandb or tensorboard
    MetricsSink(cfg.log.dir, node, backends=backends, jsonl="jsonl" in ...)  # every event reaches each

Only each node's local rank 0 opens them (the caller decides). The packages are imported here, lazily:
a backend whose package is missing stops the run at start with one line naming the extra to install
(exit 1). A backend that fails later is dropped with one warning; training never stops for a chart.
Each backend gets the same numeric scalars (zb.monitor.scalars), named as Prime logged them.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Protocol

from zb.config import KEYS, source_of, to_dict
from zb.config_schema import Config
from zb.errors import missing_extra

log = logging.getLogger("zb.metrics")

EXTRA = "monitor"
PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard"}  # backend -> the package it needs


class Backend(Protocol):
    name: str

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def backend_names(cfg: Config) -> list[str]:
    return cfg.log.backends.split(",")


def check_backends(cfg: Config) -> None:
    """Raise EnvironmentFailure naming the extra when a backend's package is not installed (cheap: no import)."""
    for name in backend_names(cfg):
        if name in PACKAGES and importlib.util.find_spec(PACKAGES[name]) is None:
            raise missing_extra(f"log.backends = {cfg.log.backends!r}", PACKAGES[name], EXTRA)


def open_backends(cfg: Config, *, node: str) -> list[Backend]:
    """The backends log.backends names besides jsonl, opened (a missing package: EnvironmentFailure)."""
    names = [n for n in backend_names(cfg) if n != "jsonl"]
    _warn_idle_wandb_settings(cfg, names)
    check_backends(cfg)
    opened: list[Backend] = []
    try:
        for name in names:
            opened.append(_open(name, cfg, node))
    except BaseException:
        for backend in opened:
            backend.close()
        raise
    return opened


def _open(name: str, cfg: Config, node: str) -> Backend:
    if name == "wandb":
        from zb.monitor.wandb_backend import WandbBackend

        return WandbBackend(cfg.log, node=node, diloco=cfg.diloco is not None, run_config=to_dict(cfg))
    from zb.monitor.tensorboard_backend import TensorboardBackend

    return TensorboardBackend(cfg.log.dir)


def _warn_idle_wandb_settings(cfg: Config, names: list[str]) -> None:
    """log.wandb_* without the wandb backend would be ignored: say so instead."""
    if "wandb" in names:
        return
    given = [k for k in KEYS if k.startswith("log.wandb_") and source_of(cfg, k) not in ("default", "Prime's default")]
    if given:
        log.warning("settings without effect (%s): log.backends = %r does not include wandb; add it to log to "
                    "Weights & Biases", ", ".join(given), cfg.log.backends)
