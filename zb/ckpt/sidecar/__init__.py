"""The checkpoint sidecar: read-only HTTP access to committed snapshots, for joiners.

server (the HTTP server), http (request parsing and byte ranges), process (the `zb ckpt-serve`
process), token (the shared secret), publish (the sidecar's address in the global store).
"""
