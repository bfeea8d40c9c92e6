"""zb: train language models across poorly connected machines.

FSDP2 shards the model over a node's local ranks; DiLoCo syncs nodes every H inner steps over an
elastic set of nodes coordinated through one global TCPStore.
"""

__version__ = "0.1.0"
