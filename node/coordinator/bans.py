"""Bans of repeat offenders: a node whose micro-batches its neighbours keep refusing (malformed,
non-finite, oversized) is put out of the swarm for a while, as Petals bans servers that fail its
clients, so that a standby takes its stage instead of the pipeline replaying steps for ever."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping

__all__ = ["BanPolicy", "Bans"]


@dataclass(frozen=True)
class BanPolicy:
    """`threshold` refused micro-batches within `window_s` seconds ban the sender for `ban_s`."""

    threshold: int = 3
    window_s: float = 60.0
    ban_s: float = 600.0


class Bans:
    """Offences as the neighbours report them (cumulative counts per reporter and sender), and the
    bans they led to. `clock` is injectable for tests."""

    def __init__(self, policy: BanPolicy = BanPolicy(), clock: Callable[[], float] = time.monotonic):
        self.policy, self.clock = policy, clock
        self.reported: dict[tuple[str, str], int] = {}  # (reporter, sender) -> count reported so far
        self.recent: dict[str, deque] = {}                # sender -> times of its offences in the window
        self.until: dict[str, float] = {}                 # sender -> when its ban ends

    def report(self, reporter: str, offences: Mapping[str, int]) -> list[str]:
        """Take a reporter's cumulative counts; the senders this report bans (not banned before)."""
        now, banned = self.clock(), []
        for sender, count in offences.items():
            new = count - self.reported.get((reporter, sender), 0)
            self.reported[(reporter, sender)] = max(count, self.reported.get((reporter, sender), 0))
            if new <= 0 or sender == reporter:
                continue
            times = self.recent.setdefault(sender, deque())
            times.extend([now] * min(new, self.policy.threshold))
            while times and now - times[0] > self.policy.window_s:
                times.popleft()
            if len(times) >= self.policy.threshold and not self.left(sender):
                self.until[sender] = now + self.policy.ban_s
                times.clear()
                banned.append(sender)
        return banned

    def left(self, node_id: str) -> float:
        """Seconds the node's ban still lasts (0: not banned)."""
        end = self.until.get(node_id)
        if end is None:
            return 0.0
        if end <= self.clock():
            del self.until[node_id]
            return 0.0
        return end - self.clock()
