"""DiLoCo-SWARM: `zb train` with a [swarm] table is one stage worker of a pipelined run (zb.swarm.worker).

Modules: stages (the block split, a stage as a module), wire (tensors behind a checked header over TCP),
router (throughput-aware routing), registry (the swarm's store keys), server (a later stage's requests),
client (the first stage's hops), worker (shared setup, inner and outer steps), first and later (the roles).
"""
