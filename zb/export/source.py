"""Which checkpoint to export, checked before anything is read: a step directory that every local
rank committed, with the files the export needs intact (sizes and sha256 against the manifests).

A path may name a step directory (`<ckpt.path>/step-000000100`), one of its parts (`.../rank-0`) or
a checkpoint root (`<ckpt.path>`: its newest complete step). The layout is zb.ckpt.durable.layout's.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zb.ckpt.durable.layout import check_complete, latest_step, part_name, scan_steps, step_dirs, step_from_name
from zb.ckpt.durable.state import MODEL, OUTER
from zb.ckpt.format.catalog import read_committed, verify_snapshot
from zb.ckpt.format.manifest import Manifest
from zb.errors import InvalidInput


@dataclass(frozen=True)
class Checkpoint:
    step_dir: Path
    step: int
    parts: list[Path]         # rank-0 .. rank-(n-1)
    manifests: list[Manifest]  # each part's, committed: its tensor tables give every shard's shape
    config: dict[str, Any]    # the run's resolved config (zb.config.to_dict), from rank 0's manifest
    has_outer: bool           # DiLoCo outer params are in every part


def resolve_step_dir(path: Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise InvalidInput(f"checkpoint {path} does not exist; name a step directory (<ckpt.path>/step-NNNNNNNNN) "
                           "or a checkpoint root")
    if not path.is_dir():
        raise InvalidInput(f"checkpoint {path} is not a directory; name a step directory or a checkpoint root")
    if path.name.startswith("rank-") and step_from_name(path.parent.name) is not None:
        return path.parent
    if step_from_name(path.name) is not None or (path / part_name(0)).is_dir():
        return path
    _, bad = scan_steps(path)
    latest = latest_step(path)  # the newest complete step of the current branch, as a resume takes it
    if latest is not None:
        return step_dirs(path)[latest]
    if bad:
        newest = max(bad)
        raise InvalidInput(f"no complete checkpoint under {path}: the newest, step {newest}, is incomplete or "
                           f"damaged ({bad[newest]})")
    raise InvalidInput(f"{path} is not a zb checkpoint (no step-NNNNNNNNN directories, no rank-0 part)")


def open_checkpoint(path: Path, *, inner: bool) -> Checkpoint:
    """The checkpoint at `path`, complete and with intact files (InvalidInput, exit 2, naming what is wrong)."""
    step_dir = resolve_step_dir(path)
    try:
        n = check_complete(step_dir)
    except (InvalidInput, OSError) as e:
        raise InvalidInput(f"checkpoint {step_dir} is incomplete or damaged: {e}") from None
    parts = [step_dir / part_name(r) for r in range(n)]
    manifests = [read_committed(p) for p in parts]
    has_outer = all(OUTER in m.files for m in manifests)
    # Only the file whose values are read is hashed: the shards' shapes come from the committed manifests.
    files = [MODEL] if inner or not has_outer else [OUTER]
    for part, manifest in zip(parts, manifests):
        missing = [f for f in (MODEL, *files) if f not in manifest.files]
        if missing:
            raise InvalidInput(f"checkpoint part {part} has no {missing[0]}: not a training checkpoint of zb train")
    # Hashing dominates the export's time and hashlib releases the GIL: one file per core at once.
    with ThreadPoolExecutor(max(1, min(len(parts) * len(files), os.cpu_count() or 1, 8))) as pool:
        checks = [pool.submit(verify_snapshot, part, [f]) for part in parts for f in files]
        for check in checks:
            try:
                check.result()
            except InvalidInput as e:
                raise InvalidInput(f"checkpoint {step_dir} is damaged: {e}") from None
    config = manifests[0].meta.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise InvalidInput(f"checkpoint {step_dir} holds no run config in {parts[0]}/manifest.json: not written by "
                           "zb train")
    return Checkpoint(step_dir, manifests[0].step, parts, manifests, config, has_outer)
