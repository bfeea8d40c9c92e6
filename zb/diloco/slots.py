"""Data slots: each live node reads its own data shard, claimed in the global store.

A slot is a data rank in [0, data_world_size). A node keeps the slot it held before (same unique
id); otherwise it takes a free one, or one whose holder is no longer in the world. Claims use
compare_set, so two joiners never get the same slot. Each slot's data position (per local rank)
is written at every outer step, so a later holder continues where the last one stopped and
never replays samples the run has already seen.
"""

from __future__ import annotations

import json
from typing import Any

from zb.elastic.tcpstore import read_many
from zb.errors import EnvironmentFailure

ROOT = "zb/data"


def slot_key(slot: int) -> str:
    return f"{ROOT}/slot/{slot}"


def position_key(slot: int, local_rank: int) -> str:
    return f"{ROOT}/pos/{slot}/{local_rank}"


def claim_slot(store, uid: str, live_nodes: list[str], num_slots: int, preferred: int | None = None) -> int:
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


def save_position(store, slot: int, local_rank: int, state: dict[str, Any]) -> None:
    store.set(position_key(slot, local_rank), json.dumps(state, sort_keys=True))


def load_position(store, slot: int, local_rank: int) -> dict[str, Any] | None:
    raw = read_many(store, [position_key(slot, local_rank)])[0]
    return json.loads(raw) if raw else None
