"""Durable checkpoints that never stall training: the API the training loop calls.

    manager = CheckpointManager(cfg.ckpt, uid=uid, local_rank=r, local_world_size=n, sink=sink)
    resumed = manager.resume(state)            # in place; a Resumed (position, data_state, outer) or None
    ... if manager.due(step): manager.save(step, state)
    manager.save(step, state, final=True); manager.wait(cfg.ckpt.grace_period); manager.close()

Why per-rank safetensors and not torch.distributed.checkpoint (DCP): DCP's save plans its writes
with collectives (gather + scatter of plans, a barrier for the metadata) on a process group. The
training loop uses the local group every step (loss all-reduce, FSDP2), and collectives issued from
a second thread on the same group interleave unpredictably with the main thread's and deadlock or
corrupt both; DCP's async_save only moves the file writes off the main thread, the planning stays
a blocking collective. Each rank's shards are already local tensors (FSDP2's to_local), so every
rank can write its own part with no communication at all, from a background thread. The format is
also safe to hand to peers (no pickled metadata). Measured on this 2-core CPU box, model + AdamW
state of 312 MB (tiny, dim 512): dcp.async_save blocked the caller 1.5 s (it allocates a fresh
staging copy each time), dcp.save took 0.9-1.0 s; the staging copy here blocks 0.25-0.4 s, which is
5-8% of a synchronous save of the full 520 MB state with checksums and fsync (5 s; see
scripts/bench_checkpoint.py and BENCHMARKS.md).

Multi-rank resume uses the local group from the main thread only (two small all-reduces per
candidate step) so every local rank loads the same step.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zb.ckpt.durable.copies import check_writable_dir, copy_part, retry
from zb.ckpt.durable.layout import (
    check_complete,
    clean_own_leftovers,
    complete_steps,
    entries,
    part_count,
    part_name,
    resolve_part,
    scan_steps,
    step_from_name,
)
from zb.ckpt.durable.lineage import Entry, Origin, continue_or_fork, current_lineage, describe, merge, origin_of
from zb.ckpt.durable.ramdir import ram_only_steps, release, sweep_stale
from zb.ckpt.durable.remote import check_remote, download_part, remote_entries
from zb.ckpt.durable.reshard import join_and_split, stripe_of
from zb.ckpt.durable.state import (
    MODEL,
    OPTIM,
    OUTER,
    RNG,
    Staging,
    TrainState,
    check_meta,
    check_optimizer,
    check_rng,
    json_meta,
    live_tensors,
    load_model,
    load_optimizer,
    load_rng,
    load_scheduler,
)
from zb.ckpt.durable.worker import Job, Targets, Worker
from zb.ckpt.format.catalog import CorruptSnapshot, check_quick, read_manifest, verify_snapshot
from zb.ckpt.format.manifest import snapshot_name
from zb.ckpt.format.snapshot import load_snapshot
from zb.config_schema import CkptConfig
from zb.errors import EnvironmentFailure, InvalidInput, ZbError
from zb.fingerprint import differences, encode
from zb.position import JSON_KEY, RunPosition

log = logging.getLogger("zb.ckpt")


@dataclass(frozen=True)
class Resumed:
    """What a resume loaded besides the state it filled in place (model, optimizer, scheduler, RNG):
    the caller applies these to the run."""

    path: str
    position: RunPosition
    data_state: dict | None           # None: the checkpoint was resharded (another local rank count)
    outer: dict[str, torch.Tensor] | None
    extra: dict


__all__ = ["CheckpointManager", "Resumed", "TrainState"]

# Keys of the fingerprint that may differ between the run that saved and the one that resumes.
# local_world_size: in the fingerprints of checkpoints written before diloco.stripes; the local rank count
# may differ now (the checkpoint is resharded). diloco.clip and diloco.evict_clipped: every node of a run shares
# them, but a run may resume with robust aggregation turned on or off (and older checkpoints lack them).
# wire_format: a checkpoint holds no payload, so one written by a build of another wire format resumes.
_MAY_DIFFER = ("zb_version", "wire_format", "local_world_size", "diloco.clip", "diloco.evict_clipped")


class CheckpointManager:
    """The durable checkpoints of one local rank: `save` stages the state in RAM (the only blocking
    part) and queues the disk and remote copies to a background worker; `resume` finds the newest
    complete, verified checkpoint (or the named one), loads it in place and returns the rest;
    `check_durable` turns checkpoints that never reached disk into a failed run, not a quiet one."""

    def __init__(self, cfg: CkptConfig, *, uid: str, local_rank: int, local_world_size: int, sink: Any,
                 local_group: Any = None, attempts: int = 3, retry_delay: float = 1.0):
        self.cfg, self.uid, self.sink, self.group = cfg, uid, sink, local_group
        self.attempts, self.retry_delay = attempts, retry_delay
        self.local_rank, self.local_world_size = local_rank, local_world_size
        self.disk_root = Path(cfg.path) if cfg.path else None
        self.ram_root = Path(cfg.ram_dir) / uid if cfg.ram_dir else None
        self.remote = f"{cfg.remote.path.rstrip('/')}/{uid}" if cfg.remote.path else None
        if cfg.path:
            check_writable_dir(cfg.path)  # at start: a path that can never work is exit 2, not a quiet run
        if cfg.remote.path:
            check_remote(cfg.remote.path)
        if self.ram_root is not None and self.disk_root is not None:
            try:
                check_writable_dir(cfg.ram_dir, "ckpt.ram_dir")
            except ZbError as e:  # staging in RAM is an optimisation: go without it, but say so
                log.warning("%s; checkpoints are written straight to ckpt.path instead", e)
                self.ram_root = None
        self._tidy()
        # A run writes a new branch unless it resumes the newest step of one (zb.ckpt.durable.lineage).
        self.origin = Origin(self._new_branch_id(), None)
        self._staging = Staging()
        self._free = threading.Event()  # set once the last submitted job no longer needs the staging buffers
        self._free.set()
        self._last_job: Job | None = None
        self._worker = Worker(Targets(self.ram_root, self.disk_root, self.remote, cfg.remote.interval, cfg.topk,
                                      local_rank, attempts, retry_delay), sink)

    # -- saving ------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        interval = self.cfg.interval
        return bool(interval and step > 0 and step % interval == 0)

    def save(self, step: int, state: TrainState, *, final: bool = False) -> None:
        """Copy the live state into the staging buffers and return; the worker does the rest."""
        t0 = time.perf_counter()
        last = self._last_job
        if final and last is not None and last.step == step:
            # The interval saved this step just now and nothing has changed since: the worker skips it
            # once that copy is committed on disk, or else writes it from the same (untouched) buffers.
            self._free = threading.Event()
            self._last_job = replace(last, meta={**last.meta, "final": True}, final=True, blocking_s=0.0,
                                     release=self._free, started=time.perf_counter())
            self._worker.submit(self._last_job)
            return
        if not self._free.is_set():
            log.warning("checkpoint step %d waits for the previous one to leave the staging buffers "
                        "(ckpt.interval shorter than a RAM write)", step)
            self._free.wait()
        # The outer state only changes at outer steps; copied in the background when the worker is
        # free to start at once, else here (it could be overwritten while the job waits in line).
        outer_bg = state.outer is not None and self._worker.idle
        live = live_tensors(state)
        if state.outer is not None and not outer_bg:
            live[OUTER] = state.outer
        staged = self._staging.fill(live)
        meta = {**json_meta(state), "local_world_size": self.local_world_size, "local_rank": self.local_rank,
                "node_id": self.uid, "shared_files": [OUTER] if state.outer is not None else [],
                "final": final, "lineage": self.origin.to_json()}
        # One event per job: an older job finishing must not free the buffers a queued one still reads.
        self._free = threading.Event()
        blocking = time.perf_counter() - t0
        self._last_job = Job(step, state.position.outer_step, staged, state.outer if outer_bg else None,
                             meta, encode(state.fingerprint), final, blocking, self._free)
        self._worker.submit(self._last_job)
        log.info("checkpoint step %d staged in %.3f s (%s bytes); copying in the background", step, blocking,
                 f"{self._staging.nbytes:,}")

    def wait(self, timeout: float | None = None) -> bool:
        """True once every submitted checkpoint has finished its background copies."""
        return self._worker.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker and remove this rank's RAM copies (they only fed the disk copy)."""
        idle = self._worker.wait(timeout)
        if not idle:
            log.warning("stopping with checkpoint copies still running: %s", self._in_flight())
        self._worker.stop(5.0 if idle or timeout != 0 else 0)  # an idle worker ends at once
        if self.ram_root is not None and self.disk_root is not None and not self._worker.alive:
            # The RAM copy of a newest checkpoint that never reached ckpt.path is the only copy of that
            # state: it stays (and no owner file marks it for removal) until the user has saved it.
            keep = [self._worker.ram_only] if self._worker.not_durable and self._worker.ram_only else []
            release(self.ram_root, [part_name(self.local_rank)], keep=keep)
        # else a copy is still being written there: the next run's sweep removes it once we are gone

    def _in_flight(self) -> str:
        """Where the checkpoint being copied stands, and the newest one that is safe, in one sentence."""
        job = self._worker.current
        durable = complete_steps(self.disk_root) if self.disk_root is not None else []
        safe = f"the newest complete checkpoint on ckpt.path is step {durable[-1]}" if durable else \
            "no checkpoint is complete on ckpt.path yet"
        if job is None or self.disk_root is None:
            return safe
        # Its RAM copy is committed: read from the directory, the truth, not from the worker's flag, which the
        # worker sets a moment after the commit (an abort in between called a safe copy lost).
        if self.ram_root is not None and not job.final and job.step in complete_steps(self.ram_root):
            return (f"step {job.step} is complete in RAM at {self.ram_root / snapshot_name(job.step)} and its copy to "
                    f"ckpt.path is unfinished; the next start with the same ckpt.path and ckpt.ram_dir finishes it; "
                    f"{safe}")
        return f"step {job.step} was still being written and is lost; {safe}"

    def check_durable(self) -> None:
        """At the end of a run: raise EnvironmentFailure (exit 1) when the newest checkpoints never
        reached ckpt.path (disk full, I/O errors); only warn when a later one did."""
        w = self._worker
        if self.disk_root is None:
            return
        if w.not_durable:
            steps = ", ".join(str(s) for s, _ in w.not_durable)
            last = f"step {w.last_durable}" if w.last_durable is not None else "none from this run"
            kept = (f"; the newest is kept in RAM at {w.ram_only.parent}: copy that directory to a disk with room "
                    "to keep it" if w.ram_only is not None else "")
            raise EnvironmentFailure(
                f"the last {len(w.not_durable)} checkpoint(s) (step {steps}) were not written durably to ckpt.path "
                f"{self.disk_root} ({w.not_durable[-1][1]}); the last durable checkpoint is {last}{kept}. Free space "
                "there (or fix the disk) before resuming with --ckpt.resume latest")
        if w.ever_failed:
            log.warning("checkpoint step(s) %s did not reach ckpt.path; later ones did (the last durable one is step "
                        "%s)", ", ".join(map(str, w.ever_failed)), w.last_durable)

    def _tidy(self) -> None:
        """At start: what a crash left of this rank's parts on disk, and RAM copies of dead runs."""
        if self.disk_root is not None:
            for line in clean_own_leftovers(self.disk_root, self.local_rank):
                (log.warning if line.startswith("restored") else log.info)("checkpoint leftovers: %s", line)
        if self.ram_root is not None and self.disk_root is not None:
            self._finish_ram_copies()
        if self.ram_root is not None and self.local_rank == 0:
            sweep_stale(self.ram_root.parent)

    def _finish_ram_copies(self) -> None:
        """Checkpoints of an earlier run of this node complete only in RAM (its copy to ckpt.path never
        finished: a second Ctrl-C, a kill) are copied there now, this rank's part by this rank, so a
        resume finds them and no sweep takes them. EnvironmentFailure when the copy fails: the RAM
        copy stays, and the message says where it is."""
        ram_root, disk_root = self.ram_root, self.disk_root
        assert ram_root is not None and disk_root is not None  # _tidy calls this only with both
        for step in ram_only_steps(ram_root, disk_root):
            src = ram_root / snapshot_name(step) / part_name(self.local_rank)
            dst = disk_root / snapshot_name(step)
            try:
                check_quick(dst / part_name(self.local_rank))
                continue  # this rank's part got there; another rank's did not
            except (InvalidInput, OSError):
                pass
            copied, error = retry(f"checkpoint step {step}: copy from RAM to disk", partial(copy_part, src, dst),
                                  self.attempts, self.retry_delay)
            if copied is None:
                raise EnvironmentFailure(
                    f"checkpoint step {step} of an earlier run is complete only in RAM at {src.parent} and could not "
                    f"be copied to ckpt.path {self.disk_root} ({error}); free space there and start again, or copy "
                    f"that directory there yourself") from None
            log.warning("checkpoint step %d of an earlier run was complete only in RAM (its copy to ckpt.path never "
                        "finished): copied from %s to %s", step, src, copied)

    def committed_steps(self) -> list[int]:
        """Complete checkpoints of this node's current branch and its ancestors (all local ranks'
        markers; sizes checked), on its disk or on the remote copy, oldest first: what `latest` may take."""
        return current_lineage(self._entries())

    def _entries(self) -> dict[int, Entry]:
        """step -> lineage entry of every complete checkpoint of this node, local or remote (this rank's view)."""
        root = self._root()
        local = entries(root, self.local_rank) if root else {}
        return merge(local.values(), remote_entries(self.remote)[0].values() if self.remote else ())

    def _new_branch_id(self) -> str:
        """A fresh branch id, the same on every local rank (the smallest of their random proposals)."""
        return f"{self._all_min(secrets.randbits(48)):012x}"

    def _root(self) -> Path | None:
        return self.disk_root or self.ram_root

    # -- resuming ----------------------------------------------------------------------------
    def resume(self, state: TrainState, *, agreed_step: int | None = None) -> Resumed | None:
        """Load per ckpt.resume (or the step agreed with the other nodes) into `state`, in place."""
        spec = self.cfg.resume
        if agreed_step is not None:
            return self._apply(self._read_step(lambda r: self._part_of(agreed_step, r, self.remote is not None),
                                               state), state)
        elif not spec:
            return None
        elif spec == "latest":
            loaded = self._pick_latest(state)
            if loaded is None:
                log.warning("ckpt.resume = latest: no complete checkpoint under %s; starting from scratch",
                            self._root())
                return None
            return self._apply(loaded, state)
        elif "://" in spec:
            fetch = self._download_named(spec)
            return self._apply(self._read_step(fetch, state), state)
        if not Path(spec).exists():
            raise InvalidInput(f"ckpt.resume = '{spec}': no such file or directory; give latest, a step directory "
                               "(step-NNNNNNNNN, see `zb ckpt ls`) or a remote URL of one")
        step_dir = resolve_part(Path(spec), 0).parent
        check_complete(step_dir)  # an explicitly named checkpoint with a missing part is an error (exit 2)

        def named(rank: int) -> Path:
            verify_snapshot(step_dir / part_name(rank))  # ... and so is a bad one
            return step_dir / part_name(rank)

        return self._apply(self._read_step(named, state), state)

    def _part_of(self, step: int, rank: int, on_remote: bool) -> Path:
        """Local rank `rank`'s part of `step`: the local copy when it verifies, else the remote copy,
        downloaded (a replaced machine has only the remote). Raises InvalidInput/EnvironmentFailure if
        neither works."""
        part = self._need_root() / snapshot_name(step) / part_name(rank)
        try:
            verify_snapshot(part)
            return part
        except (InvalidInput, OSError) as e:
            if not on_remote:
                raise
            if part.parent.exists():
                log.warning("checkpoint step %d: the local copy is not usable (%s); using the remote copy", step, e)
        assert self.remote is not None  # on_remote: there is a remote copy
        return download_part(self.remote, step, rank, self._need_root())

    def _read_step(self, fetch, state: TrainState) -> dict:
        """This rank's state from a step whose part r is fetch(r): its own part when the step was written
        with this node's local rank count, else every part, joined and split anew (zb.ckpt.durable.reshard)."""
        try:
            own = fetch(self.local_rank)
            written_by = part_count(read_manifest(own))
        except (InvalidInput, EnvironmentFailure, OSError) as e:
            if self.local_rank == 0:
                raise
            own, written_by = None, part_count(read_manifest(fetch(0)))
            if written_by > self.local_rank:
                raise e from None   # this rank's part belongs to that layout: it is damaged or missing
        if written_by == self.local_world_size:
            return self._read_part(own, state)
        return self._read_resharded([own if r == self.local_rank else fetch(r) for r in range(written_by)], state)

    def _read_resharded(self, parts: list[Path], state: TrainState) -> dict:
        """Every part of a step written by another local rank count, read and checked, and this rank's
        share of it (zb.ckpt.durable.reshard). Every rank reads every part: memory for the whole model."""
        metas = [read_manifest(p).meta for p in parts]
        for part, meta in zip(parts, metas):
            self._check_compatible(part, meta, state)
        meta = metas[0]
        files = [MODEL, OPTIM, RNG] + ([OUTER] if state.outer is not None else [])
        try:
            check_meta(meta, read_manifest(parts[0]).step)
            loaded = [load_snapshot(p, files=files, verify=False)[0] for p in parts]
        except ValueError as e:
            raise CorruptSnapshot(f"{parts[0].parent}: {e}") from None
        rank, n = self.local_rank, len(parts)
        model = join_and_split([t[MODEL] for t in loaded], rank, self.local_world_size)
        live = live_tensors(state)[MODEL]
        for name, t in live.items():
            got = model.get(name)
            if got is None or got.shape != t.shape or got.dtype != t.dtype:
                raise _RunMismatch(f"{parts[0].parent}: {name} resharded to {list(got.shape) if got is not None else None} "
                                   f"does not match this run's {list(t.shape)} {t.dtype}")
        out = {"path": str(parts[0].parent), "meta": {**meta, "data_state": None}, "model": model,
               OPTIM: join_and_split([t[OPTIM] for t in loaded], rank, self.local_world_size),
               RNG: loaded[rank if rank < n else 0][RNG]}
        if state.outer is not None:
            out[OUTER] = stripe_of([t[OUTER] for t in loaded], rank, state.fingerprint.get("stripes", n))
        _check_rest(parts[0].parent, out, meta, state)
        if rank == 0:
            log.warning("checkpoint %s was written by %d local ranks and this node has %d: its model and optimizer "
                        "state are resharded; the data position does not carry over (the data starts from the "
                        "beginning of the shard, or where the slot's last holder stopped) and the random state "
                        "differs, so the run is not bit-identical to one resumed with %d", parts[0].parent, n,
                        self.local_world_size, n)
        return out

    def _download_named(self, url: str):
        """ckpt.resume names a remote step directory (`<remote>/<node id>/step-000000100`): fetch(rank)."""
        """ckpt.resume names a remote step directory (`<remote>/<node id>/step-000000100`)."""
        base, _, name = url.rstrip("/").rpartition("/")
        step = step_from_name(name)
        if step is None:
            raise InvalidInput(f"ckpt.resume {url!r}: a remote checkpoint must name its step directory "
                               "(.../<node id>/step-000000100)")
        root = self._need_root()
        return lambda rank: download_part(base, step, rank, root)

    def _need_root(self) -> Path:
        root = self._root()
        if root is None:
            raise InvalidInput("resuming needs ckpt.path (where checkpoints are)")
        return root

    def _pick_latest(self, state: TrainState) -> dict | None:
        """The newest step whose part verifies (checksums and content) on every local rank, read into
        memory, from this node's disk or else the remote copy; each one skipped is named in a warning."""
        root, bound = self._need_root(), math.inf
        local, damaged = scan_steps(root)
        remote, damaged_remote = remote_entries(self.remote) if self.remote else ({}, {})
        if self.local_rank == 0:  # every local rank sees the same step directories
            for where, bad, other in ((root, damaged, remote), (self.remote, damaged_remote, local)):
                for step, why in bad.items():
                    if step not in other:  # else the other copy is used
                        log.warning("skipping checkpoint step %d (%s/%s): %s", step, where, snapshot_name(step), why)
        found = merge(entries(root, self.local_rank, local).values(), remote.values())
        line = current_lineage(found)
        while True:
            mine = [s for s in line if s < bound]
            step = self._all_min(mine[-1] if mine else -1)
            if step < 0:
                others = sorted(set(found) - set(line))
                if others and self.local_rank == 0:
                    log.warning("no checkpoint of the current branch could be loaded; steps %s belong to branches the "
                                "run left: name one with --ckpt.resume to take it", ", ".join(map(str, others)))
                return None
            loaded = None
            try:
                loaded = self._read_step(lambda r, step=step: self._part_of(step, r, step in remote), state)
            except _RunMismatch:
                raise
            except (InvalidInput, EnvironmentFailure, OSError) as e:  # damaged: the previous one, if any
                log.warning("skipping checkpoint step %d: %s", step, e)
            if self._all_min(int(loaded is not None)) == 1:
                return loaded
            bound = step

    def _all_min(self, value: int) -> int:
        return all_min(value, self.group)

    def _read_part(self, part: Path, state: TrainState) -> dict:
        """Read and check everything of a part before anything is applied: a checkpoint whose
        checksums hold but whose content is wrong raises CorruptSnapshot (`latest` then takes the
        previous one), one written by a different run _RunMismatch (exit 2)."""
        manifest = read_manifest(part)
        meta = manifest.meta
        self._check_compatible(part, meta, state)
        try:
            check_meta(meta, manifest.step)
            missing = [f for f in (MODEL, OPTIM, RNG) if f not in manifest.files]
            if missing:
                raise ValueError(f"no {missing[0]} in the part")
        except ValueError as e:
            raise CorruptSnapshot(f"{part}: {e}") from None
        expect = {MODEL: {n: (tuple(t.shape), t.dtype) for n, t in live_tensors(state)[MODEL].items()}}
        try:
            tensors, _ = load_snapshot(part, expect, verify=False)
        except InvalidInput as e:
            if isinstance(e, CorruptSnapshot):
                raise
            raise _RunMismatch(str(e)) from None
        files = [OPTIM, RNG] + ([OUTER] if state.outer is not None else [])
        rest, _ = load_snapshot(part, files=files, verify=False)
        _check_rest(part, rest, meta, state)
        return {"path": str(part), "meta": meta, "model": tensors[MODEL], **rest}

    def _apply(self, loaded: dict, state: TrainState) -> Resumed:
        meta = loaded["meta"]
        load_model(state.model, loaded["model"])
        load_optimizer(state.model, state.optimizer, loaded[OPTIM], meta["param_groups"])
        load_scheduler(state.scheduler, meta.get("scheduler"))
        load_rng(loaded[RNG])
        position = RunPosition.from_json(meta[JSON_KEY])
        log.info("resumed from %s (step %d)", loaded["path"], position.step)
        self._follow(Entry(position.step, origin_of(meta), 0.0))
        return Resumed(loaded["path"], position, meta["data_state"], loaded.get(OUTER), meta.get("extra", {}))

    def _follow(self, resumed: Entry) -> None:
        """The branch this run writes after resuming `resumed`: the same one when it was the branch's
        newest step, else a new branch from it (said, with what stays on the branch it left)."""
        found = self._entries()
        self.origin = continue_or_fork(found, resumed, self.origin.branch)
        if self.origin.base is None or self.origin.branch == resumed.branch or self.local_rank != 0:
            return
        newer = sorted(s for s, e in found.items() if e.branch == resumed.branch and s > resumed.step)
        log.warning("resuming step %d while this node holds newer steps of its branch (%s): this run writes a new "
                    "%s; `latest` takes this branch once it has a checkpoint, and pruning keeps step %d, the "
                    "newest of the branch it left", resumed.step, ", ".join(map(str, newer)), describe(self.origin),
                    newer[-1])

    def _check_compatible(self, part: Path, meta: dict, state: TrainState) -> None:
        saved = {k: v for k, v in meta.get("fingerprint", {}).items() if k not in _MAY_DIFFER}
        mine = {k: v for k, v in state.fingerprint.items() if k not in _MAY_DIFFER}
        diff = differences(mine, saved)
        if diff:
            raise _RunMismatch(f"checkpoint {part} was written by a different run: " + "; ".join(diff).replace(
                "(run:", "(checkpoint:") + ". Resume with the run's settings or start a new ckpt.path.")
        if state.outer is None and meta.get("shared_files"):
            log.warning("checkpoint %s holds a DiLoCo outer state that this run (no DiLoCo) ignores", part)
        if meta.get("threads") != torch.get_num_threads():
            log.warning("checkpoint %s was written with %s CPU thread(s), this process has %d: the resumed run is "
                        "not bit-identical (float sums depend on the thread count)", part, meta.get("threads"),
                        torch.get_num_threads())
        if not meta.get("data_exact", True) or not state.data_exact:
            log.warning("the data loader cannot resume exactly (shuffle buffer): the resumed run sees slightly "
                        "different data than an uninterrupted one")


def all_min(value: int, group: Any) -> int:
    """The smallest of every local rank's `value` (the local ranks agree on a step or an outcome); alone: `value`."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return value
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


class _RunMismatch(InvalidInput):
    """The checkpoint is intact but belongs to a run with other settings: never skipped silently."""


def _check_rest(where: Path, loaded: dict, meta: dict, state: TrainState) -> None:
    """The optimizer, RNG and outer tensors read for `state` fit it: else CorruptSnapshot or _RunMismatch."""
    try:
        check_optimizer(state.model, state.optimizer, loaded[OPTIM], meta.get("param_groups"))
        check_rng(loaded[RNG])
    except ValueError as e:
        raise CorruptSnapshot(f"{where}: {e}") from None
    if state.outer is not None:
        _check_outer(where, loaded[OUTER], state.outer)


def _check_outer(part: Path, saved: dict[str, torch.Tensor], live: dict[str, torch.Tensor]) -> None:
    """The outer params must match; momentum may be absent on either side (no outer step yet). The
    average in flight (overlap) and the error-feedback residual are the algorithm's to check: one that does
    not fit is dropped with a line."""
    for name, t in saved.items():
        if name.startswith(("inflight/", "feedback/")):
            continue
        ref = live.get(name, live["outer/params"])
        if t.shape != ref.shape or t.dtype != ref.dtype:
            raise _RunMismatch(f"{part}: {name} is {list(t.shape)} {t.dtype} in the checkpoint, this run has "
                               f"{list(ref.shape)} {ref.dtype}")
    if "outer/params" not in saved:
        raise CorruptSnapshot(f"{part}: the checkpoint has no outer/params")
