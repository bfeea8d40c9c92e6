"""One DiLoCo node across an elastic world: start, outer steps, joiners, guards, leave.

Outer step, as data flows (DESIGN.md):
  1. resolve the world (elastic mesh): admit joiners, drop the dead, rebuild groups if needed;
  2. check in: one tiny all-reduce of "needs state" flags, so every node knows who contributes;
  3. all-reduce SUM the pseudo-gradients (joiners send zeros), divide by the contributors;
  4. the node's local ranks agree that every rank's sync succeeded and was finite; on a failure
     resolve again without the failed peer and recompute (the buffer is undefined afterwards);
  5. outer optimizer step on CPU, copy back into the model shards;
  6. the donor (lowest contributing rank) sends the full state to each joiner.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zb.collectives import PeerFailure
from zb.config_schema import Config
from zb.diloco import slots
from zb.diloco.fingerprint import check_against, encode
from zb.diloco.outer import OuterState, local_shard
from zb.diloco.streams import StreamGroups
from zb.diloco.sync import SyncStats, sync_pseudo_gradient
from zb.diloco.transfer import StateTransfer, ensure_adam_state
from zb.elastic import ElasticDeviceMesh
from zb.elastic import localsync
from zb.elastic.store import connect, read_many, store_errors
from zb.errors import EnvironmentFailure

log = logging.getLogger("zb.diloco")

FINGERPRINT_KEY = "zb/run/fingerprint"


@dataclass
class OuterReport:
    """What one outer step did, for the `outer_step` metrics event."""

    mesh_version: int
    global_world_size: int
    num_peers: int          # nodes that contributed a pseudo-gradient
    allreduce_s: float
    wire_bytes: int
    wire_mbps: float
    applied: bool           # False when skipped (non-finite, or no peer reachable)
    attempts: int
    params_hash: str | None = None


class DilocoNode:
    def __init__(self, cfg: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer, local, sink,
                 fingerprint: dict):
        self.cfg, self.dcfg, self.optimizer, self.local, self.sink = cfg, cfg.diloco, optimizer, local, sink
        self.fingerprint = fingerprint
        self.outer = OuterState(model, cfg.diloco)
        self.local_group = dist.group.WORLD if dist.is_initialized() else None
        self.mesh = ElasticDeviceMesh(cfg.elastic, self.local_group, local_rank=local.rank,
                                      local_world_size=local.world_size, sink=sink if local.is_leader else None)
        self.store = None
        self.streams = StreamGroups(cfg.diloco.streams, local.rank, cfg.elastic.pg_timeout)
        self.slot: int | None = None
        self.needs_state = False
        self._fresh_view = False

    # -- start -------------------------------------------------------------------------------
    def start(self) -> int:
        """Join the run; returns this node's data slot. Refuses (exit 2) a node whose settings differ."""
        self._check_fingerprint_first()
        view = self.mesh.start()
        self.store = self._connect()
        others_were_there = any(uid not in view.joined for uid in view.nodes)
        self.needs_state = view.is_joiner and others_were_there
        self._fresh_view = True
        self.slot = self._claim_slot(view)
        log.info("node %s: global rank %d of %d (mesh v%d), data slot %d%s", view.uid, view.global_rank,
                 view.global_world_size, view.mesh_version, self.slot,
                 ", joining a running run: state comes from a live node" if self.needs_state else "")
        return self.slot

    def _connect(self):
        e = self.cfg.elastic
        return connect(e.addr or "127.0.0.1", e.port, e.connect_timeout, e.store_timeout)

    def _check_fingerprint_first(self) -> None:
        """Before touching the world: the first node publishes, everyone else must match."""
        result = None
        if self.local.is_leader:
            try:
                store = self._connect()
                mine = encode(self.fingerprint)
                published = store.compare_set(FINGERPRINT_KEY, "", mine).decode()
                check_against(self.fingerprint, published)
                result = {"ok": True}
            except Exception as e:  # noqa: BLE001 - told to the other local ranks, then re-raised
                localsync.broadcast_json(self.local_group, 0, {"error": str(e), "code": getattr(e, "exit_code", 1)})
                raise
            localsync.broadcast_json(self.local_group, 0, result)
        else:
            result = localsync.broadcast_json(self.local_group, self.local.rank, None)
            if "error" in result:
                from zb.errors import InvalidInput

                cls = InvalidInput if result.get("code") == 2 else EnvironmentFailure
                raise cls(result["error"])

    def _claim_slot(self, view) -> int:
        payload = None
        if self.local.is_leader:
            num = self.cfg.data.data_world_size or max(self.cfg.elastic.world_size, view.global_world_size)
            pref = self.cfg.data.data_rank if self.cfg.data.data_rank is not None else self.cfg.elastic.rank
            payload = {"slot": slots.claim_slot(self.store, view.uid, view.nodes, num, pref), "num": num}
        payload = localsync.broadcast_json(self.local_group, self.local.rank, payload)
        self.num_slots = payload["num"]
        return payload["slot"]

    def data_position(self) -> dict | None:
        """Where the previous holder of this node's slot stopped (None: start of the shard)."""
        return slots.load_position(self.store, self.slot, self.local.rank)

    # -- outer step ----------------------------------------------------------------------------
    def outer_step(self, counters: list[int], data_state: dict | None) -> tuple[OuterReport, list[int] | None]:
        """Run one outer step; returns its report and, for a joiner, the donor's counters."""
        stats, view, contributors, attempts = None, None, [], 0
        for attempts in range(1, self.dcfg.retry_all_reduce + 2):
            view = self.mesh.view if self._fresh_view else self.mesh.resolve()
            self._fresh_view = False
            try:
                contributors = self._check_in(view)
                stats = self._sync(view, contributors)
                ok = True
            except PeerFailure as e:
                log.warning("outer sync attempt %d failed: %s", attempts, e)
                self.mesh.report_failure(e.rank)
                ok = False
            if localsync.all_ok(self.local_group, ok):
                break
            stats = None
        report = self._apply(view, contributors, stats, attempts)
        received = self._hand_over_state(view, contributors, counters)
        if self.dcfg.drift_guard and report.applied:
            self._check_drift(view)
        self._save_position(data_state)
        return report, received

    def _check_in(self, view) -> list[int]:
        """Ranks that contribute a pseudo-gradient: everyone except nodes waiting for state."""
        flags = torch.zeros(view.global_world_size, dtype=torch.int32)
        flags[view.global_rank] = int(self.needs_state)
        work = self.mesh.global_pg.allreduce([flags])
        try:
            work.wait(_short_deadline(self.cfg))
        except Exception as e:  # noqa: BLE001
            raise PeerFailure(f"check-in all-reduce failed: {str(e).splitlines()[0]}", rank=None) from None
        waiting = flags.tolist()
        return [r for r in range(view.global_world_size) if not waiting[r]]

    def _sync(self, view, contributors: list[int]) -> SyncStats | None:
        if not contributors:
            return None
        streams = self.streams.for_view(view, self.store)
        return sync_pseudo_gradient(self.outer, self.mesh.global_pg, self.dcfg, streams, zeros=self.needs_state,
                                    scale=len(contributors))

    def _apply(self, view, contributors: list[int], stats: SyncStats | None, attempts: int) -> OuterReport:
        applied = False
        if stats is not None and not self.needs_state:
            finite = bool(torch.isfinite(self.outer.flat.grad).all())
            if localsync.all_ok(self.local_group, finite):
                self.outer.step()
                self.outer.push_to_model()
                applied = True
            else:
                self._skip_non_finite()
        elif stats is None:
            # Inner params stay as they are: the next outer step's pseudo-gradient covers these steps too.
            log.error("outer step skipped after %d failed attempts; training goes on and the world is resolved "
                      "again at the next outer step", attempts)
        stats = stats or SyncStats()
        return OuterReport(view.mesh_version, view.global_world_size, len(contributors), round(stats.seconds, 4),
                           stats.wire_bytes, round(stats.mbps, 2), applied, attempts,
                           self.params_hash() if self.cfg.train.log_model_hash else None)

    def _skip_non_finite(self) -> None:
        """Some node sent NaN/Inf: every node skips the step; a node whose own params are non-finite
        (the offender) resets them to the outer params, and its inner optimizer state with them."""
        mine = all(bool(torch.isfinite(local_shard(p.detach())).all()) for p in self.outer.params)
        mine = localsync.all_ok(self.local_group, mine)
        log.warning("non-finite pseudo-gradient in this outer step: skipped on every node%s",
                    "" if mine else "; this node's params were non-finite: reset to the outer params")
        if not mine:
            self.outer.push_to_model()
            self.optimizer.state.clear()

    def _hand_over_state(self, view, contributors: list[int], counters: list[int]) -> list[int] | None:
        """Donor -> joiners, after the outer step; returns the counters a joiner received."""
        waiting = [r for r in range(view.global_world_size) if r not in contributors]
        if not waiting or not contributors:
            self.needs_state = False
            return None
        donor = contributors[0]
        transfer = StateTransfer(self.mesh.global_pg, self.outer, self.optimizer, self.dcfg.min_bandwidth_mbps)
        started = time.perf_counter()
        if view.global_rank == donor:
            ensure_adam_state(self.optimizer)
            for r in waiting:
                try:
                    transfer.send(r, counters)
                except PeerFailure as e:
                    log.warning("could not send state to joiner rank %d: %s", r, e)
                    self.mesh.report_failure(r)
            return None
        if view.global_rank in waiting:
            try:
                received = transfer.receive(donor)
            except PeerFailure as e:
                raise EnvironmentFailure(f"joining failed: the state transfer from rank {donor} broke ({e}); "
                                         "restart this node to join again") from None
            self.needs_state = False
            log.info("received the run's state from rank %d in %.2f s", donor, time.perf_counter() - started)
            return received
        return None

    def _check_drift(self, view) -> None:
        """Drift guard: a rank whose outer params differ from the majority's resyncs next outer step."""
        digest = torch.tensor(list(hashlib.sha256(self.outer.flat.detach().numpy().tobytes()).digest()),
                              dtype=torch.uint8)
        gathered = [torch.empty_like(digest) for _ in range(view.global_world_size)]
        try:
            self.mesh.global_pg.allgather([gathered], [digest]).wait(_short_deadline(self.cfg))
        except Exception as e:  # noqa: BLE001 - a failed check is retried at the next outer step
            log.warning("drift check skipped: %s", str(e).splitlines()[0])
            self.mesh.report_failure(None)
            return
        votes = [bytes(g.tolist()) for g in gathered]
        majority = max(votes, key=lambda v: (votes.count(v), -votes.index(v)))
        in_sync = localsync.all_ok(self.local_group, votes[view.global_rank] == majority)
        if not in_sync:
            log.warning("drift guard: this node's outer params differ from the majority's; "
                        "resyncing from a live node at the next outer step")
            self.needs_state = True

    def _save_position(self, data_state: dict | None) -> None:
        if data_state is None or self.store is None:
            return
        try:
            slots.save_position(self.store, self.slot, self.local.rank, data_state)
        except store_errors() as e:
            log.warning("could not record the data position in the store: %s", str(e).splitlines()[0])
            self.store = None
            self._reconnect_later()

    def _reconnect_later(self) -> None:
        try:
            self.store = self._connect()
        except Exception:  # noqa: BLE001 - the store may be restarting; try at the next outer step
            self.store = None

    # -- misc ---------------------------------------------------------------------------------
    def params_hash(self) -> str:
        """Hash of the outer params over the node's local ranks (equal on every node when in sync)."""
        digest = torch.tensor(list(hashlib.sha256(self.outer.flat.detach().numpy().tobytes()).digest()),
                              dtype=torch.uint8)
        if self.local_group is not None and self.local.world_size > 1:
            parts = [torch.empty_like(digest) for _ in range(self.local.world_size)]
            dist.all_gather(parts, digest, group=self.local_group)
            digest = torch.cat(parts)
        return hashlib.sha256(bytes(digest.tolist())).hexdigest()[:16]

    def shutdown(self, graceful: bool = True) -> None:
        self.mesh.shutdown(graceful=graceful)


def _short_deadline(cfg: Config):
    from datetime import timedelta

    return timedelta(seconds=max(5.0, cfg.elastic.sync_deadline))
