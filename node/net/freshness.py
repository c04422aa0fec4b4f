"""Freshness and binding of signed messages: a sender seals each one with the run, itself, its
recipient and a strictly increasing clock counter (`SealCounter`); a receiver's `ReplayGuard`
refuses a seal meant for someone else, from another run, off its clock, or seen before, also
before the receiver restarted: each counter that raises a sender's highest is written down before
its message is accepted (tahnode.net.counter_journal), and what the guard keeps is bounded
(tahnode.net.sender_table)."""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter
from pathlib import Path

from .counter_journal import SAVE_S, CounterJournal
from .sender_table import MAX_SENDERS, EvictionFloors, SenderTable

log = logging.getLogger("tahnode.auth")

__all__ = ["CLOCK_WINDOW_S", "START_SLACK_S", "COORDINATOR", "TOKEN_ONLY", "SealCounter", "SealRefused",
           "RefusalReason", "SenderKind", "ReplayGuard"]

CLOCK_WINDOW_S = 60.0   # a seal's counter may differ from the receiver's clock by this much, either way
START_SLACK_S = 5.0     # seals from more than this before the receiver started are refused (recorded earlier)
COORDINATOR = "coordinator"  # the recipient name of every control-plane request
TOKEN_ONLY = "\x00token-only:"  # the guard's name for a sender of messages no node key signed (pings, probes)


class RefusalReason(enum.Enum):
    """Why a seal was refused (the label of the refusal counters on /metrics)."""

    BAD_MAC = "bad_mac"              # not even authentic (wrong token, or altered)
    MISSING = "missing"              # no seal, or no sender
    WRONG_RECIPIENT = "wrong_recipient"
    WRONG_RUN = "wrong_run"
    WRONG_SENDER = "wrong_sender"    # the seal's sender is not who the message speaks for
    WRONG_KEY = "wrong_key"          # not signed by the key bound to the sender (or by none)
    STRANGER = "stranger"            # frames from a node that is not a neighbour of this one
    OFF_CLOCK = "off_clock"          # outside the clock window, or from before the receiver started
    REPLAYED = "replayed"            # this sender's counter was seen before
    UNRECORDED = "unrecorded"        # the guard could not write the counter down: a restart would accept it again


class SealRefused(ValueError):
    """A message whose seal this receiver does not accept; `reason` says why."""

    def __init__(self, reason: RefusalReason, detail: str):
        super().__init__(detail)
        self.reason = reason


class SealCounter:
    """A sender's counters: its clock in microseconds, but always above the last one it gave."""

    def __init__(self, clock=time.time):
        self.clock, self.last = clock, 0

    def next(self) -> int:
        self.last = max(self.last + 1, int(self.clock() * 1e6))
        return self.last


class SenderKind(enum.Enum):
    """The guard's two tables: senders whose node key signed their messages, and token-only ones
    (pings, probes: any token holder may name any sender there, so they never crowd out the first)."""

    SIGNED = "signed"
    TOKEN_ONLY = "token_only"

    @classmethod
    def of(cls, sender: str) -> "SenderKind":
        return cls.TOKEN_ONLY if sender.startswith(TOKEN_ONLY) else cls.SIGNED


class ReplayGuard:
    """The receiving side: `check(run, sender, recipient, counter)` raises SealRefused or records the
    counter as seen; `refused` counts the refusals by reason.

    Bounded: each table (SenderKind) keeps at most `cap` senders, each with its last REORDER counters
    exactly and a floor below them (tahnode.net.sender_table); counters and senders off the clock are
    dropped, since the clock check refuses them anyway. With a `store`, a seal is counted only once it
    is durable: a counter above its sender's highest is appended to the store's journal before `check`
    returns (tahnode.net.counter_journal), so a replay after a restart meets it there, however soon
    after the seal the receiver went down (before, the counters were saved every 2 s and a seal
    accepted in between was accepted again after a restart: START_SLACK_S lets seals of the last few
    seconds before the start through, for clocks a little behind). A seal the guard cannot write down
    is refused (UNRECORDED). Every SAVE_S, if the journal grew, a thread replaces it by a snapshot."""

    def __init__(self, me: str, run: str = "", window_s: float = CLOCK_WINDOW_S, clock=time.time,
                 store: Path | None = None, cap: int = MAX_SENDERS):
        self.me, self.run, self.window, self.clock = me, run, window_s, clock
        self.started = clock()
        self.tables = {kind: SenderTable(cap) for kind in SenderKind}
        self.refused: Counter[RefusalReason] = Counter()
        self.last_prune = self.last_save = self.started
        self.store = store
        self.journal = CounterJournal(store) if store is not None else None
        if self.journal is not None:
            self._load()

    def _load(self) -> None:
        """The counters of an earlier run of this process (refused whatever the sender's clock says),
        but those already off the clock."""
        try:
            found = self.journal.load()
        except OSError as exc:
            log.warning("could not read the counters seen before a restart beside %s (%s): starting without them",
                        self.store, exc)
            return
        horizon = int((self.started - self.window) * 1e6)
        for kind in SenderKind:
            salt, floors = found.floors.get(kind.value, (None, {}))
            if salt is None:
                continue
            evicted = self.tables[kind].evicted = EvictionFloors(salt)
            for bucket, floor in floors.items():
                if floor >= horizon and 0 <= bucket < evicted.buckets:
                    evicted.set(bucket, floor)
        for sender, high in sorted(found.highs.items(), key=lambda item: item[1]):  # the oldest go first if too many
            if high >= horizon:
                self.tables[SenderKind.of(sender)].restore(sender, high)

    def highs(self) -> dict[str, int]:
        """Each sender's highest counter, of both tables."""
        return {sender: high for table in self.tables.values() for sender, high in table.highs().items()}

    def save(self) -> None:
        """Fold the journal into a snapshot now, and wait for it (owner-only, replaced atomically)."""
        if self.journal is not None:
            self._compact(wait=True)

    def _compact(self, wait: bool = False) -> None:
        now = self.clock()
        floors = {kind.value: self.tables[kind].evicted.copy() for kind in SenderKind}
        if self.journal.compact(self.highs(), floors, int((now - self.window) * 1e6), wait=wait):
            self.last_save = now

    def check(self, run: str, sender: str, recipient: str, counter: int, *, run_optional: bool = False) -> None:
        try:
            self._check(run, sender, recipient, counter, run_optional)
        except SealRefused as exc:
            self.refused[exc.reason] += 1
            raise

    def _check(self, run: str, sender: str, recipient: str, counter: int, run_optional: bool) -> None:
        if not sender or not counter:
            raise SealRefused(RefusalReason.MISSING, "the message carries no seal (an older tahnode, or forged)")
        if recipient != self.me:
            raise SealRefused(RefusalReason.WRONG_RECIPIENT,
                              f"sealed for {recipient!r}, not for {self.me!r} (recorded elsewhere?)")
        if self.run and run != self.run and not (run_optional and not run):
            raise SealRefused(RefusalReason.WRONG_RUN, f"sealed for run {run!r}, this is run {self.run!r}")
        now = self.clock()
        sent = counter / 1e6
        if abs(sent - now) > self.window:
            raise SealRefused(RefusalReason.OFF_CLOCK, f"sealed {sent - now:+.0f} s from this node's clock: replayed, "
                              f"or the clocks differ by more than {self.window:.0f} s (synchronise them with NTP)")
        if sent < self.started - START_SLACK_S:
            raise SealRefused(RefusalReason.OFF_CLOCK,
                              f"sealed {self.started - sent:.0f} s before this process started: replayed")
        table = self.tables[SenderKind.of(sender)]
        record = table.record(sender)
        if counter in record.seen:
            raise SealRefused(RefusalReason.REPLAYED, f"counter {counter} of {sender!r} was seen before: replayed")
        if counter <= record.floor:
            raise SealRefused(RefusalReason.REPLAYED, f"counter {counter} of {sender!r} is at or below the last one "
                              "kept of it (from before this process restarted, or of a sender it forgot): replayed")
        if self.journal is not None and counter > record.high:  # a restart refuses up to its highest: new to disk
            try:
                self.journal.append(sender, counter)
            except OSError as exc:
                raise SealRefused(RefusalReason.UNRECORDED, f"could not write counter {counter} of {sender!r} "
                                  f"down ({exc}): refused, since a restart would accept it again") from None
        table.accept(sender, record, counter)
        if now - self.last_prune > self.window:
            self._prune(now)
        if self.journal is not None and self.journal.grown and now - self.last_save > SAVE_S:
            self._compact()

    def _prune(self, now: float) -> None:
        """Forget the counters, and the senders, that are off the clock by now: a seal of theirs is
        refused as OFF_CLOCK whatever was recorded of it."""
        horizon = int((now - self.window) * 1e6)
        for table in self.tables.values():
            table.prune(horizon)
        self.last_prune = now
