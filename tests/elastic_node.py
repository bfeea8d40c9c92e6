"""Test driver: one elastic node that resolves the world and all-reduces over it in a loop.

Not training: it heartbeats (through the mesh), calls mesh.resolve() at every "outer step", then
all-reduces [1, rank] around a send/recv ring over mesh.global_pg, each transfer bounded by
--transfer-deadline, and prints one JSON line per event on stdout for the tests to check:
ready, step (view + sum), failure (suspect), membership (from the event sink), exit.

Run: PYTHONPATH=. GLOBAL_ADDR=127.0.0.1 GLOBAL_PORT=29600 python tests/elastic_node.py --uid a --steps 20
(config comes from the same env twins and --elastic.* style flags as zb train; see docs/elastic.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta


def emit(event: str, **fields) -> None:
    sys.stdout.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
    sys.stdout.flush()


class StdoutSink:
    def log(self, event: str, **fields) -> None:
        emit(event, **fields)


def ring_allreduce(pg, rank: int, size: int, tensor, deadline: float):
    """Sum of `tensor` over the group; raises RingFailure naming the peer whose transfer failed."""
    import torch

    total, carry = tensor.clone(), tensor.clone()
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    for hop in range(size - 1):
        incoming = torch.empty_like(carry)
        send = _post(lambda carry=carry, hop=hop: pg.send([carry], nxt, hop), nxt)
        recv = _post(lambda incoming=incoming, hop=hop: pg.recv([incoming], prv, hop), prv)
        _wait(recv, prv, deadline)
        _wait(send, nxt, deadline)
        total += incoming
        carry = incoming
    return total


class RingFailure(Exception):
    def __init__(self, peer: int, error: str) -> None:
        super().__init__(error)
        self.rank = peer


def _post(start, peer: int):
    """Posting a transfer raises at once when the pair to `peer` is already closed."""
    try:
        return start()
    except RuntimeError as e:
        raise RingFailure(peer, str(e).splitlines()[0][:200]) from None


def _wait(work, peer: int, deadline: float) -> None:
    try:
        work.wait(timedelta(seconds=deadline))
    except RuntimeError as e:
        raise RingFailure(peer, str(e).splitlines()[0][:200]) from None


def parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1000000)
    p.add_argument("--duration", type=float, default=60.0, help="stop after this many seconds")
    p.add_argument("--step-time", type=float, default=0.2, help="seconds of 'inner steps' between syncs")
    p.add_argument("--leave-after", type=int, default=None, help="leave gracefully after N steps")
    p.add_argument("--force-rebuild-every", type=int, default=0, help="report a failure every N steps")
    p.add_argument("--transfer-deadline", type=float, default=None, help="default: elastic.pg_timeout")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    from zb.config import load_config
    from zb.elastic import ElasticDeviceMesh
    from zb.errors import ZbError
    from zb.log import setup_logging

    setup_logging()
    cfg = load_config().elastic
    deadline = args.transfer_deadline or cfg.pg_timeout
    local_group, local_rank, local_size = _local_group()
    mesh = ElasticDeviceMesh(cfg, local_group, local_rank=local_rank, stripes=local_size,
                             sink=StdoutSink() if local_rank == 0 else None)
    try:
        view = mesh.start()
    except ZbError as e:
        emit("error", message=str(e), code=e.exit_code)
        return e.exit_code
    emit("ready", pid=os.getpid(), **_view_fields(view))
    stop_at = time.monotonic() + args.duration
    resolve_s = 0.0
    for i in range(args.steps):
        if i > 0:
            time.sleep(args.step_time)      # the "inner steps": no global traffic
            if args.force_rebuild_every and i % args.force_rebuild_every == 0:
                mesh.report_failure(None)   # benchmark: a new mesh version without a membership change
            started = time.monotonic()
            view = mesh.resolve()           # the outer-step boundary
            resolve_s = time.monotonic() - started
        if time.monotonic() > stop_at:
            break
        timing = {"resolve_s": resolve_s, "rebuild_s": mesh.rebuild_s if view.changed else 0.0}
        if not sync(mesh, view, i, deadline, timing):
            continue
        if args.leave_after is not None and i + 1 >= args.leave_after:
            break
    mesh.shutdown(graceful=True)
    emit("exit", pid=os.getpid())
    return 0


def sync(mesh, view, i: int, deadline: float, timing: dict) -> bool:
    """All-reduce [1, rank] over the replica group and report the sum; on failure blame the peer."""
    import torch

    t = torch.tensor([1.0, float(view.global_rank)])
    started = time.monotonic()
    try:
        out = ring_allreduce(mesh.global_pg, view.global_rank, view.global_world_size, t, deadline)
    except RingFailure as e:
        emit("failure", step=i, suspect=e.rank, error=str(e), **_view_fields(view))
        mesh.report_failure(e.rank)
        return False
    n = view.global_world_size
    emit("step", step=i, sum=out.tolist(), ok=out.tolist() == [float(n), float(n * (n - 1) // 2)],
         allreduce_s=time.monotonic() - started, **timing, **_view_fields(view))
    return True


def _local_group():
    """Under torchrun: the node's local ranks form the local group (gloo on CPU)."""
    if "LOCAL_RANK" not in os.environ:
        return None, 0, 1
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    return dist.group.WORLD, int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])


def _view_fields(view) -> dict:
    return {"local_rank": int(os.environ.get("LOCAL_RANK", "0")), "version": view.mesh_version, "rank": view.global_rank, "size": view.global_world_size,
            "nodes": view.nodes, "leader": view.leader, "uid": view.uid, "joiner": view.is_joiner,
            "store_ok": view.store_ok}


if __name__ == "__main__":
    sys.exit(main())
