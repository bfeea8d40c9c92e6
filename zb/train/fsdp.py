"""Shard the model over the node's local ranks with FSDP2: one `fully_shard` per block plus the root.

A lone process (local world size 1) keeps the plain module: sharding over one rank only adds
copies. Mixed precision then comes from autocast instead of FSDP2's policy (see `autocast`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

from zb.config_schema import TrainConfig
from zb.train.device import Placement

log = logging.getLogger("zb.train")

_Model = TypeVar("_Model", bound=nn.Module)


def apply_activation_checkpointing(model: nn.Module, every: int = 1) -> int:
    """Recompute the activations of every `every`-th block (blocks 0, every, 2*every, ...) in backward:
    memory for compute. Returns how many blocks were wrapped."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = 0
    layers = cast(nn.ModuleList, model.layers)   # the model's blocks (zb.models.llama.Transformer.layers)
    for i, block in enumerate(layers):
        if i % every == 0:
            layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
            wrapped += 1
    return wrapped


def shard_model(model: _Model, cfg: TrainConfig, placement: Placement) -> _Model:
    """With several local ranks, apply FSDP2 per block and at the root (the model may be on the meta
    device: the caller then allocates with `to_empty` and initialises the shards)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if cfg.fsdp_cpu_offload:
            log.warning("train.fsdp_cpu_offload has no effect: a lone process is not sharded; start 2 or more "
                        "local ranks to offload")
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(placement.device.type, (dist.get_world_size(),))
    # Blocks get their inputs uncast: the activations already arrive in param_dtype from the
    # embedding, and the RoPE tables must stay fp32 as they do on one device (a bf16 cos/sin table
    # loses precision at large positions). The root's input is token ids, which no cast touches.
    block_mp = MixedPrecisionPolicy(param_dtype=placement.param_dtype, reduce_dtype=placement.reduce_dtype,
                                    cast_forward_inputs=False)
    root_mp = MixedPrecisionPolicy(param_dtype=placement.param_dtype, reduce_dtype=placement.reduce_dtype)
    offload = OffloadPolicy()
    if offloads(cfg, placement):
        # Sharded params, their gradients and the optimizer state stay in pinned host memory; each
        # block's shards are copied to the GPU for its all-gather and its gradients back after.
        offload = CPUOffloadPolicy(pin_memory=True)
    elif cfg.fsdp_cpu_offload and dist.get_rank() == 0:
        log.warning("train.fsdp_cpu_offload has no effect on a CPU run: params are in host memory already")
    blocks = list(cast(nn.ModuleList, model.layers))   # the model's blocks (Transformer.layers)
    for i, block in enumerate(blocks):
        # The last block's params are needed again right away by backward: keep them gathered.
        reshard = cfg.reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=block_mp, reshard_after_forward=reshard, offload_policy=offload)
    # None lets FSDP2 keep the root's params (embeddings, final norm, output) gathered from forward
    # to backward, as it does by default: resharding them only to gather them again at once costs
    # one all-gather per micro batch. Evaluation reshards explicitly (see `reshard`).
    fully_shard(model, mesh=mesh, mp_policy=root_mp, reshard_after_forward=None if cfg.reshard_after_forward else False,
                offload_policy=offload)
    return model


def offloads(cfg: TrainConfig, placement: Placement) -> bool:
    """Whether FSDP2 keeps the shards in host memory (CUDA runs with several local ranks)."""
    return cfg.fsdp_cpu_offload and placement.device.type == "cuda" and dist.is_initialized() and \
        dist.get_world_size() > 1


def materialize(model: nn.Module, cfg: TrainConfig, placement: Placement) -> None:
    """Allocate a meta-device model's (sharded) params where they live: the device, or host memory
    under CPU offload. Buffers (the RoPE tables) always go to the device, where the blocks compute."""
    if not offloads(cfg, placement):
        model.to_empty(device=placement.device)
        return
    model.to_empty(device="cpu")
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            module.register_buffer(name, buffer.to(placement.device), persistent=name not in
                                   module._non_persistent_buffers_set)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def reshard(model: nn.Module) -> None:
    """Free the gathered params a forward left behind, so the model holds only its own shards again.

    Training reshards in backward, but a forward without one (evaluation under no_grad) leaves every
    FSDP module that keeps its params after forward (the last block, the root) gathered: state
    dicts, checkpoints and the outer step would then see full tensors instead of shards.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def unsharded_params(model: nn.Module) -> list[str]:
    """Names of params of a sharded model that are not in their sharded (DTensor) form."""
    if not is_sharded(model):
        return []
    from torch.distributed.tensor import DTensor

    return [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]


def autocast(model: nn.Module, placement: Placement):
    """bf16 compute for an unsharded model (FSDP2 handles it through its policy otherwise)."""
    if is_sharded(model) or placement.param_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=placement.device.type, dtype=placement.param_dtype)
