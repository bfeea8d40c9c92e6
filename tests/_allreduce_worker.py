"""Worker process for tests/test_allreduce.py and tests/test_halving.py: one rank running all-reduces over bare
gloo groups.

argv: rank world port outdir spec_json. spec: {"cases": [case, ...], "streams": S, "die": rank,
"hang": bool, "die_after": k, "floor": seconds, "shape": "ring" or "halving" (default for every case)}; a case:
numel, compression, op ("sum"/"avg"), shape (the case's own, else the spec's),
dtype, seed, heavy, poison {rank: [[index, value], ...]}, piece, rounds (error feedback: that many
calls with one residual, fresh inputs each; input and output are then the sums over the calls, and
"residual" the residual after the last); a sparse case's "chunk", "k" and "beta" (sparse_options). Writes <outdir>/rank<r>.pt (one
dict per case: input, output, wire_bytes) or <outdir>/rank<r>.err (the PeerFailure as JSON).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp


def make_input(case: dict, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case.get("seed", 0) + rank)
    x = torch.randn(case["numel"], generator=g)
    if case.get("heavy"):
        x = x / torch.rand(case["numel"], generator=g).clamp(min=1e-3).sqrt()  # heavy tails
    for index, value in case.get("poison", {}).get(str(rank), []):
        x[index] = float(value)
    return x.to(getattr(torch, case.get("dtype", "float32")))


def sparse_options(case: dict) -> dict:
    """A sparse case's scheme ("chunk", "k") and residual decay ("beta")."""
    if case["compression"] != "sparse":
        return {}
    from zb.collectives.kernels import SparseScheme

    return {"sparse": SparseScheme(case.get("chunk", 4096), case.get("k", 64)), "sparse_beta": case.get("beta", 1.0)}


def group(store: dist.Store, rank: int, world: int, prefix: str) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world, timedelta(seconds=60))


def install_death(spec: dict) -> None:
    """Make this rank die (SIGKILL) or hang (SIGSTOP) inside the ring, after message die_after."""
    from zb.collectives import ring

    original = ring.Sender.send

    def send_then_die(self, k, buf):
        original(self, k, buf)
        if k >= spec.get("die_after", 1):
            time.sleep(0.05)  # let the sent message leave
            os.kill(os.getpid(), signal.SIGSTOP if spec.get("hang") else signal.SIGKILL)

    ring.Sender.send = send_then_die


def run_concurrent(spec: dict, groups: list, rank: int, outdir: Path) -> None:
    import threading

    from zb.collectives import all_reduce

    inputs = [make_input({**case, "seed": 50 + i}, rank) for i, case in enumerate(spec["cases"])]
    outputs = [x.clone() for x in inputs]
    threads = [threading.Thread(target=all_reduce, args=(out, g), kwargs={"compression": case["compression"]})
               for out, g, case in zip(outputs, groups, spec["cases"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    torch.save([{"input": x, "output": o, "wire_bytes": 0, "seconds": 0.0} for x, o in zip(inputs, outputs)],
               outdir / f"rank{rank}.pt")
    groups[0].barrier().wait()


def linger(spec: dict, world: int, outdir: Path, limit_s: float = 60.0) -> None:
    """A rank that raised stays up until every other survivor has its result, as a node's process does (its outer
    step goes on to the check-in): exiting at once closes its sockets while its FAILED notice may still be on the
    way (a loaded machine), and the rank downstream then names it instead of the rank that died."""
    others = [r for r in range(world) if r != spec.get("die")]
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and not all(
            (outdir / f"rank{r}.pt").exists() or (outdir / f"rank{r}.err").exists() for r in others):
        time.sleep(0.1)


def main() -> None:
    rank, world, port, outdir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    spec = json.loads(sys.argv[5])
    torch.set_num_threads(1)
    from zb.collectives import PeerFailure, all_reduce

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    groups = [group(store, rank, world, f"mesh_{s}") for s in range(spec.get("streams", 1))]
    if spec.get("die") == rank:
        install_death(spec)
    results = []
    if spec.get("concurrent"):  # one all-reduce per group, at the same time, from two threads
        run_concurrent(spec, groups, rank, outdir)
        return
    try:
        for case in spec["cases"]:
            op = ReduceOp.AVG if case.get("op") == "avg" else ReduceOp.SUM
            rounds = case.get("rounds")
            residual = torch.zeros(case["numel"]) if rounds else None
            inputs, outputs, wire = [], [], 0
            t0 = time.monotonic()
            for r in range(rounds or 1):
                x = make_input({**case, "seed": case.get("seed", 0) + 100 * r}, rank)
                out = x.clone()
                stats = all_reduce(out, groups[0], op=op, compression=case["compression"], streams=groups[1:],
                                   timeout_floor_s=spec.get("floor", 20.0), start_timeout_s=spec.get("floor", 20.0),
                                   piece_values=case.get("piece", 4096), residual=residual,
                                   shape=case.get("shape", spec.get("shape", "ring")), **sparse_options(case))
                inputs.append(x)
                outputs.append(out)
                wire += stats.wire_bytes
            result = {"input": sum(inputs), "output": sum(outputs), "wire_bytes": wire,
                      "seconds": time.monotonic() - t0}
            if residual is not None:
                result.update(residual=residual, last_input=inputs[-1], last_output=outputs[-1])
            results.append(result)
    except PeerFailure as e:
        err = {"rank": e.rank, "observer": e.observer, "message": str(e), "at": time.time()}
        (outdir / f"rank{rank}.err").write_text(json.dumps(err))
        linger(spec, world, outdir)
        return
    torch.save(results, outdir / f"rank{rank}.pt")
    groups[0].barrier().wait()  # the store lives in rank 0: nobody leaves before everyone is done


if __name__ == "__main__":
    main()
