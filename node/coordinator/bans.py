"""Bans of repeat offenders: a node whose micro-batches its neighbours keep refusing (malformed,
non-finite, oversized) is put out of the swarm for a while, as Petals bans servers that fail its
clients, so that a standby takes its stage instead of the pipeline replaying steps for ever.

A ban holds the node's id, its identity key and its address (the host where it is a public one: a
new id and key from the same machine stay out), in wall-clock time, so the coordinator's database
keeps them across a restart."""

from __future__ import annotations

import ipaddress
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping

__all__ = ["BanPolicy", "Bans", "ban_marks"]


def ban_marks(node_id: str, public_key: bytes, address: str) -> list[str]:
    """What a ban of this node holds on to: `id:` its node id, `key:` its identity key, and `host:` the
    host of a public address (a private or loopback one is shared by unrelated nodes: `addr:` the
    exact address then; a p2p address names a peer id, which costs nothing to change: `addr:` too)."""
    marks = [f"id:{node_id}"] + ([f"key:{public_key.hex()}"] if public_key else [])
    host = address.rsplit(":", 1)[0].strip("[]") if address and not address.startswith("/") else ""
    try:
        public = bool(host) and ipaddress.ip_address(host).is_global
    except ValueError:
        public = False
    return marks + ([f"host:{host}"] if public else [f"addr:{address}"] if address else [])


@dataclass(frozen=True)
class BanPolicy:
    """`threshold` refused micro-batches within `window_s` seconds ban the sender for `ban_s`."""

    threshold: int = 3
    window_s: float = 60.0
    ban_s: float = 600.0


class Bans:
    """Offences as the neighbours report them (cumulative counts per reporter and sender), and the
    bans they led to. `clock` is injectable for tests."""

    def __init__(self, policy: BanPolicy = BanPolicy(), clock: Callable[[], float] = time.time):
        self.policy, self.clock = policy, clock
        self.reported: dict[tuple[str, str], int] = {}  # (reporter, sender) -> count reported so far
        self.recent: dict[str, deque] = {}                # sender -> times of its offences in the window
        self.until: dict[str, float] = {}                 # sender (and, once banned, its other marks) -> when its ban ends

    def extend(self, marks: list[str], until: float) -> None:
        """Hold the ban of `until` on these marks too (ban_marks: key, address)."""
        for mark in marks:
            self.until[mark] = max(until, self.until.get(mark, 0.0))

    def left_any(self, marks: list[str]) -> float:
        """The longest ban left on any of the marks (0: none is banned)."""
        return max((self.left(m) for m in marks), default=0.0)

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
