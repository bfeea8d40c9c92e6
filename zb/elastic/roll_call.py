"""The store keys of one roll call (resolution n) and what a node does with them: its answer, the wake-ups that the
waiting nodes `wait` on instead of polling, the end marker, and the cleanup once every member has moved past it.
The protocol that decides who answers, who judges and what the next world is lives in zb.elastic.membership and
zb.elastic.judge; this module only knows the keys (zb.elastic.keys)."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from torch.distributed import DistStoreError

from zb.elastic import keys
from zb.elastic.store_state import counter_value
from zb.elastic.tcpstore import read_many

if TYPE_CHECKING:
    from zb.store_clients import StoreClient


def events_bound(members: int) -> int:
    """The most events a roll call of a world of `members` can have: each member answers once per resolution it
    takes part in, and every leader that writes the next world announces it (a few, racing), with room to spare."""
    return 4 * members + 16


def wait_key(client: StoreClient, key: str, seconds: float) -> bool:
    """Whether `key` was set within `seconds`. A wait of 0 s or less is none: torch's TCPStore takes a zero or
    negative timeout as none at all and would block for good."""
    if seconds < 0.001:
        return client.check([key])
    try:
        client.wait([key], timedelta(seconds=seconds))
        return True
    except DistStoreError as e:
        if "timeout" not in str(e):
            raise
        return False


class RollCall:
    """The keys of the roll call of `resolution`, through `client`."""

    def __init__(self, client: StoreClient, resolution: int) -> None:
        self.client, self.resolution = client, resolution
        self.events = keys.roll_call_events(resolution)

    def answer(self, line: str) -> None:
        """Append this node's answer (one JSON line) and wake the nodes that judge the roll call."""
        self.client.append(keys.roll_call(self.resolution), line)
        self.announce()

    def announce(self) -> None:
        """Wake the nodes waiting in this roll call: something happened (an answer, the next world)."""
        n = self.client.add(self.events, 1)
        self.client.set(f"{self.events}/{n}", b"")

    def mark_written(self) -> None:
        """The roll call ended (its next world is written): keys.written wakes its waiters, keys.ENDED tells the next
        light reads in their one round trip (zb.elastic.store_state.read_light)."""
        self.client.set(keys.written(self.resolution), "1")
        self.client.set(keys.ENDED, str(self.resolution))

    def wait_event(self, event: int, seconds: float) -> None:
        """Until the roll call's event number `event` (the one after which the verdict can change: the last answer
        still awaited), or `seconds`: the judge also decides on time alone (a silent member's deadline), so the
        caller looks again either way. Waiting on the store instead of sleeping ends the roll call as soon as its
        last answer or its next world lands, and waiting for the last answer instead of the next one reads the
        roll call once, not at every answer."""
        wait_key(self.client, f"{self.events}/{event}", seconds)

    def wait_written(self, seconds: float) -> bool:
        """A node that does not judge: until the roll call's world is written (True), or `seconds`."""
        return wait_key(self.client, keys.written(self.resolution), seconds)

    def forget(self, members: int) -> None:
        """Delete this finished roll call's keys (every member has moved past it). Its events counter is unsealed
        (anyone reaching the store can bump it), so the count of wake-up keys deleted is bounded by what a roll call
        of a world of `members` can announce (events_bound); beyond that a bumped counter names keys nobody wrote,
        which are left alone (deleting 10**9 of them hung the leader)."""
        # Read, not `add(events, 0)`: on a value that is no integer the store drops the connection (it answered an
        # outsider's one write by re-keying this node's client before the marker was kept: zb.signed_store).
        written = counter_value(read_many(self.client, [self.events])[0])
        count = max(0, min(written, events_bound(members)))
        for key in (keys.roll_call(self.resolution), self.events, keys.written(self.resolution),
                    *(f"{self.events}/{n}" for n in range(1, count + 1))):
            self.client.delete_key(key)
