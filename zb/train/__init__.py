"""The training loop: FSDP2 over a node's local ranks, inner optimizer and LR schedules.

`zb.train.run.run(cfg)` is the entry point; everything else is a small piece of it.
"""
