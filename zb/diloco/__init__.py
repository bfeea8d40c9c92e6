"""DiLoCo across elastic nodes: CPU outer state and optimizer, bucketed pseudo-gradient sync over
each replica group, joiners (blocking transfer or live recovery), data slots.

`zb.diloco.node.DilocoNode` is what the training loop uses; the rest are its parts.
"""
