"""What the run secret (elastic.secret_file) costs per outer step (issue 27).

Three measurements, each against the same thing without a secret (or before scrypt) in the same run:
- derive: the secret's scrypt (zb.secret.stretched: what a node pays once per process, and what each offline
  guess of a secret now costs) against one HMAC-SHA256 (what a guess cost before), median of 5 fresh secrets.
- ops: one process, a store on loopback; N rounds of set + check + get of a status-sized record (400 bytes)
  and an append + get of a join-list line, through a plain client and through a sealed one (zb.signed_store).
  Per-operation microseconds and the ratio.
- run: `--nodes` `zb train` nodes (tiny debug model, H = 5, loopback) around a `zb store`, with and without a
  secret, alternating which goes first per repeat. From the nodes' own outer_step events: resolve_s (the
  store's roll call: most of a boundary's store traffic) and boundary_s (the whole outer step), medians over
  the outer steps after the first two; and from outside zb: the run's wall time, process start to exit.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_secret.py --nodes 3 --repeats 3 --steps 60

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from zb.elastic import keys
from zb.secret import write_new_secret
from zb.signed_store import authenticated
from zb.testing.cluster import TrainCluster


def ops(rounds: int) -> dict:
    """Microseconds per store operation, plain and sealed, over one loopback store."""
    import torch.distributed as dist

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)

    def client():
        return dist.TCPStore("127.0.0.1", host.port, is_master=False, use_libuv=True, timeout=timedelta(seconds=30))

    record, line = "x" * 400, json.dumps({"uid": "n0", "token": "t" * 16, "pref_rank": 0}) + "\n"
    stores = {"plain": client(), "sealed": authenticated(client(), b"s" * 32, "bench", keys.is_counter)}
    out = {}
    for name, store in stores.items():
        started = time.perf_counter()
        for i in range(rounds):
            store.set(f"{name}/status/{i % 8}", record)
            store.check([f"{name}/status/{i % 8}"])
            store.get(f"{name}/status/{i % 8}")
            store.append(f"{name}/joins", line)
        store.get(f"{name}/joins")
        out[f"{name}_us"] = (time.perf_counter() - started) / (4 * rounds) * 1e6
    out["ratio"] = out["sealed_us"] / out["plain_us"]
    return out


def derive(samples: int = 5) -> dict:
    """Seconds of one scrypt of a fresh secret against one HMAC of it: the cost of a guess, then and now."""
    import hashlib
    import hmac
    import os

    from zb.secret import stretched

    slow, fast = [], []
    for _ in range(samples):
        secret = os.urandom(32)
        started = time.perf_counter()
        stretched(secret)
        slow.append(time.perf_counter() - started)
        started = time.perf_counter()
        for _ in range(1000):
            hmac.new(secret, b"zb run marker\x00nonce", hashlib.sha256).digest()
        fast.append((time.perf_counter() - started) / 1000)
    scrypt_s, hmac_s = statistics.median(slow), statistics.median(fast)
    return {"scrypt_s": scrypt_s, "hmac_s": hmac_s, "guess_cost_ratio": scrypt_s / hmac_s,
            "scrypt_spread_s": [min(slow), max(slow)]}


def one_run(tmp: Path, nodes: int, steps: int, secret: bool) -> dict:
    env = {}
    if secret:
        write_new_secret(tmp / "run.secret")
        env["ZB_ELASTIC_SECRET_FILE"] = str(tmp / "run.secret")
    run = TrainCluster(tmp, nodes, **env)
    uids = [f"n{i}" for i in range(nodes)]
    try:
        started = time.monotonic()
        for i, uid in enumerate(uids):
            run.start_train(uid, "--optim.total_steps", str(steps), rank=i)
        for uid in uids:
            code = run.finish(uid, timeout=600)
            if code != 0:
                raise SystemExit(f"node {uid} exited {code}:\n{run.log(uid)}")
        wall = time.monotonic() - started
        events = [e for u in uids for e in run.metrics(u, "outer_step")[2:]]
        return {"secret": secret, "nodes": nodes, "steps": steps, "wall_s": round(wall, 3),
                "resolve_s": statistics.median(e["resolve_s"] for e in events),
                "boundary_s": statistics.median(e["boundary_s"] for e in events), "outer_steps": len(events)}
    finally:
        run.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--op-rounds", type=int, default=2000)
    args = p.parse_args(argv)
    if args.repeats < 0:
        p.error("--repeats must be 0 or more (0: the store operations and the derivation only)")
    dv = derive()
    print(f"secret derivation: scrypt {dv['scrypt_s'] * 1e3:.0f} ms once per process "
          f"({dv['scrypt_spread_s'][0] * 1e3:.0f}-{dv['scrypt_spread_s'][1] * 1e3:.0f}), one HMAC "
          f"{dv['hmac_s'] * 1e6:.1f} us: an offline guess costs x{dv['guess_cost_ratio']:.0f} what it did")
    op = ops(args.op_rounds)
    pairs = []
    with tempfile.TemporaryDirectory(prefix="zb-secret-") as tmp:
        for r in range(args.repeats):
            pair = {}
            for secret in ((False, True) if r % 2 == 0 else (True, False)):
                where = Path(tmp) / f"{r}-{'secret' if secret else 'plain'}"
                where.mkdir()
                pair[secret] = one_run(where, args.nodes, args.steps, secret)
                print(f"[secret] {json.dumps(pair[secret])}", file=sys.stderr, flush=True)
            pairs.append({f: pair[True][f] / pair[False][f] for f in ("wall_s", "resolve_s", "boundary_s")}
                         | {"plain": pair[False], "secret": pair[True]})
    print(f"store ops: plain {op['plain_us']:.0f} us, sealed {op['sealed_us']:.0f} us per operation "
          f"(x{op['ratio']:.2f}; {args.op_rounds} rounds of set/check/get/append)")
    print(f"{'repeat':>6s} {'resolve s plain':>16s} {'secret':>8s} {'boundary s plain':>17s} {'secret':>8s} "
          f"{'wall s plain':>13s} {'secret':>8s} {'wall ratio':>10s}")
    for i, pair in enumerate(pairs):
        a, b = pair["plain"], pair["secret"]
        print(f"{i:6d} {a['resolve_s']:16.4f} {b['resolve_s']:8.4f} {a['boundary_s']:17.4f} {b['boundary_s']:8.4f} "
              f"{a['wall_s']:13.2f} {b['wall_s']:8.2f} {pair['wall_s']:10.3f}")
    summary = {f: {"median": statistics.median(p[f] for p in pairs), "min": min(p[f] for p in pairs),
                   "max": max(p[f] for p in pairs)} for f in ("wall_s", "resolve_s", "boundary_s")} if pairs else {}
    if pairs:
        print("ratios secret/plain (median, min-max): " + ", ".join(
            f"{f} {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})" for f, s in summary.items()))
    print(json.dumps({"bench": "secret", "derive": dv, "ops": op, "ratios": summary, "pairs": pairs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
