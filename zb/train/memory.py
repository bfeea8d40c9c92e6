"""Refuse, before allocating anything, a model that the node's memory cannot hold.

A lower bound, counted from the parameter count alone (activations, buffers and the allocator's
slack come on top): per parameter, the fp32 param, its fp32 gradient and AdamW's two moments are 16
bytes, sharded over the node's local ranks by FSDP2 (on the host instead with
train.fsdp_cpu_offload); DiLoCo adds 12 bytes per parameter of outer state on the host (outer
params, momentum, pseudo-gradient; zb.diloco.outer), split over the node's stripes. A GPU is
checked against its own total memory, the host against the machine's RAM, shared by every local
rank of the node. A node that cannot pass this would die later anyway, by the kernel's OOM killer
(no message at all) or deep in an allocation: here it is one line and exit 2.
"""

from __future__ import annotations

from zb.config import fail
from zb.config_schema import Config

MODEL_STATE_BYTES = 16      # fp32 param + fp32 grad + AdamW exp_avg + exp_avg_sq
OUTER_STATE_BYTES = 12      # outer params + outer momentum + pseudo-gradient (fp32, CPU)


def needs(cfg: Config, params: int, local_world_size: int, device_type: str) -> tuple[int, int]:
    """(bytes per device, bytes on the host for the whole node)."""
    state = MODEL_STATE_BYTES * params
    outer = OUTER_STATE_BYTES * params if cfg.diloco is not None else 0
    if device_type in ("cpu", "mps") or cfg.train.fsdp_cpu_offload:   # MPS: unified memory, one pool
        return 0, state + outer
    return -(-state // local_world_size), outer


def check_memory(cfg: Config, params: int, local_world_size: int, device_type: str, device_total: int | None,
                 host_total: int | None) -> None:
    """InvalidInput (exit 2) naming model.name when the bound exceeds what the machine has."""
    per_device, host = needs(cfg, params, local_world_size, device_type)

    def gb(n: int) -> str:
        return f"{n / 1e9:.1f} GB"

    more = "more local ranks (--nproc-per-node) or train.fsdp_cpu_offload" if device_type == "cuda" else \
        "more machines (a DiLoCo-SWARM run splits the model into stages)"
    if device_total and per_device > device_total:
        fail(cfg, "model.name", f"{params:,} params need at least {gb(per_device)} per GPU for params, gradients and "
                                f"AdamW state ({MODEL_STATE_BYTES} bytes per param over {local_world_size} local "
                                f"rank(s)), and this GPU has {gb(device_total)}: use {more}, or a smaller model")
    if host_total and host > host_total:
        parts = []
        if per_device == 0:
            parts.append(f"{MODEL_STATE_BYTES} bytes per param of params, gradients and AdamW state")
        if cfg.diloco is not None:
            parts.append(f"{OUTER_STATE_BYTES} bytes per param of DiLoCo outer state")
        fail(cfg, "model.name", f"{params:,} params need at least {gb(host)} of this machine's memory "
                                f"({' and '.join(parts)}), and it has {gb(host_total)}: use {more}, or a smaller "
                                "model")


def params_before_tokenizer(cfg: Config) -> int:
    """The model's parameter count before its tokenizer is known (it may have to be downloaded):
    exact with model.vocab_size, else every param except the embedding and output rows. A lower
    bound, so the memory check can run before any download."""
    import torch

    from zb.models import Transformer, count_params, model_args

    args = model_args(cfg.model, vocab_size=cfg.model.vocab_size or 1, max_seq_len=cfg.data.seq_length)
    with torch.device("meta"):
        return count_params(Transformer(args))


def machine_totals(device) -> tuple[int | None, int | None]:
    """(total bytes of `device` when it is a GPU, total RAM of this machine); None where unknown."""
    import psutil
    import torch

    device_total = None
    if device.type == "cuda":
        device_total = torch.cuda.get_device_properties(device).total_memory
    try:
        host_total = psutil.virtual_memory().total
    except (OSError, AttributeError):
        host_total = None
    return device_total, host_total
