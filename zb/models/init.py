"""Deterministic weight init: every node, device and sharding gets bit-identical weights from one seed.

Each parameter's full fp32 value is drawn on the CPU from its own torch.Generator, seeded by
(seed, canonical parameter name). Per-name seeds make the result independent of parameter order and
of wrappers (activation checkpointing, torch.compile) that rename modules. If a parameter is
sharded (a DTensor, as FSDP2 makes it), the ranks of its mesh take turns: one rank draws the full
value and scatters the shards, so a node of 8 ranks draws the model once, in parallel, instead of
8 times each (drawing is single-threaded under torchrun); the numbers are the same as an unsharded
init.

Scheme (torchtitan's): embeddings N(0, 1); input projections trunc-normal std 0.02; output
projections of each block std 0.02 / sqrt(2 * (layer_id + 1)) (depth-scaled); norms 1; the final
output layer trunc-normal std dim^-0.5 cut at 3 std.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, TypeGuard

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

INIT_STD = 0.02
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def param_generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{canonical_name(name)}".encode(), digest_size=8).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def _std_for(name: str, layer_id: int | None, dim: int) -> tuple[str, float]:
    """(kind, std) for a parameter by its canonical name."""
    if name.endswith("norm.weight"):
        return "ones", 0.0
    if name.startswith("tok_embeddings."):
        return "normal", 1.0
    if name.startswith("output."):
        return "trunc", dim ** -0.5
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")):
        assert layer_id is not None  # these live in layers.N
        return "trunc", INIT_STD / (2 * (layer_id + 1)) ** 0.5
    return "trunc", INIT_STD


def full_value(name: str, shape: torch.Size, seed: int, layer_id: int | None, dim: int) -> torch.Tensor:
    """The full fp32 CPU value of one parameter."""
    kind, std = _std_for(canonical_name(name), layer_id, dim)
    out = torch.empty(shape, dtype=torch.float32)
    if kind == "ones":
        return out.fill_(1.0)
    gen = param_generator(seed, name)
    if kind == "normal":
        return out.normal_(0.0, std, generator=gen)
    return nn.init.trunc_normal_(out, 0.0, std, a=-3 * std, b=3 * std, generator=gen)


def _is_dtensor(param: torch.Tensor) -> TypeGuard[DTensor]:
    return hasattr(param, "device_mesh") and hasattr(param, "placements")


def fill_(param: torch.Tensor, full: torch.Tensor, src: int | None = None) -> None:
    """Copy `full` into `param`, or into this rank's slice of it when `param` is a DTensor: scattered
    from mesh rank `src` (the others' `full` only gives the shape), or, with src None, sliced locally
    from a full value every rank computed."""
    if _is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor

        full = full.to(param.device)
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=src).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full.to(param.device))


def layer_id(name: str) -> int | None:
    parts = canonical_name(name).split(".")
    return int(parts[1]) if parts[0] == "layers" else None


@torch.no_grad()
def init_transformer(model: nn.Module, seed: int, dim: int) -> None:
    """Every parameter of `model` (zb's Transformer, of width `dim`) from `seed`, by its name."""
    for index, (name, param) in enumerate(model.named_parameters()):
        if not _is_dtensor(param) or param.device_mesh.ndim != 1:
            fill_(param, full_value(name, param.shape, seed, layer_id(name), dim))
            continue
        src = index % param.device_mesh.size()  # every rank walks the same names in the same order
        mine = param.device_mesh.get_local_rank() == src
        full = (full_value(name, param.shape, seed, layer_id(name), dim) if mine
                else torch.empty(param.shape, dtype=torch.float32))
        fill_(param, full, src=src)
