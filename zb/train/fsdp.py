"""Shard the model over the node's local ranks with FSDP2: one `fully_shard` per block plus the root.

A lone process (local world size 1) keeps the plain module: sharding over one rank only adds
copies. Mixed precision then comes from autocast instead of FSDP2's policy (see `autocast`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from zb.config_schema import TrainConfig
from zb.train.device import Placement


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward: memory for compute."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def shard_model(model: nn.Module, cfg: TrainConfig, placement: Placement) -> nn.Module:
    """With several local ranks, apply FSDP2 per block and at the root (the model may be on the meta
    device: the caller then allocates with `to_empty` and initialises the shards)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(placement.device.type, (dist.get_world_size(),))
    # Blocks get their inputs uncast: the activations already arrive in param_dtype from the
    # embedding, and the RoPE tables must stay fp32 as they do on one device (a bf16 cos/sin table
    # loses precision at large positions). The root's input is token ids, which no cast touches.
    block_mp = MixedPrecisionPolicy(param_dtype=placement.param_dtype, reduce_dtype=placement.reduce_dtype,
                                    cast_forward_inputs=False)
    root_mp = MixedPrecisionPolicy(param_dtype=placement.param_dtype, reduce_dtype=placement.reduce_dtype)
    blocks = list(model.layers)
    for i, block in enumerate(blocks):
        # The last block's params are needed again right away by backward: keep them gathered.
        reshard = cfg.reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=block_mp, reshard_after_forward=reshard)
    # None lets FSDP2 keep the root's params (embeddings, final norm, output) gathered from forward
    # to backward, as it does by default: resharding them only to gather them again at once costs
    # one all-gather per micro batch. Evaluation reshards explicitly (see `reshard`).
    fully_shard(model, mesh=mesh, mp_policy=root_mp, reshard_after_forward=None if cfg.reshard_after_forward else False)
    return model


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
