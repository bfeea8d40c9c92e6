"""Driver for tests/test_train_gpu_paths.py: what FSDP2 does to a 2-rank bf16 model on CPU.

Run under `torchrun --nproc_per_node 2`; prints one JSON line from local rank 0: the dtype of the
RoPE tables each block's attention receives, which params a no-grad forward leaves gathered (before
and after zb.train.fsdp.reshard), and whether the root keeps its params between forward and backward.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from zb.config import load_config
from zb.local_world import local_world
from zb.train.device import close_local_group, init_local_group, pick_placement
from zb.train.fsdp import reshard, unsharded_params
from zb.train.setup import build_model


def init_differences(model, cfg) -> list[str]:
    """Names whose gathered value differs, bit for bit, from the whole model built and initialised on
    the CPU (the init before meta-device building); the RoPE buffers included."""
    from zb.models import Transformer, model_args

    reference = Transformer(model_args(cfg.model, vocab_size=320, max_seq_len=cfg.data.seq_length))
    reference.init_weights(cfg.train.seed)
    ref = dict(reference.named_parameters()) | dict(reference.named_buffers())
    mine = dict(model.named_parameters()) | dict(model.named_buffers())
    full = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach() for n, t in mine.items()}
    assert set(full) == set(ref), (set(full) ^ set(ref))
    return [n for n in ref if not torch.equal(full[n].cpu(), ref[n].detach())]


def main() -> None:
    local = local_world()
    cfg = load_config([], {"train.device": "cpu", "train.param_dtype": "bf16", "data.seq_length": "32"}, environ={})
    placement = pick_placement(cfg.train, local)
    init_local_group(local, placement)
    model = build_model(cfg, 320, placement)
    out = {"init_differs": init_differences(model, cfg)}
    seen: list[str] = []
    for block in model.layers:
        block.attention.register_forward_pre_hook(lambda m, args: seen.append(str(args[1].dtype)))
    tokens = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(local.rank))
    logits = model(tokens)
    out["rope_dtypes"] = sorted(set(seen))
    out["gathered_between_forward_and_backward"] = unsharded_params(model)
    logits.float().square().mean().backward()
    out["gathered_after_backward"] = unsharded_params(model)
    with torch.no_grad():
        model(tokens)
    out["gathered_after_no_grad_forward"] = unsharded_params(model)
    reshard(model)
    out["gathered_after_reshard"] = unsharded_params(model)
    if local.is_head:
        print(json.dumps(out), flush=True)
    close_local_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
