"""Snapshots and checkpoints, the HTTP sidecar that serves them, and the live-recovery client.

A snapshot is a directory of safetensors files plus `manifest.json` (step, run fingerprint, per-file
size, sha256 and tensor table, caller metadata) and a `COMMITTED` marker written last. Nothing that
comes from a peer is ever unpickled: tensors travel as safetensors, everything else as JSON.

Subpackages, each importing only those listed before it:
  format    the snapshot format (manifest, catalog, tensorfile, snapshot);
  durable   checkpoints of a training run (manager, state, worker, copies, remote, layout, agree, ramdir);
  recovery  the live-recovery client that fetches from peers' sidecars;
  sidecar   the HTTP server for joiners and the `zb ckpt-serve` process.
"""
