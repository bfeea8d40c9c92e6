"""What zb's tests and scripts share (like torch.testing): the process helpers (zb.testing.procs: the
checkout root, free ports, a clean child environment, bounded waits, the tiny-model arguments, `zb` as
a real process), the multi-node harness (zb.testing.cluster: a real `zb store` and real node
processes), and stop signals (zb.testing.pause: a command held at a function until a signal;
zb.testing.stops: every command stopped at a point of its life).

Used only from a source checkout: the harness starts scripts that live in tests/ (tests/elastic_node.py,
tests/drivers/), addressed by path from the checkout root. The top layer: nothing else in zb imports
zb.testing, and it imports nothing from tests/ or scripts/.
"""
