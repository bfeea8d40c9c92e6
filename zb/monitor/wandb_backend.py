"""Weights & Biases (log.backends = wandb), with Prime's settings: project, run name, run id, resume.

Each node's local rank 0 logs its own wandb run (named after the node unless log.wandb_name says
otherwise; log.wandb_group gathers a run's nodes). Scalars carry the training step as `step`, the
x-axis of every chart (wandb's own row counter would count events, not steps). With
log.wandb_mode = offline (or WANDB_MODE=offline) nothing touches the network: the run is written
under <log.dir>/wandb and `wandb sync` uploads it later.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from zb.config_schema import LogConfig
from zb.errors import EnvironmentFailure
from zb.monitor.scalars import scalars

log = logging.getLogger("zb.metrics")


def init_arguments(cfg: LogConfig, *, node: str, diloco: bool) -> dict[str, Any]:
    """wandb.init's arguments for this node (pure: tested without wandb)."""
    run_id = cfg.wandb_id
    if run_id is not None and diloco:
        run_id = f"{run_id}-{node}"  # one wandb run per node: ids must not collide
    args: dict[str, Any] = {"project": cfg.wandb_project, "name": cfg.wandb_name or node, "group": cfg.wandb_group,
                            "id": run_id, "dir": str(Path(cfg.dir))}
    if cfg.wandb_resume:
        # With an id, that run (created if it is new); without, Prime's "auto": this machine's last run.
        args["resume"] = "allow" if run_id is not None else "auto"
    if cfg.wandb_mode != "auto":
        args["mode"] = cfg.wandb_mode
    return args


class WandbBackend:
    name = "wandb"

    def __init__(self, cfg: LogConfig, *, node: str, diloco: bool, run_config: dict[str, Any]):
        import wandb

        args = init_arguments(cfg, node=node, diloco=diloco)
        Path(args["dir"]).mkdir(parents=True, exist_ok=True)
        mode = args.get("mode") or os.environ.get("WANDB_MODE", "online")
        try:
            # console="off": wandb would otherwise wrap stdout/stderr, which zb keeps for its own lines.
            with _logging_errors_unprinted():
                self._run = wandb.init(config=run_config, settings=wandb.Settings(console="off", silent=True),
                                       **args)
            self._run.define_metric("step")
            self._run.define_metric("*", step_metric="step")
        except Exception as e:  # wandb raises many types (CommError, UsageError, ...); none is a zb bug
            hint = "" if mode == "offline" else ("; to log without a network or a wandb login use --log.wandb_mode "
                                                 "offline (upload later with `wandb sync`)")
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
            raise EnvironmentFailure(f"log.backends wandb: could not start a wandb run in {mode} mode "
                                     f"({type(e).__name__}: {first_line}){hint}") from None
        self.dir = Path(self._run.dir).parent
        _quiet_log_files(self.dir)
        self._step = 0

    def write(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        if not values:
            return
        self._step = max(self._step, int(values.get("step", self._step)))
        values.setdefault("step", self._step)
        self._run.log(values)

    def close(self) -> None:
        self._run.finish()


@contextmanager
def _logging_errors_unprinted() -> Iterator[None]:
    """While wandb starts (its log file is not ours to quiet yet): a line it cannot write is dropped
    without logging's traceback (logging.raiseExceptions is logging's own switch for that)."""
    previous, logging.raiseExceptions = logging.raiseExceptions, False
    try:
        yield
    finally:
        logging.raiseExceptions = previous


def _quiet_log_files(where: Path) -> None:
    """wandb logs about itself into a file under <log.dir>/wandb. On a full disk every one of those lines
    would print logging's "--- Logging error ---" and a traceback on stderr: say it once instead (the
    run goes on; what wandb fails to write of the metrics themselves MetricsSink reports)."""
    said: list[bool] = []

    def handle_error(record: logging.LogRecord) -> None:
        if not said:
            said.append(True)
            error = sys.exc_info()[1]
            log.warning("wandb's own log under %s cannot be written (%s): its lines are dropped; training goes on",
                        where, getattr(error, "strerror", None) or error)

    for handler in logging.getLogger("wandb").handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handleError = handle_error  # type: ignore[method-assign]
