"""What issue 40's checks cost: the outer step of 3 blocking DiLoCo nodes (real DilocoNodes over real gloo groups in
one process, tests/fake_world.py) with diloco.clip off, with clip as it was before the checked average (the check
switched off), with the checked average, and with the checked average while one node sends 30x its update under an
honest norm (the halves reduced again). Plus the per-resolution cost of keeping the run marker (one compare_set)
and of setting the listener's filter. Ratios are against clip off, measured in the same run.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_insider.py [--params 2000000] [--rounds 6] [--repeats 3]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fake_world import TinyModel, start_world, together  # noqa: E402  (tests/, on the path above)

from zb.diloco.blocking import BlockingAlgorithm  # noqa: E402


def width_for(params: int, blocks: int = 4) -> int:
    """The TinyModel width whose blocks hold about `params` parameters."""
    return max(8, int((params / blocks) ** 0.5))


def outer_step_s(mode: str, width: int, rounds: int) -> float:
    """Median seconds of one outer step (every node's, wall) over `rounds` rounds."""
    flags = {} if mode == "off" else {"diloco.clip": "2"}
    world, nodes = start_world(["a", "b", "c"], width=width, **flags)
    numel = sum(p.numel() for p in nodes[0].model.parameters())
    g = torch.Generator().manual_seed(0)
    if mode == "liar":
        honest = nodes[1].diloco.steps._norm
        nodes[1].diloco.steps._norm = lambda: honest() / 30.0
    times = []
    for _ in range(rounds):
        for i, node in enumerate(nodes):
            move = torch.randn(numel, generator=g) * 0.01
            node.train(move * 30 if mode == "liar" and i == 1 else move)
        t0 = time.perf_counter()
        together(nodes, lambda n: n.outer_step())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=2_000_000, help="parameters of each node's model")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    logging.getLogger("zb").setLevel(logging.CRITICAL)   # the liar's lines, each round, on every node
    width = width_for(args.params)
    honest_passes = BlockingAlgorithm._passes
    rows: dict[str, list[float]] = {m: [] for m in ("off", "clip-unchecked", "clip-checked", "liar")}
    for _ in range(args.repeats):
        for mode in rows:
            if mode == "clip-unchecked":
                BlockingAlgorithm._passes = lambda self, view, plan, part, residual: True   # type: ignore[method-assign]
            rows[mode].append(outer_step_s("liar" if mode == "liar" else "clip" if mode != "off" else "off",
                                           width, args.rounds))
            BlockingAlgorithm._passes = honest_passes   # type: ignore[method-assign]
    params = sum(p.numel() for p in TinyModel(width=width).parameters())

    from zb.elastic.tcpstore import host
    from zb.signed_store import MARKER

    store = host("127.0.0.1", 0)
    store.compare_set(MARKER, "", b'{"nonce": "ab"}')
    t0 = time.perf_counter()
    for _ in range(200):
        store.compare_set(MARKER, "", b'{"nonce": "ab"}')
    keep_marker_us = (time.perf_counter() - t0) / 200 * 1e6

    from zb.elastic.listener_guard import attach

    listener = socket.create_server(("127.0.0.1", 0))
    t0 = time.perf_counter()
    for i in range(200):
        attach(listener.fileno(), [f"10.0.{i % 200}.{j}" for j in range(1, 33)])
    filter_us = (time.perf_counter() - t0) / 200 * 1e6
    listener.close()

    from zb.diloco.clip import squared_norm

    buffer = torch.randn(params)
    t0 = time.perf_counter()
    for _ in range(20):
        squared_norm(buffer)
    norm_ms = (time.perf_counter() - t0) / 20 * 1e3

    base = statistics.median(rows["off"])
    print(f"3 nodes, {params:,} params each, blocking DiLoCo, {args.rounds} outer steps x {args.repeats} repeats "
          "(median seconds per outer step; spread over repeats)")
    print(f"{'configuration':34s} {'s/outer step':>12s} {'x clip off':>10s} {'spread':>16s}")
    out = {"params": params, "rounds": args.rounds, "repeats": args.repeats}
    for mode, label in (("off", "diloco.clip off"), ("clip-unchecked", "clip 2, without the check (before)"),
                        ("clip-checked", "clip 2, checked average"), ("liar", "clip 2, checked, one liar x30")):
        med = statistics.median(rows[mode])
        print(f"{label:34s} {med:12.4f} {med / base:10.2f} {min(rows[mode]):7.4f}-{max(rows[mode]):.4f}")
        out[mode] = {"median_s": round(med, 5), "ratio": round(med / base, 3),
                     "spread": [round(min(rows[mode]), 5), round(max(rows[mode]), 5)]}
    print(f"the check's own work on each node: one squared norm of the average, {norm_ms:.2f} ms for {params:,} values "
          "(the in-process rows above run the 3 nodes' on the same cores)")
    out["norm_ms"] = round(norm_ms, 3)
    print(f"keep_marker: one compare_set a resolution on the leader, {keep_marker_us:.0f} us on loopback")
    print(f"elastic.peer_filter: setting a 32-address filter on the listener, {filter_us:.1f} us (once a new world)")
    out["keep_marker_us"], out["peer_filter_us"] = round(keep_marker_us, 1), round(filter_us, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
