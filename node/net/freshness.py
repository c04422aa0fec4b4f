"""Freshness and binding of signed messages: a sender seals each one with the run, itself, its
recipient and a strictly increasing clock counter (`SealCounter`); a receiver's `ReplayGuard`
refuses a seal meant for someone else, from another run, off its clock, or seen before."""

from __future__ import annotations

import enum
import time
from collections import Counter

__all__ = ["CLOCK_WINDOW_S", "START_SLACK_S", "COORDINATOR", "SealCounter", "SealRefused", "RefusalReason", "ReplayGuard"]

CLOCK_WINDOW_S = 60.0   # a seal's counter may differ from the receiver's clock by this much, either way
START_SLACK_S = 5.0     # seals from more than this before the receiver started are refused (recorded earlier)
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

    def __init__(self, me: str, run: str = "", window_s: float = CLOCK_WINDOW_S, clock=time.time):
        self.me, self.run, self.window, self.clock = me, run, window_s, clock
        self.started = clock()
        self.seen: dict[str, dict[int, float]] = {}
        self.refused: Counter[RefusalReason] = Counter()
        self.last_prune = self.started

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
            raise SealRefused(RefusalReason.WRONG_RECIPIENT, f"sealed for {recipient!r}, not for {self.me!r} (recorded elsewhere?)")
        if self.run and run != self.run and not (run_optional and not run):
            raise SealRefused(RefusalReason.WRONG_RUN, f"sealed for run {run!r}, this is run {self.run!r}")
        now = self.clock()
        sent = counter / 1e6
        if abs(sent - now) > self.window:
            raise SealRefused(RefusalReason.OFF_CLOCK, f"sealed {sent - now:+.0f} s from this node's clock: replayed, or the "
                              f"clocks differ by more than {self.window:.0f} s (synchronise them with NTP)")
        if sent < self.started - START_SLACK_S:
            raise SealRefused(RefusalReason.OFF_CLOCK, f"sealed {self.started - sent:.0f} s before this process started: replayed")
        seen = self.seen.setdefault(sender, {})
        if counter in seen:
            raise SealRefused(RefusalReason.REPLAYED, f"counter {counter} of {sender!r} was seen before: replayed")
        seen[counter] = sent
        if now - self.last_prune > self.window:
            self._prune(now)

    def _prune(self, now: float) -> None:
        horizon = now - self.window
        for sender in list(self.seen):
            kept = {c: t for c, t in self.seen[sender].items() if t >= horizon}
            if kept:
                self.seen[sender] = kept
            else:
                del self.seen[sender]
        self.last_prune = now
