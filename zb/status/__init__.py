"""Watching a run: each node's status record in the store, and what reads it.

    record     the record and history a node keeps from its own metrics events (bounded)
    publisher  the thread that writes them to the store (`publish_status` wraps a metrics sink)
    reader     one read of the run from the store: every node's state, the run's figures
    history    the dashboard's longer, bounded curves, merged from refreshes
    server     the dashboard: a sampler thread and a read-only HTTP server
    page       the one self-contained HTML page (live, or a static report)
    report     the same document from metrics.jsonl files of a finished run
    listing    what `zb status` shows of a store: one run, or the list of every run on it (zb.elastic.runs)

Imports: status -> elastic (keys, store helpers), errors, dial; nothing here imports train or cli.
"""
