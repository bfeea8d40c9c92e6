"""Live recovery, the client side: fetch the current snapshot from live peers' sidecars.

fetch (choose peers, verify, commit locally), ranged (parallel ranged downloads from several peers
with fallback), peer (one keep-alive connection), prefix_hash (hash while writing out of order),
progress (a bar on a terminal, log lines otherwise).
"""
