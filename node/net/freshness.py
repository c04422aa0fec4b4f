"""Freshness and binding of signed messages: a sender seals each one with the run, itself, its
recipient and a strictly increasing clock counter (`SealCounter`); a receiver's `ReplayGuard`
refuses a seal meant for someone else, from another run, off its clock, or seen before, also
before the receiver restarted: the highest counter of each sender is kept on disk."""

from __future__ import annotations

import enum
import json
import logging
import os
import time
from collections import Counter
from pathlib import Path

log = logging.getLogger("tahnode.auth")

__all__ = ["CLOCK_WINDOW_S", "START_SLACK_S", "COORDINATOR", "SealCounter", "SealRefused", "RefusalReason",
           "ReplayGuard"]

CLOCK_WINDOW_S = 60.0   # a seal's counter may differ from the receiver's clock by this much, either way
START_SLACK_S = 5.0     # seals from more than this before the receiver started are refused (recorded earlier)
SAVE_S = 2.0            # how often a guard with a file writes its senders' highest counters
COORDINATOR = "coordinator"  # the recipient name of every control-plane request


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


class ReplayGuard:
    """The receiving side: `check(run, sender, recipient, counter)` raises SealRefused or records the
    counter as seen. Seen counters are kept for the clock window (older ones are refused as off the
    clock anyway), so memory stays bounded by what senders can send in one window. `refused`
    counts the refusals by reason."""

    def __init__(self, me: str, run: str = "", window_s: float = CLOCK_WINDOW_S, clock=time.time,
                 store: Path | None = None):
        self.me, self.run, self.window, self.clock = me, run, window_s, clock
        self.started = clock()
        self.seen: dict[str, dict[int, float]] = {}
        self.refused: Counter[RefusalReason] = Counter()
        self.last_prune = self.last_save = self.started
        # each sender's highest counter: those of an earlier run of this process (`floor`, refused
        # whatever the sender's clock says) and this run's (`high`, saved to `store` every SAVE_S)
        self.store = store
        self.floor: dict[str, int] = self._load()
        self.high: dict[str, int] = dict(self.floor)

    def _load(self) -> dict[str, int]:
        if self.store is None or not self.store.exists():
            return {}
        try:
            return current({str(k): int(v) for k, v in json.loads(self.store.read_text()).items()},
                           self.started - self.window)
        except (ValueError, OSError, AttributeError) as exc:
            log.warning("could not read the counters seen before a restart from %s (%s): starting without them",
                        self.store, exc)
            return {}

    def save(self) -> None:
        """Write each sender's highest counter (owner-only, replaced atomically)."""
        if self.store is None:
            return
        tmp = self.store.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(self.high, fh)
        os.replace(tmp, self.store)
        self.last_save = self.clock()

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
        if counter <= self.floor.get(sender, 0):
            raise SealRefused(RefusalReason.REPLAYED,
                              f"counter {counter} of {sender!r} is from before this process restarted: replayed")
        seen = self.seen.setdefault(sender, {})
        if counter in seen:
            raise SealRefused(RefusalReason.REPLAYED, f"counter {counter} of {sender!r} was seen before: replayed")
        seen[counter] = sent
        if counter > self.high.get(sender, 0):
            self.high[sender] = counter
        if self.store is not None and now - self.last_save > SAVE_S:
            self.save()
        if now - self.last_prune > self.window:
            self._prune(now)

    def _prune(self, now: float) -> None:
        """Forget the counters, and the senders, that are off the clock by now: a seal of theirs is
        refused as OFF_CLOCK whatever was recorded of it, so what the guard keeps (and saves) is
        bounded by what senders sealed within one window, not by every name it ever saw."""
        horizon = now - self.window
        for sender in list(self.seen):
            kept = {c: t for c, t in self.seen[sender].items() if t >= horizon}
            if kept:
                self.seen[sender] = kept
            else:
                del self.seen[sender]
        self.high = current(self.high, horizon)
        self.floor = current(self.floor, horizon)
        self.last_prune = now


def current(counters: dict[str, int], horizon: float) -> dict[str, int]:
    """The senders whose highest counter is at or after `horizon` (seconds of the clock)."""
    return {sender: counter for sender, counter in counters.items() if counter / 1e6 >= horizon}
