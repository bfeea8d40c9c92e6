"""`zb train`'s body: set up, loop over steps, sync with other nodes, evaluate, log, stop cleanly.

Run: `zb train` (built-in default), `zb train @configs/debug/normal.toml`,
`torchrun --nproc_per_node 2 -m zb train @configs/debug/normal.toml`, or, across nodes,
`scripts/simulate_multi_node_diloco.sh 2 1 @configs/debug/diloco.toml`.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import TYPE_CHECKING

from zb import stop_signals
from zb.config import non_default_settings, to_dict
from zb.config_schema import Config
from zb.elastic.listener_guard import only_this_host
from zb.errors import InvalidInput, LeavingRun
from zb.events import Refused, emit
from zb.fingerprint import fingerprint
from zb.local_world import LocalWorld, local_world
from zb.overlap_modes import mode_of
from zb.status.publisher import publish_status
from zb.train.checkpointing import RunCheckpoints
from zb.train.device import (
    Placement,
    close_local_group,
    control_group,
    control_timeout_s,
    init_control_group,
    init_local_group,
)
from zb.train.ledger import Ledger, emit_run_start, perplexity
from zb.train.lr_schedule import build_optimizer, build_scheduler
from zb.train.progress import StepClock, TrainingDisplay
from zb.train.setup import build_loaders, build_model, check_batch, node_identity, open_metrics, preflight
from zb.train.signals import Ended, StopRequest
from zb.train.step import StepResult, Trainer, take

if TYPE_CHECKING:
    from zb.ckpt.durable.state import TrainState
    from zb.diloco.node import DilocoNode
    from zb.events import OuterReport

log = logging.getLogger("zb.train")

SPIKE_FACTOR = 2.0  # a step loss this many times the running mean is logged as a spike
# What a signal during setup (model, data, store) leaves: the CLI's line ends with it.
BEFORE_TRAINING = "before training started: no step was taken and no checkpoint written"


def run(cfg: Config) -> Ended:
    from zb.log import apply_log_config

    local = local_world()
    apply_log_config(cfg.log.level, cfg.log.all_ranks, local.rank)
    if log.isEnabledFor(logging.DEBUG):
        for key, value, source in non_default_settings(cfg):
            log.debug("setting %s = %r (%s)", key, value, source)
    with stop_signals.when(BEFORE_TRAINING):
        placement = preflight(cfg, local)
        with only_this_host(cfg.elastic.peer_filter):
            init_local_group(local, placement)
    try:
        with stop_signals.when(BEFORE_TRAINING):   # the loop's own stop takes over in execute()
            training = TrainingRun(cfg, local, placement)
        return training.execute()
    finally:
        close_local_group()


def _warn_unused(cfg: Config, local: LocalWorld, prefix: str, why: str) -> None:
    """Say so when settings were given that cannot have an effect, instead of ignoring them."""
    from zb.config import KEYS, source_of

    # The node id also names this node's checkpoint directories (RAM, remote): never without effect.
    given = [k for k in KEYS if k.startswith(prefix) and k != "elastic.unique_id" and source_of(cfg, k) != "default"]
    if given and local.is_head:
        log.warning("settings without effect (%s): %s", ", ".join(given), why)


class TrainingRun:
    """One node's training run from start to end: builds the model, optimizer and data, joins the
    other nodes (DiLoCo), resumes, loops over steps with outer steps, evaluations and checkpoints,
    and stops cleanly on a signal. Its ledger (zb.train.ledger) holds the run position and writes the
    step, eval and outer_step events."""

    def __init__(self, cfg: Config, local: LocalWorld, placement: Placement):
        from zb.log import set_uid

        self.cfg, self.local, self.placement = cfg, local, placement
        self.accum = check_batch(cfg, local)
        cfg.elastic.unique_id = node_identity(cfg, local)
        set_uid(cfg.elastic.unique_id)
        self.sink = open_metrics(cfg, node=cfg.elastic.unique_id, is_head=local.is_head)
        # DiLoCo nodes also publish a status record for `zb status` (a thread; never blocks a step).
        self.sink = publish_status(self.sink, cfg, is_head=local.is_head)
        try:
            self._build(cfg, local, placement, cfg.elastic.unique_id)
        except BaseException:
            self.sink.close()   # a failure or a signal during setup: backends flushed, the status record "left"
            raise

    def _build(self, cfg: Config, local: LocalWorld, placement: Placement, uid: str) -> None:
        from zb.data import build_tokenizer

        self.tokenizer = build_tokenizer(cfg.data.tokenizer, retries=cfg.data.retries)
        self.model = build_model(cfg, self.tokenizer.vocab_size, placement)
        from zb.models import count_params

        with only_this_host(cfg.elastic.peer_filter):
            init_control_group(control_timeout_s(cfg, count_params(self.model)))
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim)
        self.trainer = Trainer(self.model, self.optimizer, self.scheduler, placement, cfg.optim.grad_clip,
                               cfg.optim.z_loss_weight if cfg.optim.z_loss else 0.0, cfg.train.reduce_every_micro_batch,
                               num_chunks=cfg.optim.num_chunks, fused_linear_ce=cfg.train.fused_linear_ce)
        self.started = time.perf_counter()
        self.stop_signal: int | None = None  # set when a signal stopped the run early (exit code 128 + it)
        self.total = cfg.train.max_steps or cfg.optim.total_steps
        self.tokens_per_step = cfg.optim.batch_size * cfg.data.seq_length
        self.diloco: DilocoNode | None = None
        self.data_slot: tuple[int, int] | None = None   # (data rank, data world size), once known: checkpoints keep it
        self.fingerprint = fingerprint(cfg, local.world_size, self.model.tok_embeddings.num_embeddings)
        emit_run_start(self.sink, cfg, local_world_size=local.world_size, device=placement.device.type)
        self.checkpoints = RunCheckpoints(cfg, uid=uid, local_rank=local.rank,
                                          local_world_size=local.world_size, is_head=local.is_head, sink=self.sink,
                                          local_group=control_group(), state_of=self.checkpoint_state)
        self.stop = StopRequest()
        self.step_clock = StepClock()
        self._loss_mean: float | None = None
        # diloco.round_seconds: rounds end by time, at other steps on every node; the run's position after each
        # comes from the check-in.
        self.adaptive = cfg.diloco is not None and cfg.diloco.round_seconds is not None
        self._init_mfu()
        self.ledger = Ledger(self.sink, self.scheduler, tokens_per_step=self.tokens_per_step, mfu=self._mfu)

    def _init_mfu(self) -> None:
        from zb.models.flops import flops_per_token
        from zb.train.mfu import peak_flops

        self.flops_per_token = flops_per_token(self.model.args, self.cfg.data.seq_length)
        self.peak_flops, why = peak_flops(self.placement.device, self.cfg.train.peak_tflops)
        if self.local.is_head:
            log.info("mfu: %.3g FLOPs per token (6 N + 12 L H Q T); %s", self.flops_per_token,
                     f"peak {self.peak_flops / 1e12:g} TFLOPS per device ({why})" if self.peak_flops else why)

    def _mfu(self, tokens_per_s: float) -> float | None:
        from zb.train.mfu import mfu_percent

        mfu = mfu_percent(self.flops_per_token, tokens_per_s, self.peak_flops, self.local.world_size)
        return None if mfu is None else round(mfu, 3)

    # -- lifecycle ---------------------------------------------------------------------------
    def execute(self) -> Ended:
        self.stop.install()  # before the mesh: its deathrattle chains to this handler
        try:
            if self.cfg.eval.only:
                self._evaluate_only()
                return self._ended()
            try:
                data_rank, data_world = self._join_nodes()
            except LeavingRun:  # a signal arrived while this node was joining
                self._stopped()
                return self._ended()
            except InvalidInput as e:   # the run refused this node (settings that differ from the run's)
                emit(self.sink, Refused(reason=str(e)))
                raise
            self.data_slot = (data_rank, data_world)
            self.train_loader, self.eval_loader = build_loaders(self.cfg, self.tokenizer, self.local, data_rank,
                                                                data_world)
            self._restore_data_position()
            self._resume()
            if self.local.is_head and self.sink.path is not None:
                log.info("metrics: %s", self.sink.path)
            self.ledger.start_round()
            # A joiner takes part in the current outer step at once (the state arrives at its end).
            if self.diloco is None or not self.diloco.joining or self._outer_step():
                with TrainingDisplay(self.total, self.ledger.position.step, self.cfg.log.progress,
                                     enabled=self.local.is_head) as display:
                    self._loop(display)
            self._final_eval()
            self.checkpoints.final(self.ledger.position.step)
            if self.diloco is not None and self.local.is_head and self.stop_signal is None and \
                    self.ledger.position.step >= self.total:
                self.diloco.finished(self.ledger.position)   # `zb status` and late nodes see it (bounded waits)
        finally:
            if hasattr(getattr(self, "train_loader", None), "close"):
                self.train_loader.close()  # the prefetch thread
            self.checkpoints.close()
            if self.diloco is not None:
                # Normal end, error or signal: the deathrattle lets peers drop this node at once.
                self.diloco.shutdown(graceful=True)
            self.stop.restore()
            self.sink.close()
        return self._ended()

    def _ended(self) -> Ended:
        return Ended(self.stop_signal, self.ledger.position.step)

    def _evaluate_only(self) -> None:
        """eval.only: the model of the checkpoint ckpt.resume names, on the held-out data of the node's data slot;
        nothing else, and nothing written but this run's own metrics (zb.train.eval_only)."""
        from zb.train.eval_only import data_slot, read_checkpoint

        cfg = self.cfg
        loaded = read_checkpoint(cfg, self.model, self.fingerprint, local_rank=self.local.rank,
                                 local_world_size=self.local.world_size, group=control_group())
        if loaded is None:
            raise InvalidInput(f"eval.only: ckpt.resume = '{cfg.ckpt.resume}' found no complete checkpoint under "
                               f"{cfg.ckpt.path}; see `zb ckpt ls {cfg.ckpt.path}`")
        self.data_slot = data_slot(cfg, loaded)
        self.train_loader, self.eval_loader = build_loaders(cfg, self.tokenizer, self.local, *self.data_slot)
        self.ledger.move_to(loaded.position, own_tokens=True)
        if self.local.is_head:
            log.info("eval.only: the checkpoint's model params (this node's, as the run evaluated them) on data slot "
                     "%d of %d; its optimizer and DiLoCo outer state are not read (zb generate --params outer and "
                     "zb export read the outer params)", *self.data_slot)
        loss = self._evaluate()
        log.info("eval.only: checkpoint %s (step %d): held-out loss %.4f, perplexity %.4g over %d micro batches "
                 "per rank", loaded.path, self.ledger.position.step, loss, perplexity(loss), cfg.eval.batches)

    def _join_nodes(self) -> tuple[int, int]:
        """With DiLoCo: join the elastic world and claim a data slot. Without: the configured shard."""
        cfg = self.cfg
        if cfg.diloco is None:
            _warn_unused(cfg, self.local, "elastic.", "without DiLoCo this node trains alone; add a [diloco] table to join a run")
            return (cfg.data.data_rank or 0), (cfg.data.data_world_size or 1)
        from zb.diloco.node import DilocoNode

        if self.local.is_head:   # the store may not answer yet: say what this node waits for
            log.info("joining the DiLoCo run at %s (up to elastic.connect_timeout, %g s, for the store to answer)",
                     cfg.elastic.addr or f"this node's own store (port {cfg.elastic.port})", cfg.elastic.connect_timeout)
        self.diloco = DilocoNode(cfg, self.model, self.optimizer, self.local, self.sink, self.fingerprint,
                                 local_group=control_group())
        slot = self.diloco.start()
        view = self.diloco.mesh.view
        assert view is not None  # start() took the world
        self.ledger.nodes = view.global_world_size
        if self.diloco.recovered_position is not None:
            self.ledger.move_to(self.diloco.recovered_position)
        return slot, self.diloco.num_slots

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint_state(self) -> TrainState:
        """What a checkpoint holds, and what a resume fills in place."""
        from zb.ckpt.durable.state import TrainState
        from zb.train.fsdp import unsharded_params

        gathered = unsharded_params(self.model)
        if gathered:  # a bug: something ran a forward and did not reshard (see zb.train.fsdp.reshard)
            raise RuntimeError(f"refusing to checkpoint a sharded model whose params are gathered: {gathered[:3]}")
        return TrainState(self.model, self.optimizer, self.scheduler, self.ledger.position,
                          data_state=self.train_loader.state_dict(),
                          outer=self.diloco.checkpoint_tensors() if self.diloco is not None else None,
                          config=to_dict(self.cfg), fingerprint=self.fingerprint,
                          data_exact=self.train_loader.exact_resume, data_slot=self.data_slot)

    def _resume(self) -> None:
        diloco = self.diloco
        # The nodes that start together share the world they were admitted to: its version names this start.
        scope = ""
        if diloco is not None:
            view = diloco.mesh.view
            assert view is not None  # _join started the node: it has a world
            scope = f"v{view.mesh_version}"
        loaded = self.checkpoints.resume(store=diloco.store if diloco is not None else None,
                                         scope=scope,
                                         joining=diloco is not None and diloco.joining)
        if loaded is None:
            return
        self.ledger.move_to(loaded.position, own_tokens=True)
        if self.cfg.ckpt.skip_dataloader:
            log.info("ckpt.skip_dataloader: the data starts from the beginning of this node's shard")
        elif loaded.data_state is not None:   # None: written by another local rank count (said when resharded)
            self.train_loader.load_state_dict(loaded.data_state)
        if diloco is not None and loaded.outer:
            diloco.load_checkpoint_tensors(loaded.outer)
        log.info("resumed from %s at step %d (outer step %d)", loaded.path, self.ledger.position.step,
                 self.ledger.position.outer_step)

    def _restore_data_position(self) -> None:
        position = self.diloco.data_position() if self.diloco is not None else None
        if position is not None:
            self.train_loader.load_state_dict(position)
            log.info("data slot continues where its previous holder stopped")

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self, display: TrainingDisplay) -> None:
        cfg, ledger, stop = self.cfg, self.ledger, self.stop
        debug = log.isEnabledFor(logging.DEBUG)
        if self.diloco is not None:
            self.diloco.begin_rounds(ledger.position)
        while ledger.position.step < self.total:
            t0 = time.perf_counter()
            batches = take(self.train_loader, self.accum)
            t_data = time.perf_counter() - t0
            result = self.trainer.train_step(batches, stop_requested=lambda: stop.requested)
            dt = time.perf_counter() - t0
            self.step_clock.add(dt)
            if debug:
                # Where a step's time goes: waiting for data vs computing (forward, backward, optimizer).
                log.debug("step %d: data %.4f s, compute %.4f s, loss %.4f, grad %.3f, lr %.3e",
                          ledger.position.step + 1, t_data, dt - t_data, result.loss, result.grad_norm, result.lr)
            step = ledger.inner_step().step
            self._watch_loss(result)
            if step % cfg.train.log_interval == 0 or step == self.total:
                self._log_step(result, dt)
            display.update(step, result.loss, self.tokens_per_step / dt)
            # A stopping node skips the outer step: its deathrattle went out with the signal, so the
            # others no longer count on it.
            round_start, outer_done = ledger.round_start, False
            if self.diloco is not None and not result.stop:
                launch, apply = self.diloco.sync_points(step)
                if launch is not None:
                    self.diloco.launch_fragment(launch)  # streaming: the all-reduce runs behind the next steps
                if apply is not None:
                    if not self._outer_step():
                        break
                    outer_done = True
            if self.adaptive:
                # Nodes stand at one step only right after an outer step: checkpoints are taken there.
                saved = outer_done and self.checkpoints.maybe_save_crossing(round_start.step, ledger.position.step)
            else:
                saved = self.checkpoints.maybe_save(ledger.position.step)
            if saved or not self.checkpoints.periodic:
                # The newest position a restart can resume from: streamed files behind it may be evicted.
                self.train_loader.release(self.train_loader.state_dict())
            if cfg.eval.interval > 0 and ledger.position.step < self.total and \
                    self._eval_due(round_start.step, outer_done):
                self._evaluate()
            if result.stop:
                self._stopped()
                break
        if self.diloco is not None and ledger.position.step == cfg.optim.total_steps:
            self._close_overlap()

    def _eval_due(self, round_start: int, outer_done: bool) -> bool:
        """Every eval.interval steps; with diloco.round_seconds right after the outer step that reached or passed
        a multiple (mid-round the nodes stand at different steps; after it, every node holds the run's params)."""
        step, interval = self.ledger.position.step, self.cfg.eval.interval
        if self.adaptive:
            return outer_done and step // interval > round_start // interval
        return step % interval == 0

    def _stopped(self) -> None:
        # Another local rank may have received the signal: report SIGINT then.
        self.stop_signal = self.stop.signum or signal.SIGINT
        log.warning("stopped at step %d on request", self.ledger.position.step)

    def _watch_loss(self, result: StepResult) -> None:
        if self._loss_mean is not None and result.loss > SPIKE_FACTOR * self._loss_mean:
            log.warning("loss spike at step %d: %.4f against a running mean of %.4f", self.ledger.position.step,
                        result.loss, self._loss_mean)
        self._loss_mean = result.loss if self._loss_mean is None else 0.9 * self._loss_mean + 0.1 * result.loss

    def _outer_step(self) -> bool:
        """One outer step; False when the node turned out to be leaving (a signal arrived after the
        step's local stop vote, and its deathrattle already told the others)."""
        assert self.diloco is not None  # outer steps happen only with DiLoCo
        try:
            report, received = self.diloco.outer_step(self.ledger.position, self.train_loader.state_dict())
        except LeavingRun:
            self._stopped()
            return False
        self.ledger.outer_step(report, received=received)
        self._log_outer(report, " | joined: state received" if received is not None else "")
        return True

    def _close_overlap(self) -> None:
        """diloco.overlap: the last average is still in flight; every node applies it and ends on the
        shared params (see DilocoNode.close_run)."""
        assert self.diloco is not None  # only with DiLoCo
        try:
            report = self.diloco.close_run(self.ledger.position)
        except LeavingRun:
            self._stopped()
            return
        if report is not None:
            self.ledger.outer_step(report, closing=True)
            self._log_outer(report, " | run end: last average applied, model = shared params")

    def _log_outer(self, report: OuterReport, note: str) -> None:
        """The outer step's log line (its event went out from the ledger)."""
        note = note or report.note or ("" if report.applied else " | NOT applied")
        assert self.cfg.diloco is not None  # outer steps happen only with DiLoCo
        hidden = f" ({report.hidden_s:.2f} s hidden, {report.stall_s:.2f} s stalled)" \
            if mode_of(self.cfg.diloco.overlap).in_flight else ""
        if report.fragment is not None:
            note = f" | fragment {report.fragment}{note}"
        if report.round_steps is not None:
            steps = ", ".join(str(n) for n in report.round_steps.values())
            note = f" | round steps {steps} (weight {report.round_weight:.3f}){note}"
        # What the boundary cost besides waiting for the transfer: the roll call, the check-in (waiting for the
        # slowest node included), applying, hand-overs and the store writes after the step.
        control = max(0.0, report.boundary_s - report.stall_s)
        log.info("outer step %d | nodes %d (%d contributing) | mesh v%d | all-reduce %.2f s%s, %s bytes, %.1f Mbit/s | "
                 "control %.2f s (roll call %.2f, check-in %.2f)%s",
                 self.ledger.position.outer_step, report.global_world_size, report.num_peers, report.mesh_version,
                 report.allreduce_s, hidden, f"{report.wire_bytes:,}", report.wire_mbps, control, report.resolve_s,
                 report.checkin_s, note)

    def _log_step(self, result: StepResult, dt: float) -> None:
        record = self.ledger.step(loss=result.loss, lr=result.lr, grad_norm=result.grad_norm, z_loss=result.z_loss,
                                  seconds=dt)
        log.info(self.ledger.step_line(record, self.total, seconds=dt,
                                       eta_s=self.step_clock.eta(self.total - record.step)))

    def _evaluate(self) -> float:
        loss = self.trainer.evaluate(self.eval_loader(), self.cfg.eval.batches)
        log.info("eval step %d | held-out loss %.4f", self.ledger.position.step, loss)
        self.ledger.eval(loss)
        return loss

    def _final_eval(self) -> None:
        position = self.ledger.position
        # A run stopped by a signal leaves promptly: launchers kill what lingers.
        if self.cfg.eval.interval >= 0 and position.step > 0 and self.stop_signal is None:
            self._evaluate()
        log.info("done: %d steps, %s tokens in %.1f s", position.step, f"{position.tokens:,}",
                 time.perf_counter() - self.started)
