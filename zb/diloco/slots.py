"""Data slots: each live node reads its own data shard, claimed in the global store.

A slot is a data rank in [0, data_world_size). A node keeps the slot it held before (same unique
id); otherwise it takes a free one, or one whose holder is no longer in the world. Claims use
compare_set, so two joiners never get the same slot. Each slot's data position (per local rank)
is written at every outer step, so a later holder with the same local rank count continues where
the last one stopped and never replays samples the run has already seen.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from zb.elastic.tcpstore import read_many
from zb.errors import EnvironmentFailure

if TYPE_CHECKING:
    from zb.store_clients import StoreClient

log = logging.getLogger("zb.diloco")

ROOT = "zb/data"


def slot_key(slot: int) -> str:
    return f"{ROOT}/slot/{slot}"


def position_key(slot: int, local_rank: int) -> str:
    return f"{ROOT}/pos/{slot}/{local_rank}"


def claim_slot(store: StoreClient, uid: str, live_nodes: list[str], num_slots: int,
               preferred: int | None = None) -> int:
    """The slot this node reads from now on (local rank 0 calls this; it broadcasts the answer)."""
    holders = [h.decode() for h in read_many(store, [slot_key(i) for i in range(num_slots)])]
    if uid in holders:
        return holders.index(uid)
    order = list(range(num_slots))
    if preferred is not None and 0 <= preferred < num_slots:
        order.remove(preferred)
        order.insert(0, preferred)
    for slot in order:
        holder = holders[slot]
        if holder and holder in live_nodes:
            continue
        # compare_set with the holder we saw: exactly one of several racing joiners wins.
        won = store.compare_set(slot_key(slot), holder, uid).decode()
        if won == uid:
            return slot
    raise EnvironmentFailure(f"no free data slot: all {num_slots} (data.data_world_size) are held by live nodes; "
                             "start the run with a larger data.data_world_size to admit more nodes")


def save_position(store: StoreClient, slot: int, local_rank: int, state: dict[str, Any],
                  local_world_size: int = 1) -> None:
    store.set(position_key(slot, local_rank), json.dumps({"local_world_size": local_world_size, "state": state},
                                                         sort_keys=True))


def load_position(store: StoreClient, slot: int, local_rank: int, local_world_size: int = 1) -> dict[str, Any] | None:
    """The loader state the slot's previous holder left for this local rank; None when there is none, or
    when that node split the slot over another local rank count (its positions do not map onto this
    node's: the slot's shard starts over, with a warning)."""
    raw = read_many(store, [position_key(slot, local_rank)])[0]
    if not raw:
        return None
    saved = json.loads(raw)
    if saved.get("local_world_size") != local_world_size:
        log.warning("data slot %d was held by a node of %s local ranks and this node has %d: its data position does not "
                    "carry over, the slot's shard starts from its beginning", slot, saved.get("local_world_size"),
                    local_world_size)
        return None
    return saved["state"]
