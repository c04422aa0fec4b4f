"""The replay guard's memory of its senders, bounded: for each sender the counters it was seen with (the
most recent exactly, the older ones as a floor below which everything is refused), for at most a fixed
number of senders; the least recently seen is forgotten first, and what it sent stays refused behind an
eviction floor (the highest counter of the senders forgotten that share its bucket of a keyed hash)."""

from __future__ import annotations

import hashlib
import secrets
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["MAX_SENDERS", "REORDER", "BUCKETS", "EvictionFloors", "SenderRecord", "SenderTable"]

MAX_SENDERS = 4096  # senders one table keeps: four times the largest swarm a coordinator serves (1000 volunteers)
REORDER = 32        # counters kept exactly per sender: its seals may arrive out of order by this many
BUCKETS = 65536     # eviction floors: a forgotten sender holds back the senders of its bucket only (512 KB)


class EvictionFloors:
    """The highest counter of any forgotten sender, per bucket of a hash keyed by `salt` (random, kept
    with the snapshot): a sender the table does not keep is held to its bucket's floor. One floor for
    all would let a token holder whose made-up senders sealed 59 s ahead of the clock, once forgotten,
    have every newcomer refused for up to a minute; per bucket, each such sender holds back only the
    newcomers of its own bucket (one in BUCKETS), and without the salt nobody can tell which those are."""

    def __init__(self, salt: bytes | None = None, buckets: int = BUCKETS):
        self.salt, self.buckets = salt or secrets.token_bytes(16), buckets
        self.floors: array | None = None  # made at the first sender forgotten (most guards never forget one)

    def bucket(self, sender: str) -> int:
        digest = hashlib.blake2b(sender.encode(errors="surrogatepass"), key=self.salt, digest_size=8).digest()
        return int.from_bytes(digest, "little") % self.buckets

    def of(self, sender: str) -> int:
        return 0 if self.floors is None else self.floors[self.bucket(sender)]

    def lift(self, sender: str, counter: int) -> None:
        """`sender` is forgotten: its counters up to `counter` stay refused."""
        self.set(self.bucket(sender), counter)

    def set(self, bucket: int, counter: int) -> None:
        if self.floors is None:
            self.floors = array("q", bytes(8 * self.buckets))
        self.floors[bucket] = max(self.floors[bucket], counter)

    def copy(self) -> tuple[bytes, array | None]:
        """(salt, floors) as they are now, for a snapshot written by another thread."""
        return self.salt, None if self.floors is None else array("q", self.floors)


@dataclass
class SenderRecord:
    """What the guard knows of one sender: counters at or below `floor` are refused, those in `seen`
    (all above the floor) were accepted; `high` is the highest of either."""

    floor: int
    high: int
    seen: set[int] = field(default_factory=set)


class SenderTable:
    """Senders and their counters, at most `cap` senders of at most `reorder` exact counters each.

    Forgetting a sender must not let its seals through again: a sender not in the table is held to its
    bucket's eviction floor (`evicted`), and so is a sender's new record. Senders go least recently
    seen first, so a member that seals a message every few seconds stays in the table unless more than
    `cap` other senders' seals come between two of its own; one pushed out is refused only for seals at
    or below its bucket's floor, which its own next ones are above unless a sender of its bucket
    forgotten meanwhile sealed ahead of them. A sender whose highest counter is off the clock is simply
    dropped (`prune`): the clock check refuses its seals anyway."""

    def __init__(self, cap: int = MAX_SENDERS, reorder: int = REORDER, evicted: EvictionFloors | None = None):
        self.cap, self.reorder = cap, reorder
        self.senders: OrderedDict[str, SenderRecord] = OrderedDict()  # least recently seen first
        self.evicted = evicted or EvictionFloors()

    def __len__(self) -> int:
        return len(self.senders)

    def record(self, sender: str) -> SenderRecord:
        """What `sender` is held to: its record, or for a sender not kept a new one at its bucket's
        eviction floor (kept only once `accept` takes a counter into it)."""
        record = self.senders.get(sender)
        if record is None:
            floor = self.evicted.of(sender)
            record = SenderRecord(floor, floor)
        return record

    def accept(self, sender: str, record: SenderRecord, counter: int) -> None:
        """Take `counter` of `sender` into its `record` (from `record`; the caller checked that it is
        above the floor and not seen), keeping the record if it is new."""
        if self.senders.get(sender) is record:
            self.senders.move_to_end(sender)
        else:
            self._keep(sender, record)
        record.seen.add(counter)
        record.high = max(record.high, counter)
        if len(record.seen) > self.reorder:
            oldest = min(record.seen)
            record.seen.discard(oldest)
            record.floor = max(record.floor, oldest)

    def restore(self, sender: str, high: int) -> None:
        """A sender's highest counter from before a restart: everything up to it is refused."""
        record = self.record(sender)
        record.floor = record.high = max(record.high, high)
        if sender not in self.senders:
            self._keep(sender, record)

    def _keep(self, sender: str, record: SenderRecord) -> None:
        self.senders[sender] = record
        while len(self.senders) > self.cap:
            name, gone = self.senders.popitem(last=False)
            self.evicted.lift(name, gone.high)

    def prune(self, horizon: int) -> None:
        """Forget counters below `horizon` (a counter off the clock): the clock check refuses them anyway, so a
        sender all of whose counters are that old is dropped (eviction floors that old refuse nothing either)."""
        for sender in [s for s, r in self.senders.items() if r.high < horizon]:
            del self.senders[sender]
        for record in self.senders.values():
            old = [c for c in record.seen if c < horizon]
            if old:
                record.seen.difference_update(old)
                record.floor = max(record.floor, max(old))

    def highs(self) -> dict[str, int]:
        """Each sender's highest counter (what a snapshot keeps)."""
        return {sender: record.high for sender, record in self.senders.items()}
