"""eval.only's checkpoint: read, never written, and the data slot its node evaluated.

A resume (zb.ckpt.durable.manager) tidies as it starts: it probes ckpt.path and ckpt.ram_dir with a file,
puts back or removes what a crash left of this rank's parts, copies RAM-only steps to disk, sweeps the RAM
copies of dead runs and, at its end, removes this node's RAM copies. An evaluation may run beside the node
that writes those checkpoints (with its node id), or on a read-only copy: it must do none of that. So it
reads the checkpoint itself: the step ckpt.resume names (`latest`: the newest step of the current branch,
from ckpt.path or the remote copy, whose model file holds its sha256, as a resume picks it; a remote part
is downloaded into a temporary directory, removed after), this local rank's model tensors (resharded when
the checkpoint was written by another local rank count), the run position, and the node's data slot.
Only the model is read: the optimizer, the RNG and the DiLoCo outer state play no part in an evaluation.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zb.ckpt.durable.layout import check_complete, entries, part_count, part_name, resolve_part, step_from_name
from zb.ckpt.durable.lineage import current_lineage, merge
from zb.ckpt.durable.manager import all_min
from zb.ckpt.durable.remote import download_part, remote_entries
from zb.ckpt.durable.reshard import join_and_split
from zb.ckpt.durable.state import MODEL, check_meta, load_model, model_tensors
from zb.ckpt.format.catalog import CorruptSnapshot, read_manifest
from zb.ckpt.format.manifest import snapshot_name
from zb.ckpt.format.snapshot import load_snapshot
from zb.config import source_of
from zb.config_schema import Config
from zb.errors import EnvironmentFailure, InvalidInput
from zb.fingerprint import differences
from zb.position import JSON_KEY, RunPosition

log = logging.getLogger("zb.train")

# Fingerprint keys an evaluation does not depend on: the version and wire format, the local rank count (the checkpoint is
# resharded), and DiLoCo's outer settings and stripes (the outer state is not read).
_NOT_EVALUATED = ("zb_version", "wire_format", "local_world_size", "stripes")


@dataclass(frozen=True)
class Checkpoint:
    path: str                   # the step directory read (the remote one's URL for a downloaded copy)
    position: RunPosition
    meta: dict[str, Any]        # local rank 0's manifest meta


class _Mismatch(InvalidInput):
    """The checkpoint is intact but another run's (other settings, other shapes): never skipped."""


def read_checkpoint(cfg: Config, model: torch.nn.Module, fingerprint: dict, *, local_rank: int,
                    local_world_size: int, group: Any = None) -> Checkpoint | None:
    """Load the model of the checkpoint ckpt.resume names into `model` (in place); None when `latest` finds
    none. InvalidInput (exit 2) for a named checkpoint that is missing, damaged or another run's."""
    spec = cfg.ckpt.resume
    assert spec, "eval.only needs ckpt.resume (zb.config_checks refuses it without)"
    with ExitStack() as cleanup:
        def scratch() -> Path:
            """A temporary directory for downloaded parts, removed when the model is read."""
            return Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="zb-eval-only-")))

        reader = _Reader(model, fingerprint, local_rank, local_world_size)
        if spec == "latest":
            return _latest(cfg, reader, scratch, group)
        if "://" in spec:
            base, _, name = spec.rstrip("/").rpartition("/")
            step = step_from_name(name)
            if step is None:
                raise InvalidInput(f"ckpt.resume {spec!r}: a remote checkpoint must name its step directory "
                                   "(.../<node id>/step-000000100)")
            root = scratch()
            return reader.read(lambda rank: download_part(base, step, rank, root), where=spec)
        return reader.read(_named(Path(spec)))


def _named(path: Path) -> Callable[[int], Path]:
    if not path.exists():
        raise InvalidInput(f"ckpt.resume = '{path}': no such file or directory; give latest, a step directory "
                           "(step-NNNNNNNNN, see `zb ckpt ls`) or a remote URL of one")
    step_dir = resolve_part(path, 0).parent
    check_complete(step_dir)     # an explicitly named checkpoint with a missing part is an error (exit 2)
    return lambda rank: step_dir / part_name(rank)


def _latest(cfg: Config, reader: _Reader, scratch: Callable[[], Path], group: Any) -> Checkpoint | None:
    """The newest step of the current branch that reads (every local rank takes the same step); each one
    skipped is named in a warning, as a resume names it."""
    uid = cfg.elastic.unique_id
    root = Path(cfg.ckpt.path) if cfg.ckpt.path else Path(cfg.ckpt.ram_dir) / str(uid)
    remote = f"{cfg.ckpt.remote.path.rstrip('/')}/{uid}" if cfg.ckpt.remote.path else None
    local, remote_steps = entries(root), (remote_entries(remote)[0] if remote else {})
    found = merge(local.values(), remote_steps.values())
    bound = None
    while True:
        line = [s for s in current_lineage(found) if bound is None or s < bound]
        step = all_min(line[-1] if line else -1, group)
        if step < 0:
            return None
        loaded = _first_that_reads(reader, step, _copies(step, root, step in local,
                                                         remote if step in remote_steps else None, scratch))
        if all_min(int(loaded is not None), group) == 1:
            return loaded
        bound = step


def _copies(step: int, root: Path, local: bool, remote: str | None,
            scratch: Callable[[], Path]) -> list[tuple[Callable[[int], Path], str | None]]:
    """Where step's parts can be read: the local copy, then the remote one (also where the local does not read)."""
    copies: list[tuple[Callable[[int], Path], str | None]] = []
    if local:
        copies.append((lambda rank: root / snapshot_name(step) / part_name(rank), None))
    if remote is not None:
        copies.append((lambda rank: download_part(remote, step, rank, scratch()), f"{remote}/{snapshot_name(step)}"))
    return copies


def _first_that_reads(reader: _Reader, step: int,
                      copies: list[tuple[Callable[[int], Path], str | None]]) -> Checkpoint | None:
    """The step read from its first copy that reads (local, then remote); another run's is never skipped."""
    for fetch, where in copies:
        try:
            return reader.read(fetch, where)
        except _Mismatch:
            raise
        except (InvalidInput, EnvironmentFailure, OSError) as e:
            log.warning("skipping %s copy of checkpoint step %d: %s", "the remote" if where else "the local",
                        step, e)
    return None


class _Reader:
    """Reads one step's model for this local rank; everything is checked before the model is touched."""

    def __init__(self, model: torch.nn.Module, fingerprint: dict, local_rank: int, local_world_size: int):
        self.model, self.fingerprint = model, fingerprint
        self.rank, self.size = local_rank, local_world_size

    def read(self, fetch: Callable[[int], Path], where: str | None = None) -> Checkpoint:
        """`fetch(r)`: local rank r's part of the step; `where`: the step's name for a downloaded copy."""
        first = fetch(0)
        manifest = read_manifest(first)
        written_by = part_count(manifest)
        ranks = [self.rank] if written_by == self.size else list(range(written_by))
        parts = [first if r == 0 else fetch(r) for r in ranks]
        for part in parts:
            self._check_same_run(part, read_manifest(part).meta)
        try:
            check_meta(manifest.meta, manifest.step)
        except ValueError as e:
            raise CorruptSnapshot(f"{first}: {e}") from None
        tensors = self._model_tensors(parts, resharded=written_by != self.size)
        load_model(self.model, tensors)
        if written_by != self.size and self.rank == 0:
            log.info("eval.only: checkpoint %s was written by %d local ranks and this node has %d: its model is "
                     "resharded", first.parent, written_by, self.size)
        return Checkpoint(where or str(first.parent), RunPosition.from_json(manifest.meta[JSON_KEY]), manifest.meta)

    def _model_tensors(self, parts: list[Path], resharded: bool) -> dict[str, torch.Tensor]:
        live = {n: (tuple(t.shape), t.dtype) for n, t in model_tensors(self.model).items()}
        if not resharded:   # this rank's own part: its shapes are this rank's shards
            try:
                return load_snapshot(parts[0], {MODEL: live})[0][MODEL]
            except InvalidInput as e:
                if isinstance(e, CorruptSnapshot):
                    raise
                raise _Mismatch(str(e)) from None
        joined = join_and_split([load_snapshot(p, files=[MODEL])[0][MODEL] for p in parts], self.rank, self.size)
        for name, (shape, dtype) in live.items():
            got = joined.get(name)
            if got is None or (tuple(got.shape), got.dtype) != (shape, dtype):
                raise _Mismatch(f"{parts[0].parent}: {name} resharded to "
                                f"{list(got.shape) if got is not None else None} does not match this run's "
                                f"{list(shape)} {dtype}")
        return joined

    def _check_same_run(self, part: Path, meta: dict) -> None:
        def kept(values: dict) -> dict:
            return {k: v for k, v in values.items() if k not in _NOT_EVALUATED and not k.startswith("diloco.")}

        diff = differences(kept(self.fingerprint), kept(meta.get("fingerprint", {})))
        if diff:
            raise _Mismatch(f"checkpoint {part} was written by a different run: " + "; ".join(diff).replace(
                "(run:", "(checkpoint:") + ". Evaluate it with the run's settings.")


def data_slot(cfg: Config, ckpt: Checkpoint) -> tuple[int, int]:
    """The data slot (data rank, data world size) to evaluate on: the node's at the checkpoint (its manifest
    records it), so that the loss is the one the run logged; data.data_rank and data.data_world_size when
    given. A checkpoint written before the slot was recorded: a run without DiLoCo read the slot of its
    config; a DiLoCo node's is unknown (said once, and slot 0 of 1 is evaluated unless given)."""
    recorded = _recorded_slot(ckpt.meta.get("data_slot"))
    run_data = (ckpt.meta.get("config") or {}).get("data") or {}
    if recorded is not None:
        slot = recorded
    elif not (ckpt.meta.get("config") or {}).get("diloco"):
        slot = (run_data.get("data_rank") or 0, run_data.get("data_world_size") or 1)
    else:
        slot = (0, 1)
        if not all(_given(cfg, k) for k in ("data.data_rank", "data.data_world_size")):
            log.warning("eval.only: checkpoint %s records no data slot (written by an older zb): its node's is "
                        "unknown, so data slot 0 of 1 is evaluated and the loss may differ from the one the run "
                        "logged; give the node's slot with --data.data_rank and --data.data_world_size", ckpt.path)
    rank = cfg.data.data_rank if _given(cfg, "data.data_rank") else slot[0]
    world = cfg.data.data_world_size if _given(cfg, "data.data_world_size") else slot[1]
    return int(rank or 0), int(world or 1)


def _given(cfg: Config, key: str) -> bool:
    return source_of(cfg, key) != "default"


def _recorded_slot(value: Any) -> tuple[int, int] | None:
    """The manifest's data_slot, None when absent (an older checkpoint) or not a slot."""
    if not isinstance(value, dict):
        return None
    rank, world = value.get("rank"), value.get("world_size")
    if isinstance(rank, int) and isinstance(world, int) and 0 <= rank < world:
        return rank, world
    return None
