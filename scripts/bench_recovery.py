"""Benchmark live recovery: fetch a snapshot of S bytes from 1 and 2 `zb ckpt-serve` peers.

Run:  PYTHONPATH=$PWD python scripts/bench_recovery.py --size-mb 128 --rate-mbit 100 --repeats 3

Snapshot write (always): write_snapshot vs safetensors.save_file + sha256, into /dev/shm.
Loopback (always): baseline = one plain HTTP GET per file over one connection, without checks;
then fetch_snapshot from 1 and from 2 peers (ranges, several connections, sha256 verification).
Network namespaces (as root, unless --no-netns): each peer's uplink shaped to B with tbf, the joiner
unshaped; the targets are time <= 1.2 x S/B with one peer and close to S/(2B) with two.
Repeats are interleaved; medians are reported. Prints a rich table and one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from zb.ckpt.format.catalog import read_manifest  # noqa: E402 (torch-free: the client starts fast)
from zb.ckpt.recovery.fetch import fetch_snapshot  # noqa: E402

TOKEN = "bench-recovery-token-0123456789abcdef"
PORT = 7711


def make_snapshots(base: Path, size: int, peers: int, repeats: int) -> tuple[list[Path], dict[str, float]]:
    """One snapshot of ~`size` bytes (model + outer files), copied to each peer's root; also times
    write_snapshot against the baseline safetensors.save_file + sha256 of each file."""
    import torch
    from safetensors.torch import save_file

    from zb.ckpt.format.catalog import sha256_file
    from zb.ckpt.format.snapshot import write_snapshot

    n = size // 4 // 2 // 8
    tensors = {f: {f"layer{i}": torch.randn(n) for i in range(8)} for f in ("model.safetensors", "outer.safetensors")}
    roots = [base / f"peer{i}" for i in range(peers)]
    times: dict[str, list[float]] = {"write_baseline": [], "write_snapshot": []}
    for _ in range(repeats):
        start = time.perf_counter()
        for f, ts in tensors.items():
            save_file(ts, str(base / f))
            sha256_file(base / f)
        times["write_baseline"].append(time.perf_counter() - start)
        start = time.perf_counter()
        write_snapshot(roots[0], tensors, {"bench": True}, step=100, outer_step=1, fingerprint="bench")
        times["write_snapshot"].append(time.perf_counter() - start)
    for f in tensors:
        (base / f).unlink()
    for root in roots[1:]:
        shutil.copytree(roots[0], root)
    return roots, {k: statistics.median(v) for k, v in times.items()}


def start_server(root: Path, host: str, port: int, prefix: list[str] = ()) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "ZB_CKPT_TOKEN": TOKEN, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "zb", "-q", "ckpt-serve", "--dir", str(root), "--host", host,
                             "--port", str(port), "--json"], env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise SystemExit(f"zb ckpt-serve failed to start on {host}:{port}")
    return proc, json.loads(line)["address"]


def plain_get(address: str, dest: Path) -> float:
    """Baseline: each file in one GET over one connection, no ranges, no checksum."""
    start = time.perf_counter()
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    conn.request("GET", "/manifest", headers=auth)
    manifest = json.loads(conn.getresponse().read())
    dest.mkdir(parents=True, exist_ok=True)
    for name in manifest["files"]:
        conn.request("GET", f"/files/{manifest['name']}/{name}", headers=auth)
        response = conn.getresponse()
        with open(dest / name, "wb") as f:
            shutil.copyfileobj(response, f, 1 << 20)
    conn.close()
    return time.perf_counter() - start


def timed_fetch(peers: list[str], dest: Path) -> float:
    shutil.rmtree(dest, ignore_errors=True)
    result = fetch_snapshot(peers, TOKEN, dest, progress=False, timeout=60)
    return result.seconds


def client_main(spec: str) -> None:
    """Inside the joiner's namespace: one fetch, its seconds as JSON."""
    doc = json.loads(spec)
    print(json.dumps({"seconds": timed_fetch(doc["peers"], Path(doc["dest"]))}))


def run_loopback(roots: list[Path], work: Path, repeats: int) -> dict[str, float]:
    procs, addresses = zip(*(start_server(r, "127.0.0.1", 0) for r in roots))
    try:
        times: dict[str, list[float]] = {"baseline": [], "one_peer": [], "two_peers": []}
        for _ in range(repeats):  # interleaved: noise hits all variants alike
            shutil.rmtree(work / "plain", ignore_errors=True)
            times["baseline"].append(plain_get(addresses[0], work / "plain"))
            times["one_peer"].append(timed_fetch([addresses[0]], work / "dest"))
            times["two_peers"].append(timed_fetch(list(addresses), work / "dest"))
        return {k: statistics.median(v) for k, v in times.items()}
    finally:
        _stop(procs)


def run_netns(roots: list[Path], work: Path, repeats: int, mbit: float) -> dict[str, float]:
    from _bench_netns import Topology

    with Topology(["p0", "p1", "j"]) as topo:
        for host in ("p0", "p1"):
            topo.shape_uplink(host, mbit)
        servers = [start_server(r, topo.addresses[h], PORT, topo.exec_prefix(h)) for r, h in zip(roots, ("p0", "p1"))]
        procs, addresses = zip(*servers)
        try:
            times: dict[str, list[float]] = {"one_peer": [], "two_peers": []}
            for _ in range(repeats):
                times["one_peer"].append(_client_in(topo, [addresses[0]], work / "dest"))
                times["two_peers"].append(_client_in(topo, list(addresses), work / "dest"))
            return {k: statistics.median(v) for k, v in times.items()}
        finally:
            _stop(procs)


def _client_in(topo, peers: list[str], dest: Path) -> float:
    spec = json.dumps({"peers": peers, "dest": str(dest)})
    out = subprocess.run([*topo.exec_prefix("j"), sys.executable, __file__, "--client", spec], check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def _stop(procs) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def report(size: int, writes: dict, loop: dict, net: dict | None, mbit: float, skipped: str | None) -> dict:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"live recovery of {size / 1e6:.0f} MB (medians)")
    for col in ("path", "variant", "seconds", "MB/s", "ratio"):
        table.add_column(col)
    doc = {"size_bytes": size, "loopback": {k: round(v, 3) for k, v in loop.items()},
           "write": {k: round(v, 3) for k, v in writes.items()}}
    for k, v in writes.items():
        table.add_row("/dev/shm", k, f"{v:.2f}", f"{size / v / 1e6:.0f}", f"{v / writes['write_baseline']:.2f} x baseline")
    for k, v in loop.items():
        table.add_row("loopback", k, f"{v:.2f}", f"{size / v / 1e6:.0f}", f"{v / loop['baseline']:.2f} x baseline")
    if net is not None:
        ideal = size * 8 / (mbit * 1e6)
        doc["netns"] = {"rate_mbit": mbit, "ideal_one_s": round(ideal, 2), **{k: round(v, 3) for k, v in net.items()},
                        "ratio_one": round(net["one_peer"] / ideal, 3),
                        "ratio_two": round(net["two_peers"] / (ideal / 2), 3)}
        table.add_row(f"netns {mbit:g} Mbit/s", "one_peer", f"{net['one_peer']:.2f}", f"{size / net['one_peer'] / 1e6:.1f}",
                      f"{doc['netns']['ratio_one']:.2f} x S/B (target <= 1.2)")
        table.add_row(f"netns {mbit:g} Mbit/s", "two_peers", f"{net['two_peers']:.2f}",
                      f"{size / net['two_peers'] / 1e6:.1f}", f"{doc['netns']['ratio_two']:.2f} x S/2B")
    else:
        doc["netns"] = {"skipped": skipped}
    Console(stderr=True).print(table)
    print(json.dumps(doc, sort_keys=True))
    return doc


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=128, help="Snapshot size S in MB.")
    parser.add_argument("--rate-mbit", type=float, default=100, help="Each peer's uplink B in Mbit/s (netns).")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-netns", action="store_true", help="Loopback only.")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        return client_main(args.client)
    from _bench_netns import available

    skipped = "--no-netns" if args.no_netns else available()
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        roots, writes = make_snapshots(Path(d), int(args.size_mb * 1e6), peers=2, repeats=args.repeats)
        size = read_manifest(next(roots[0].iterdir())).total_bytes
        loop = run_loopback(roots, Path(d), args.repeats)
        net = None if skipped else run_netns(roots, Path(d), args.repeats, args.rate_mbit)
    return report(size, writes, loop, net, args.rate_mbit, skipped)


if __name__ == "__main__":
    main()
