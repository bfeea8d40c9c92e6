"""The snapshot format: a directory of safetensors files, `manifest.json` and a `COMMITTED` marker.

manifest (what a snapshot holds, name rules, safe to take from a peer), catalog (commit, list,
verify, latest, prune; torch-free), tensorfile (streaming safetensors writer that hashes as it
writes), snapshot (write and load tensors). Nothing here knows about training or the network.
"""
