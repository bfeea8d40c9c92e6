"""Live recovery: every node serves its latest outer state; a joiner downloads it instead of
waiting for a donor (non-blocking join).

After each outer step, each local rank writes a RAM snapshot of its node-identical state (outer
params and outer momentum of its shard, plus the run's counters) in a background thread: the outer
state does not change during the inner steps, so training never waits for it. Its sidecar
(`zb.ckpt.sidecar.server`, token-protected, read-only) serves the newest committed one; its address is in
the store under `ckpt_serve/<uid>/r<local rank>`. A joiner's local rank r fetches from the local
rank r sidecars of the live nodes (split across them, checksummed), checks that the snapshot is
the run's current outer step (fetching again if the run moved on), and loads it. It takes no other
node's inner optimizer state or data position.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zb.ckpt.durable.ramdir import claim, release, sweep_stale
from zb.ckpt.format.catalog import prune
from zb.ckpt.format.manifest import snapshot_name
from zb.ckpt.format.snapshot import load_snapshot, write_snapshot
from zb.ckpt.recovery.fetch import FetchResult, fetch_snapshot
from zb.ckpt.sidecar.live_layout import rank_dir, sidecar_id
from zb.ckpt.sidecar.publish import advertised_address, peer_addresses, publish_address, unpublish_address
from zb.ckpt.sidecar.server import serve_in_thread
from zb.ckpt.sidecar.token import read_token
from zb.config_schema import Config
from zb.diloco.outer import OuterState
from zb.elastic import keys, localsync
from zb.elastic.stores import shared_stores
from zb.elastic.tcpstore import read_many
from zb.elastic.world import World
from zb.errors import EnvironmentFailure
from zb.events import Sink, emit
from zb.local_world import LocalWorld
from zb.position import JSON_KEY, RunPosition

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from zb.store_clients import StoreClient

log = logging.getLogger("zb.diloco")

PROGRESS_KEY = "zb/run/progress"   # {"outer_step": k, "step": s} of the last outer step, JSON
FILE = "outer.safetensors"
KEEP = 2                            # a download of the previous one may still be running
FETCH_ROUNDS = 3


class LiveSnapshots:
    """This local rank's RAM snapshots of the outer state and the sidecar that serves them."""

    def __init__(self, cfg: Config, uid: str, local_rank: int, fingerprint: str):
        self.uid, self.local_rank, self.fingerprint = uid, local_rank, fingerprint
        self.token = read_token(secret=shared_stores(cfg.elastic).secret)
        self.root = rank_dir(cfg.ckpt.ram_dir, uid, local_rank)
        if local_rank == 0:
            sweep_stale(cfg.ckpt.ram_dir)  # RAM copies of runs on this machine that died without cleaning up
        shutil.rmtree(self.root, ignore_errors=True)  # a previous incarnation's state is stale
        claim(self.root.parent)  # removed again by close(), or by a later run's sweep if this one dies
        self.root.mkdir(parents=True, exist_ok=True)
        port = cfg.elastic.live_reco_port + local_rank if cfg.elastic.live_reco_port else 0
        bind = cfg.elastic.live_reco_addr or "0.0.0.0"  # token-protected; the address peers use is advertised
        self.server = serve_in_thread(self.root, self.token, bind, port,
                                      host_option="elastic.live_reco_addr (ZERO_BAND_LIVE_RECO_ADDR)")
        bound_port = int(self.server.address.rsplit(":", 1)[1])
        self.advertised = advertised_address(bind, bound_port, cfg.elastic.live_reco_addr,
                                             shared_stores(cfg.elastic).current.host if cfg.elastic.addr else None)
        self._writer: threading.Thread | None = None

    def publish_address(self, store: StoreClient) -> None:
        publish_address(store, sidecar_id(self.uid, self.local_rank), self.advertised)

    def publish(self, outer: OuterState, position: RunPosition) -> None:
        """Snapshot the outer state in the background (the previous write is awaited first)."""
        self.wait()
        tensors = {name.split("/")[1]: t.detach().clone() for name, t in outer.state_tensors().items()}
        self._writer = threading.Thread(target=self._write, args=(tensors, position), name="zb-live-snapshot",
                                        daemon=True)
        self._writer.start()

    def _write(self, tensors: dict[str, torch.Tensor], position: RunPosition) -> None:
        try:
            write_snapshot(self.root, {FILE: tensors}, {JSON_KEY: position.to_json()}, position.step,
                           outer_step=position.outer_step, fingerprint=self.fingerprint,
                           name=snapshot_name(position.outer_step))
            prune(self.root, KEEP)
        except Exception as e:  # noqa: BLE001 - a missed snapshot only means joiners wait for the next one
            log.warning("live snapshot of outer step %d failed: %s", position.outer_step, e)

    def wait(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def close(self, store: StoreClient | None = None) -> None:
        self.wait()
        if store is not None:
            unpublish_address(store, sidecar_id(self.uid, self.local_rank))
        self.server.close()
        release(self.root.parent, [self.root.name])  # nothing serves these snapshots any more


def recover_node(store: StoreClient, cfg: Config, local: LocalWorld, local_group: ProcessGroup | None,
                 outer: OuterState, fingerprint: str, sink: Sink) -> RunPosition | None:
    """Every local rank of a joining node: the run's outer state from the live nodes' snapshots, loaded into
    `outer` and the model; the run's position, or None when any local rank found none (a blocking join then)."""
    started = time.perf_counter()
    owner = outer.layout.owner    # a rank with no stripe has nothing to fetch
    uid = cfg.elastic.unique_id
    assert uid is not None, "the entry point names the node (node_identity) before it builds the DilocoNode"
    found = recover(store, cfg, uid, local.rank, outer, fingerprint) if owner else None
    if not localsync.all_ok(local_group, found is not None or not owner):
        return None
    outer.push_to_model()
    mine = found[0].to_json() if found is not None else None
    position = RunPosition.from_json(localsync.broadcast_json(local_group, local.rank, {"position": mine})["position"])
    if local.is_head:
        assert found is not None  # local rank 0 always holds a stripe: all_ok above says it found one
        emit(sink, found[1].record())
        log.info("recovered the run's outer state of outer step %s from %s in %.2f s",
                 position.outer_step, ", ".join(found[1].peers), time.perf_counter() - started)
    return position


def publish_progress(store: StoreClient, outer_step: int, step: int) -> None:
    store.set(PROGRESS_KEY, json.dumps({"outer_step": outer_step, "step": step}))


def read_progress(store: StoreClient) -> dict[str, Any] | None:
    raw = read_many(store, [PROGRESS_KEY])[0]
    return json.loads(raw) if raw else None


def recover(store: StoreClient, cfg: Config, uid: str, local_rank: int, outer: OuterState, fingerprint: str
            ) -> tuple[RunPosition, FetchResult] | None:
    """Fetch and load the run's current outer state (into `outer`, not yet the model). None when there is nothing to recover from, or
    when the run moves on faster than a snapshot downloads: the node then joins with the blocking
    state transfer instead of failing."""
    world = World.decode(read_many(store, [keys.WORLD])[0])
    progress = read_progress(store)
    if world is None or not world.nodes or progress is None:
        return None
    peers = list(peer_addresses(store, [sidecar_id(u, local_rank) for u in world.nodes if u != uid]).values())
    if not peers:
        return None
    token = read_token(secret=shared_stores(cfg.elastic).secret)
    dest = Path(cfg.ckpt.ram_dir) / "recovered" / uid / f"r{local_rank}"
    claim(dest.parent)
    try:
        result = _fetch_current(store, peers, token, dest, progress, fingerprint)
        if result is None:
            log.warning("live recovery could not catch up with the run (it moves on faster than a snapshot "
                        "downloads): joining with the blocking state transfer instead")
            return None
        tensors, meta = load_snapshot(result.path)  # in memory now: the RAM copy has done its job
    finally:
        release(dest.parent, [dest.name])
    loaded = {f"outer/{k}": v for k, v in tensors[FILE].items()}
    if loaded["outer/params"].shape != outer.flat.shape:
        raise EnvironmentFailure("the recovered outer state does not match this node's model shard")
    outer.load_state_tensors(loaded)   # the caller pushes it into the model, on every local rank
    return RunPosition.from_json(meta.get(JSON_KEY)), result


def _fetch_current(store: StoreClient, peers: list[str], token: str, dest: Path, progress: dict[str, Any],
                   fingerprint: str) -> FetchResult | None:
    """The snapshot of the run's current outer step, or None after FETCH_ROUNDS tries to catch up.
    A step the peers no longer serve (the run moved on and pruned it) counts as a try, not a failure."""
    for _ in range(FETCH_ROUNDS):
        try:
            result = fetch_snapshot(peers, token, dest, expect_step=progress["step"], files=[FILE],
                                    fingerprint=fingerprint, wait_s=10.0, timeout=30.0)
        except EnvironmentFailure as e:
            now = read_progress(store)
            if now is None or now["step"] == progress["step"]:
                raise  # the run stands still: the peers really cannot serve it
            log.info("the run moved on to outer step %s before the download (%s): fetching that one",
                     now["outer_step"], str(e).splitlines()[0])
            progress = now
            continue
        now = read_progress(store)
        if now is None or now["outer_step"] == result.outer_step:  # None: a restarted store, nothing newer
            return result
        log.info("the run moved on to outer step %s during the download: fetching again", now["outer_step"])
        progress = now
    return None
