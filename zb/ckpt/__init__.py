"""Snapshots and checkpoints, the HTTP sidecar that serves them, and the live-recovery client.

A snapshot is a directory of safetensors files plus `manifest.json` (step, run fingerprint, per-file
size, sha256 and tensor table, caller metadata) and a `COMMITTED` marker written last. Nothing that
comes from a peer is ever unpickled: tensors travel as safetensors, everything else as JSON.

Modules: manifest (format, parsing, name rules), catalog (commit, list, verify, latest, prune),
tensorfile (streaming safetensors writer), snapshot (write/load tensors), serve + http_util (HTTP
sidecar), sidecar (the `zb ckpt-serve` process), token (the shared secret), publish (sidecar
address in the global store), fetch + download + peer + prefix_hash + progress (live recovery),
ramdir (who owns a RAM staging directory; removing those of runs that are gone).
"""
