"""What scripts/chaos.py checks: metrics read while nodes write them, agreement on params_hash, orphan
processes, a resume from a survivor's newest checkpoint, and the run secret's refusals (a node without
it, a record forged through a raw store client).

    python scripts/_chaos_checks.py forge HOST PORT UID [REFUSED ...]   (forge_join, printing its JSON)
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import psutil

from zb.testing.cluster import TrainCluster


class Failure(Exception):
    """A failed check (its message says what, the caller adds the seed)."""


class Tail:
    """A node's metrics.jsonl read incrementally: complete lines only (a node may be mid-write)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.by_kind = path, 0, {}

    def events(self, kind: str) -> list[dict]:
        self._read()
        return self.by_kind.get(kind, [])

    def _read(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].decode(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            self.by_kind.setdefault(event.get("event"), []).append(event)


def agreement_failures(outer_by_uid: dict[str, list[dict]]) -> tuple[int, list]:
    """Outer steps applied by 2+ nodes, keyed by (mesh_version, outer_step): one all-reduce of one
    world. Nodes share the run's counters (a joiner or a node handed the state moves to the run's
    position), so within a mesh version the outer step names the all-reduce. Returns how many keys
    were compared and those where the hashes differ."""
    by_key: dict[tuple[int, int], dict[str, str]] = {}
    for uid, events in outer_by_uid.items():
        for e in events:
            if e.get("applied") and "params_hash" in e:
                by_key.setdefault((e["mesh_version"], e["outer_step"]), {})[uid] = e["params_hash"]
    shared = {k: v for k, v in by_key.items() if len(v) > 1}
    bad = [(k, v) for k, v in sorted(shared.items()) if len(set(v.values())) > 1]
    return len(shared), bad


def orphans() -> list[str]:
    """Live child processes of this process (every node and store should be gone)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{child.pid} {' '.join(child.cmdline()[:4])}")
        except psutil.NoSuchProcess:
            continue
    return out


def newest_checkpoint(root: Path) -> int | None:
    steps = [int(d.name.split("-")[1]) for d in root.glob("step-*") if (d / "rank-0" / "COMMITTED").exists()]
    return max(steps, default=None)


def resume_check(tmp: Path, survivors: list[str], inner: int = 5, extra: tuple[str, ...] = ()) -> tuple[str, str]:
    """A short `zb train --ckpt.resume latest` from the survivor with the newest checkpoint, alone
    around a fresh store, must exit 0 after resuming. Returns (node, outcome); raises Failure otherwise."""
    found = {u: newest_checkpoint(tmp / "ckpt" / u) for u in survivors}
    found = {u: s for u, s in found.items() if s is not None}
    if not found:
        raise Failure(f"no survivor ({survivors}) has a complete checkpoint")
    uid = max(found, key=found.get)
    step = found[uid]
    (tmp / "resume").mkdir(exist_ok=True)
    run = TrainCluster(tmp / "resume", 1)
    try:
        run.start_train(uid, "--ckpt.path", str(tmp / "ckpt" / uid), "--ckpt.resume", "latest", "--ckpt.ram_dir",
                        str(tmp / "resume" / "shm"), "--optim.total_steps", "100000", "--train.max_steps",
                        str(step + inner), *extra)
        code = run.finish(uid, 200)
        log = (run.tmp / f"{uid}.log").read_text()
    finally:
        run.close()
    if code != 0 or "resumed from" not in log:
        raise Failure(f"resume of {uid} at step {step} exited {code}:\n{run.log(uid)}")
    return uid, f"resumed step {step}, exit 0"


def false_evictions(membership_by_uid: dict[str, list[dict]], signalled: set[str]) -> list[str]:
    """Nodes some node's membership event lists as died that the harness never signalled (killed,
    stopped): a live, running node evicted."""
    out = []
    for uid, events in membership_by_uid.items():
        for e in events:
            wrong = sorted(set(e.get("died", [])) - signalled)
            if wrong:
                out.append(f"{uid} at mesh v{e['mesh_version']} declared {wrong} dead")
    return out


def split_runs(outer_by_uid: dict[str, list[dict]]) -> list[str]:
    """Signs of two runs at once (a node or a group training apart): one mesh version applied with
    different world sizes, or outer steps of two mesh versions applied by disjoint sets of nodes at
    overlapping times. In one run the versions follow each other, and any two that overlap in time
    share the nodes that all-reduced across the change."""
    spans: dict[int, list] = {}    # mesh version -> [first time, last time, nodes, world sizes]
    for uid, events in outer_by_uid.items():
        for e in events:
            if not e.get("applied"):
                continue
            span = spans.setdefault(e["mesh_version"], [e["time"], e["time"], set(), set()])
            span[0], span[1] = min(span[0], e["time"]), max(span[1], e["time"])
            span[2].add(uid)
            span[3].add(e["global_world_size"])
    out = [f"mesh v{v} applied with world sizes {sorted(s[3])} by {sorted(s[2])}"
           for v, s in sorted(spans.items()) if len(s[3]) > 1]
    out += [f"mesh v{v} applied by {len(s[2])} nodes {sorted(s[2])} in a world of {max(s[3])}"
            for v, s in sorted(spans.items()) if len(s[3]) == 1 and len(s[2]) > max(s[3])]
    versions = sorted(spans)
    for i, v in enumerate(versions):
        for w in versions[i + 1:]:
            a, b = spans[v], spans[w]
            if a[2].isdisjoint(b[2]) and a[0] < b[1] and b[0] < a[1]:
                out.append(f"mesh v{v} ({sorted(a[2])}) and v{w} ({sorted(b[2])}) applied outer steps at the same "
                           f"time ({max(a[0], b[0]):.1f}-{min(a[1], b[1]):.1f})")
    return out


def split_sides(outer_by_uid: dict[str, list[dict]], sides: list[list[str]], start: float,
                end: float) -> tuple[list[str], list[int]]:
    """Two sides of a cut training apart: outer steps applied between `start` and `end` (unix times) by nodes of
    two sides in worlds of their own at overlapping times. A world is a (mesh version, world size); one applied
    by nodes of both sides, no more of them than its size, is one world (its all-reduce needs every member), not a
    split. Two stores can each form a world under one version number (a failover), so the number alone does not
    name a world. split_runs finds the same over the whole run; this names the sides of one event's cut. Returns
    the splits and, per side, the outer steps it applied in worlds of its own in that time."""
    applied = {u: [e for e in outer_by_uid.get(u, []) if e.get("applied")] for side in sides for u in side}
    side_of = {u: i for i, side in enumerate(sides) for u in side}
    members: dict[tuple[int, int], set] = {}
    for u, events in applied.items():
        for e in events:
            members.setdefault((e["mesh_version"], e["global_world_size"]), set()).add(u)
    shared = {w for w, nodes in members.items() if len({side_of[u] for u in nodes}) > 1 and len(nodes) <= w[1]}
    spans: dict[tuple[int, tuple[int, int]], list] = {}    # (side, world) -> [first time, last time, nodes, steps]
    for u, events in applied.items():
        for e in events:
            world = (e["mesh_version"], e["global_world_size"])
            if start <= e["time"] <= end and world not in shared:
                span = spans.setdefault((side_of[u], world), [e["time"], e["time"], set(), set()])
                span[0], span[1] = min(span[0], e["time"]), max(span[1], e["time"])
                span[2].add(u)
                span[3].add(e["outer_step"])
    out = []
    for (i, (v, n)), a in sorted(spans.items()):
        for (j, (w, m)), b in sorted(spans.items()):
            if i < j and a[0] <= b[1] and b[0] <= a[1]:
                both = f"{max(a[0], b[0]) - start:.1f}-{min(a[1], b[1]) - start:.1f} s after the event began"
                out.append(f"side {sorted(a[2])} applied mesh v{v} (world of {n}) and side {sorted(b[2])} mesh v{w} "
                           f"(world of {m}) at the same time ({both})")
    own = [sum(len(span[3]) for (i, _), span in spans.items() if i == k) for k in range(len(sides))]
    return out, own


def one_world(outer_by_uid: dict[str, list[dict]], live: list[str], after: float = 0.0) -> int | None:
    """The newest mesh version at which every node of `live` applied an outer step in a world of
    exactly those nodes (len(live)) at or after `after` (unix time); None while there is none."""
    common = None
    for uid in live:
        mine = {e["mesh_version"] for e in outer_by_uid.get(uid, [])
                if e.get("applied") and e["global_world_size"] == len(live) and e["time"] >= after}
        common = mine if common is None else common & mine
    return max(common) if common else None


def tcp_sockets(pid: int) -> list[tuple[str, int, int]]:
    """(state, local port, remote port) of the TCP sockets of process `pid`, read from its own network
    namespace (/proc/PID/net/tcp*: psutil reads the caller's, which misses a node in a namespace of
    its own). States as the kernel writes them: "0A" listen, "01" established."""
    import os

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[9] in inodes:
                out.append((cols[3], int(cols[1].rsplit(":", 1)[1], 16), int(cols[2].rsplit(":", 1)[1], 16)))
    return out


def rogues_admitted(membership_by_uid: dict[str, list[dict]], rogues: set[str]) -> list[str]:
    """Membership events whose world names a node that does not hold the run secret (refused, or a forged
    join request): a world the run must never form."""
    out = []
    for uid, events in membership_by_uid.items():
        for e in events:
            wrong = sorted(set(e.get("nodes", [])) & rogues)
            if wrong:
                out.append(f"{uid} at mesh v{e['mesh_version']} has {wrong} in its world")
    return out


def refusal_problem(log: str, phrase: str) -> str | None:
    """None when a refused node's stderr holds the one-line refusal: exactly one line starting 'error:',
    that line naming `phrase`, no traceback; else what is wrong."""
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    if len(errors) != 1:
        return f"{len(errors)} 'error:' lines, expected 1"
    if phrase not in errors[0]:
        return f"the error line does not say '{phrase}': {errors[0]}"
    if "Traceback" in log:
        return "a traceback besides the error line"
    return None


def forge_join(host: str, port: int, uid: str, refused: list[str] = ()) -> dict:
    """What someone who reaches the store's port but lacks the run secret can write, through a raw TCPStore
    client: a join request for the made-up node `uid` on the join list (the line format of
    zb.elastic.membership), its heartbeat counter and an address (keys.probe). First reads whether the
    `refused` nodes left anything there (a heartbeat counter, a join request): a node refused for its secret
    must write nothing. Returns {"left_by_refused": [...]}."""
    from datetime import timedelta

    import torch.distributed as dist

    from zb.elastic import keys
    from zb.elastic.store_state import encode_line

    raw = dist.TCPStore(host, port, is_master=False, use_libuv=True, timeout=timedelta(seconds=30))
    joins = raw.get(keys.JOINS).decode(errors="replace") if raw.check([keys.JOINS]) else ""
    left = [u for u in refused if raw.check([keys.heartbeat(u)]) or f'"uid":"{u}"' in joins]
    raw.add(keys.heartbeat(uid), 1)
    raw.append(keys.JOINS, encode_line({"uid": uid, "token": "forged", "pref_rank": 0, "last_version": 0,
                                        "last_rank": 0, "stripes": 1, "run": ""}))
    raw.set(keys.probe(uid), "127.0.0.1:9")
    return {"left_by_refused": left}


def tamper(host: str, port: int, victim: str) -> dict:
    """What issue 40's outsider did to the store without the run secret, through a raw TCPStore client: delete the
    run marker, write junk into the roll-call counters of the two resolutions before the current one (the split),
    bump the next two by 10**9 (the counter that sized a leader's cleanup and OOM-killed it), and write junk into
    `victim`'s heartbeat counter (which ejected it). Returns {"marker": the marker before, as hex}."""
    from datetime import timedelta

    import torch.distributed as dist

    from zb.elastic import keys
    from zb.signed_store import MARKER

    raw = dist.TCPStore(host, port, is_master=False, use_libuv=True, timeout=timedelta(seconds=30))
    marker = raw.get(MARKER) if raw.check([MARKER]) else b""
    world = raw.get(keys.WORLD) if raw.check([keys.WORLD]) else b""
    start = world.find(b"{")
    resolution = int(json.loads(world[start:]).get("resolution", 0)) if start >= 0 else 0
    raw.delete_key(MARKER)
    for r in (resolution - 2, resolution - 1):
        if r >= 0:
            raw.set(keys.roll_call_events(r), b"x")
    for r in (resolution + 1, resolution + 2):
        raw.add(keys.roll_call_events(r), 10**9)
    raw.set(keys.heartbeat(victim), b"not a number")
    return {"marker": marker.hex(), "resolution": resolution}


def marker_now(host: str, port: int) -> str:
    """The store's run marker as hex ("" when absent), read by a raw client."""
    from datetime import timedelta

    import torch.distributed as dist

    from zb.signed_store import MARKER

    raw = dist.TCPStore(host, port, is_master=False, use_libuv=True, timeout=timedelta(seconds=30))
    return (raw.get(MARKER) if raw.check([MARKER]) else b"").hex()


def flood(host: str, ports: list[int], connections: int, source: str | None = None) -> dict:
    """`connections` connect-and-reset loops against each of `ports` on `host` (non-blocking: a SYN the node's
    filter drops costs no wait), from `source` when given (loopback: another address than the nodes')."""
    import socket
    import struct

    reset = struct.pack("ii", 1, 0)
    started = time.monotonic()
    for port in ports:
        for _ in range(connections):
            s = socket.socket()
            s.setblocking(False)
            if source is not None:
                s.bind((source, 0))
            try:
                s.connect((host, port))
            except (BlockingIOError, OSError):
                pass
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, reset)
            s.close()
    return {"seconds": round(time.monotonic() - started, 2)}


def non_finite_losses(steps_by_uid: dict[str, list[dict]], after: float) -> list[str]:
    """Inner steps logged at or after `after` (unix time) whose loss is not finite."""
    return [f"{uid} at step {e['step']}: loss {e['loss']}" for uid, events in steps_by_uid.items() for e in events
            if e["time"] >= after and not math.isfinite(float(e["loss"]))]


if __name__ == "__main__" and sys.argv[1:2] == ["forge"]:
    print(json.dumps(forge_join(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:])))
elif __name__ == "__main__" and sys.argv[1:2] == ["tamper"]:
    print(json.dumps(tamper(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
elif __name__ == "__main__" and sys.argv[1:2] == ["marker"]:
    print(json.dumps({"marker": marker_now(sys.argv[2], int(sys.argv[3]))}))
elif __name__ == "__main__" and sys.argv[1:2] == ["flood"]:
    print(json.dumps(flood(sys.argv[2], [int(p) for p in sys.argv[4:]], int(sys.argv[3]))))
