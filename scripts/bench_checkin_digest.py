"""What the check-in's params digest (diloco.drift_guard, on by default) costs per outer step.

Every outer step each rank hashes its shard of the fp32 outer params (sha256, read in place) so the
check-in can refuse a node whose params are not the run's. The hash starts in a thread right after
an outer step and overlaps the inner steps; the check-in waits only for what is left of it.

Measured on one buffer in one run: the synchronous hash against a memcpy of the buffer (the
machine's speed right now) and against the old path that copied it through tobytes() first; then
what the check-in waits for when the hash ran beside `--inner-s` seconds of inner-step-like work
(matmuls in the main thread, which also drop the GIL). Beside it, the int8 all-reduce the outer step
does anyway: a ring moves about 2 x (n-1)/n x 1 byte per value, at `--mbps`.

Run: PYTHONPATH=. python scripts/bench_checkin_digest.py [--mparams 100] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time

import torch


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mparams", type=float, default=100.0, help="shard size in millions of fp32 values")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=4, help="nodes in the ring, for the all-reduce estimate")
    parser.add_argument("--mbps", type=float, default=100.0, help="link speed for the all-reduce estimate")
    parser.add_argument("--inner-s", type=float, default=2.0, help="seconds of work the hash overlaps")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)

    from zb.diloco.drift import BackgroundDigest, digest

    flat = torch.randn(int(args.mparams * 1e6))
    out = torch.empty_like(flat)
    memcpy = _best(lambda: out.copy_(flat), args.repeats)
    new = _best(lambda: digest(flat), args.repeats)
    old = _best(lambda: hashlib.sha256(flat.numpy().tobytes()).digest(), args.repeats)
    alone = statistics.median(_inner_work(args.inner_s) for _ in range(args.repeats))
    runs = [_waited(BackgroundDigest, flat, args.inner_s) for _ in range(args.repeats)]
    exposed, beside = min(w for w, _ in runs), statistics.median(d for _, d in runs)
    wire_s = 2 * (args.nodes - 1) / args.nodes * flat.numel() * 8 / (args.mbps * 1e6)
    doc = {"bench": "checkin_digest", "numel": flat.numel(), "memcpy_s": round(memcpy, 4), "digest_s": round(new, 4),
           "old_digest_s": round(old, 4), "exposed_after_overlap_s": round(exposed, 4), "inner_s": args.inner_s,
           "inner_work_beside_hash_vs_alone": round(beside / alone, 3), "digest_vs_memcpy": round(new / memcpy, 2),
           "old_vs_new": round(old / new, 2), "allreduce_s_estimate": round(wire_s, 2),
           "digest_share_of_allreduce": round(new / wire_s, 4),
           "exposed_share_of_allreduce": round(exposed / wire_s, 4), "nodes": args.nodes, "mbps": args.mbps,
           "threads": torch.get_num_threads(), "load": round(statistics.mean(_loadavg()), 2)}
    if not args.json:
        print(f"{'shard':>10} {'memcpy':>8} {'digest':>8} {'old digest':>10} {'digest/memcpy':>13} {'old/new':>7} "
              f"{'waited':>8} {'int8 all-reduce':>15} {'digest share':>12} {'waited share':>12}", file=sys.stderr)
        print(f"{flat.numel() / 1e6:>9.0f}M {memcpy:>7.3f}s {new:>7.3f}s {old:>9.3f}s {new / memcpy:>13.2f} "
              f"{old / new:>7.2f} {exposed:>7.3f}s {wire_s:>14.1f}s {new / wire_s:>12.2%} {exposed / wire_s:>12.2%}",
              file=sys.stderr)
    print(json.dumps(doc))
    return doc


def _inner_work(inner_s: float) -> int:
    """Matmuls for `inner_s` seconds, standing in for inner steps; returns how many were done."""
    a, done = torch.randn(512, 512), 0
    end = time.perf_counter() + inner_s
    while time.perf_counter() < end:
        a = (a @ a).clamp_(-1, 1)
        done += 1
    return done


def _waited(background, flat: torch.Tensor, inner_s: float) -> tuple[float, int]:
    """Start the hash, do `inner_s` of inner work beside it; (the wait for the hash after it, work done)."""
    pending = background(flat)
    done = _inner_work(inner_s)
    t0 = time.perf_counter()
    pending.result()
    return time.perf_counter() - t0, done


def _loadavg() -> list[float]:
    try:
        import os

        return list(os.getloadavg())
    except OSError:
        return [0.0]


if __name__ == "__main__":
    main()
