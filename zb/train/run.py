"""`zb train`'s body: set up, loop over steps, evaluate, log, stop cleanly.

Run: `zb train` (built-in default), `zb train @configs/debug/normal.toml`, or
`torchrun --nproc_per_node 2 -m zb train @configs/debug/normal.toml`.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field

from zb.config_schema import Config
from zb.metrics import MetricsSink
from zb.train.device import close_local_group, init_local_group, pick_placement
from zb.train.progress import TrainingDisplay, format_step_line
from zb.train.schedule import build_optimizer, build_scheduler
from zb.train.setup import build_loaders, build_model, check_batch, node_identity
from zb.train.signals import StopRequest
from zb.train.step import Trainer, take
from zb.world import LocalWorld, local_world

log = logging.getLogger("zb.train")


@dataclass
class Counters:
    """Step and token counters; `run_*` count every node of the run, the others this node only."""

    step: int = 0
    outer_step: int = 0
    tokens: int = 0
    run_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    stop_signal: int | None = None  # set when a signal stopped the run early (exit code 128 + it)


def run(cfg: Config) -> Counters:
    local = local_world()
    placement = pick_placement(cfg.train, local)
    init_local_group(local, placement)
    try:
        return _train(cfg, local, placement)
    finally:
        close_local_group()


def _train(cfg: Config, local: LocalWorld, placement) -> Counters:
    from zb.data import build_tokenizer
    from zb.log import set_node_id

    accum = check_batch(cfg, local)
    node_id = node_identity(cfg, placement)
    set_node_id(node_id)
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg, tokenizer.vocab_size, placement)
    optimizer = build_optimizer(model, cfg.optim)
    trainer = Trainer(model, optimizer, build_scheduler(optimizer, cfg.optim), placement, cfg.optim.grad_clip,
                      cfg.optim.z_loss_weight if cfg.optim.z_loss else 0.0)
    data_rank = cfg.data.data_rank if cfg.data.data_rank is not None else 0
    data_world = cfg.data.data_world_size if cfg.data.data_world_size is not None else 1
    train_loader, eval_loader = build_loaders(cfg, tokenizer, local, data_rank, data_world)
    sink = MetricsSink(cfg.log.dir, node_id, enabled=local.is_leader)
    if local.is_leader and sink.path is not None:
        log.info("metrics: %s", sink.path)
    total = cfg.train.max_steps or cfg.optim.total_steps
    counters = Counters()
    stop = StopRequest().install()
    try:
        with TrainingDisplay(total, counters.step, cfg.log.progress, enabled=local.is_leader) as display:
            _loop(cfg, trainer, train_loader, eval_loader, accum, total, counters, sink, display, stop)
        _final_eval(cfg, trainer, eval_loader, counters, sink)
    finally:
        stop.restore()
        sink.close()
    return counters


def _loop(cfg, trainer, train_loader, eval_loader, accum, total, counters, sink, display, stop) -> None:
    tokens_per_step = cfg.optim.batch_size * cfg.data.seq_length
    num_nodes = 1
    while counters.step < total:
        t0 = time.perf_counter()
        result = trainer.train_step(take(train_loader, accum), stop_requested=stop.requested)
        dt = time.perf_counter() - t0
        counters.step += 1
        counters.tokens += tokens_per_step
        counters.run_tokens += tokens_per_step * num_nodes
        if counters.step % cfg.train.log_interval == 0 or counters.step == total:
            _log_step(counters, result, tokens_per_step / dt, tokens_per_step * num_nodes / dt, total, sink)
        display.update(counters.step, result.loss, tokens_per_step / dt)
        if cfg.eval.interval > 0 and counters.step % cfg.eval.interval == 0 and counters.step < total:
            _evaluate(cfg, trainer, eval_loader, counters, sink)
        if result.stop:
            # Another local rank may have received the signal: report SIGINT then.
            counters.stop_signal = stop.signum or signal.SIGINT
            log.warning("stopped at step %d on request", counters.step)
            break


def _log_step(counters: Counters, result, tokens_per_s: float, run_tokens_per_s: float, total: int,
              sink: MetricsSink) -> None:
    log.info(format_step_line(counters.step, total, result.loss, result.lr, result.grad_norm, tokens_per_s,
                              run_tokens_per_s, counters.run_tokens))
    sink.log("step", step=counters.step, outer_step=counters.outer_step, loss=result.loss, lr=result.lr,
             grad_norm=result.grad_norm, z_loss=result.z_loss, tokens=counters.tokens,
             tokens_per_s=round(tokens_per_s, 1), run_tokens=counters.run_tokens,
             run_tokens_per_s=round(run_tokens_per_s, 1))


def _evaluate(cfg: Config, trainer: Trainer, eval_loader, counters: Counters, sink: MetricsSink) -> float:
    loss = trainer.evaluate(eval_loader(), cfg.eval.batches)
    log.info("eval step %d | held-out loss %.4f", counters.step, loss)
    sink.log("eval", step=counters.step, outer_step=counters.outer_step, loss=loss)
    return loss


def _final_eval(cfg: Config, trainer: Trainer, eval_loader, counters: Counters, sink: MetricsSink) -> None:
    # A run stopped by a signal leaves promptly: launchers kill what lingers.
    if cfg.eval.interval >= 0 and counters.step > 0 and counters.stop_signal is None:
        _evaluate(cfg, trainer, eval_loader, counters, sink)
    elapsed = time.perf_counter() - counters.started
    log.info("done: %d steps, %s tokens in %.1f s", counters.step, f"{counters.tokens:,}", elapsed)
