"""Driver for tests/test_ckpt_durable.py: train, checkpoint, resume in a new process.

    python tests/drivers/ckpt_resume.py MODE CKPT_DIR STEPS [die]
    torchrun --nproc_per_node 2 tests/drivers/ckpt_resume.py MODE CKPT_DIR STEPS

MODE first: 2 x STEPS steps with a checkpoint after STEPS (the uninterrupted reference run).
resume: `ckpt.resume latest`, then train until step 2 x STEPS. With `die`, first then checkpoints
step 2 x STEPS and exits hard (os._exit 9) in the middle of its copy to disk: that step is complete
only in RAM, so the resume's start copies it to disk and resumes from it (nothing left to train).
The builtin data loader covers the data position; a one-node DiLoCo outer step every OUTER_EVERY
steps (no all-reduce) covers the outer params and momentum. Every rank prints one JSON line:
its losses and a sha256 of its parameter shards, into CKPT_DIR/out-MODE-RANK.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from zb.ckpt.durable.manager import CheckpointManager, TrainState
from zb.config import load_config, to_dict
from zb.config_schema import DilocoConfig
from zb.data import build_dataloader, build_tokenizer
from zb.diloco.outer import OuterState
from zb.fingerprint import fingerprint
from zb.local_world import local_world
from zb.metrics import MetricsSink
from zb.position import RunPosition
from zb.train.device import close_local_group, init_local_group, pick_placement
from zb.train.lr_schedule import build_optimizer, build_scheduler
from zb.train.setup import build_model, check_batch
from zb.train.step import Trainer, take

OUTER_EVERY = 2


def outer_step(outer: OuterState) -> None:
    for i in range(len(outer.params)):
        outer.pseudo_gradient_of(i)
    outer.step()
    outer.push_to_model()


def params_sha(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for _, p in model.named_parameters():
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def die_during_next_copy(manager: CheckpointManager, step: int, state: TrainState) -> None:
    """Let the pending checkpoint commit, then crash (os._exit) in the middle of copying checkpoint `step`."""
    import zb.ckpt.durable.copies as durable

    assert manager.wait(60)
    real = durable.copy_file

    def copy_then_die(src, dst):
        real(src, dst)
        os._exit(9)

    durable.copy_file = copy_then_die
    manager.save(step, state)
    manager.wait(60)
    raise AssertionError("the copy did not run")


def main() -> None:
    mode, ckpt_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    die = len(sys.argv) > 4 and sys.argv[4] == "die"
    local = local_world()
    cfg = load_config([], {"model.name": "debug", "train.micro_bs": "2", "optim.batch_size": "4",
                           "data.seq_length": "32", "optim.warmup_steps": "2", "optim.total_steps": "20",
                           "optim.lr": "1e-2", "train.device": "cpu", "ckpt.path": f"{ckpt_dir}/disk",
                           "ckpt.ram_dir": f"{ckpt_dir}/ram", "ckpt.interval": str(steps), "ckpt.topk": "2",
                           "ckpt.resume": "latest" if mode == "resume" else ""}, environ={})
    placement = pick_placement(cfg.train, local)
    init_local_group(local, placement)
    accum = check_batch(cfg, local)
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg, tokenizer.vocab_size, placement)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim)
    trainer = Trainer(model, optimizer, scheduler, placement, 1.0, 0.0)
    loader = build_dataloader(cfg.data, tokenizer, micro_bs=2, seq_length=32, data_rank=0, data_world_size=1,
                              local_rank=local.rank, local_world_size=local.world_size, seed=cfg.train.seed)
    outer = OuterState(model, DilocoConfig())
    vocab = model.tok_embeddings.num_embeddings
    at = RunPosition()

    def state() -> TrainState:
        return TrainState(model, optimizer, scheduler, at, data_state=loader.state_dict(),
                          outer=outer.state_tensors(), config=to_dict(cfg),
                          fingerprint=fingerprint(cfg, local.world_size, vocab), data_exact=loader.exact_resume)

    sink = MetricsSink(f"{ckpt_dir}/log-{mode}", f"node-{local.rank}", enabled=True)
    manager = CheckpointManager(cfg.ckpt, uid="node", local_rank=local.rank, local_world_size=local.world_size,
                                sink=sink, retry_delay=0.05)
    end, save_at = 2 * steps, steps
    if mode == "resume":
        resumed = manager.resume(state())
        at = resumed.position
        loader.load_state_dict(resumed.data_state)
        outer.load_state_tensors(resumed.outer)
        save_at = -1
    losses = []
    while at.step < end:
        losses.append(trainer.train_step(take(loader, accum)).loss)
        at = replace(at, step=at.step + 1)
        if at.step % OUTER_EVERY == 0:
            outer_step(outer)
            at = replace(at, outer_step=at.outer_step + 1)
        if at.step == save_at:
            manager.save(at.step, state())
    # A file per rank: torchrun interleaves the ranks' stdout, even within a line.
    result = {"rank": local.rank, "losses": losses, "params": params_sha(model), "step": at.step}
    Path(ckpt_dir, f"out-{mode}-{local.rank}.json").write_text(json.dumps(result))
    if die:
        die_during_next_copy(manager, at.step, state())
    manager.close()
    close_local_group()


if __name__ == "__main__":
    main()
