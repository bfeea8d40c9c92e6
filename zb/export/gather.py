"""Whole tensors from a checkpoint's per-rank shards.

FSDP2 shards every parameter along dim 0 over the local ranks (torch.chunk's split: rank r holds
rows [r*c, (r+1)*c) with c = ceil(rows / ranks), the last ranks fewer or none), so a whole tensor is
the ranks' shards concatenated in rank order, whatever the rank count; one rank holds whole tensors.

The DiLoCo outer params are in the run's stripes (diloco.stripes, the `stripes` of the checkpoint's
fingerprint; zb.diloco.stripes): part s < stripes holds one flat fp32 buffer with stripe s of every
parameter, one after another in the model's parameter order, stripe s being the rows torch.chunk
gives part s of `stripes` (so with as many stripes as ranks, the rank's shard in model.safetensors);
the other parts hold none. Names lose the wrappers training adds (activation checkpointing's
`_checkpoint_wrapped_module.`, torch.compile's `_orig_mod.`), which are not part of the model.
"""

from __future__ import annotations

import math

import torch
from safetensors import safe_open

from zb.ckpt.durable.state import MODEL, OUTER
from zb.ckpt.format.manifest import Manifest
from zb.errors import InvalidInput
from zb.export.source import Checkpoint
from zb.shard_rows import rows

WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def plain_name(name: str) -> str:
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def _read(part, file_name: str) -> dict[str, torch.Tensor]:
    with safe_open(str(part / file_name), framework="pt") as f:
        return {plain_name(k): f.get_tensor(k) for k in f.keys()}


def shard_shapes(manifest: Manifest) -> dict[str, tuple[int, ...]]:
    """{parameter name: this rank's shard shape}, from the part's committed manifest."""
    return {plain_name(k): tuple(info.shape) for k, info in manifest.files[MODEL].tensors.items()}


def gather(ckpt: Checkpoint, order: list[str], *, inner: bool) -> dict[str, torch.Tensor]:
    """{parameter name: whole tensor} in `order` (the model's parameter names), from the inner params
    (model.safetensors) or the outer params (outer.safetensors, the default when present)."""
    use_outer = ckpt.has_outer and not inner
    shards: dict[str, list[torch.Tensor]] = {name: [] for name in order}
    stripes = _stripe_shapes(ckpt, order) if use_outer else []
    for index, part in enumerate(ckpt.parts):
        if use_outer and index >= len(stripes):
            break                      # ranks beyond the run's stripes hold no outer state
        tensors = _outer_shards(part, stripes[index], order) if use_outer else _read(part, MODEL)
        unknown = sorted(set(tensors) - set(order))
        if unknown:
            raise InvalidInput(f"{part / MODEL} holds {unknown[0]}, which the model built from the checkpoint's "
                               f"config does not have: the checkpoint and its config disagree")
        for name in order:
            if name not in tensors:
                raise InvalidInput(f"{part / MODEL} has no tensor {name}: the checkpoint is incomplete")
            shards[name].append(tensors[name])
    return {name: _concat(name, pieces) for name, pieces in shards.items()}


def _stripe_shapes(ckpt: Checkpoint, order: list[str]) -> list[dict[str, tuple[int, ...]]]:
    """The shape of stripe s of every parameter, for s in 0 .. stripes - 1."""
    per_part = [shard_shapes(m) for m in ckpt.manifests]
    missing = [(i, n) for i, shapes in enumerate(per_part) for n in order if n not in shapes]
    if missing:
        i, name = missing[0]
        raise InvalidInput(f"{ckpt.parts[i] / MODEL} has no tensor {name}: the checkpoint is incomplete")
    stripes = ckpt.manifests[0].meta.get("fingerprint", {}).get("stripes") or len(ckpt.parts)
    if not isinstance(stripes, int) or not 1 <= stripes <= len(ckpt.parts):
        raise InvalidInput(f"{ckpt.parts[0]}: the fingerprint's stripes ({stripes!r}) do not fit its "
                           f"{len(ckpt.parts)} parts: the checkpoint is damaged")
    out = []
    for s in range(stripes):
        shapes = {}
        for name in order:
            first = per_part[0][name]
            if not first:
                shapes[name] = first   # a 0-d tensor is not sharded
                continue
            a, b = rows(sum(p[name][0] for p in per_part), stripes, s)
            shapes[name] = (b - a, *first[1:])
        out.append(shapes)
    return out


def _outer_shards(part, shapes: dict[str, tuple[int, ...]], order: list[str]) -> dict[str, torch.Tensor]:
    with safe_open(str(part / OUTER), framework="pt") as f:
        if "outer/params" not in f.keys():
            raise InvalidInput(f"{part / OUTER} has no outer/params tensor")
        flat = f.get_tensor("outer/params")
    sizes = [math.prod(shapes[n]) for n in order]
    if flat.dim() != 1 or flat.numel() != sum(sizes):
        raise InvalidInput(f"{part / OUTER}: outer/params holds {flat.numel()} values, the rank's shards "
                           f"{sum(sizes)}: the checkpoint is damaged")
    return {n: piece.view(shapes[n]) for n, piece in zip(order, flat.split(sizes))}


def _concat(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    if len(pieces) == 1:
        return pieces[0]
    if any(p.dim() == 0 or p.shape[1:] != pieces[0].shape[1:] for p in pieces):
        raise InvalidInput(f"the ranks' shards of {name} do not fit together ({[list(p.shape) for p in pieces]})")
    return torch.cat(pieces, dim=0)
