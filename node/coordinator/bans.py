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

from ..net.tls import host_of

__all__ = ["BanPolicy", "Bans", "ban_marks"]


def ban_marks(node_id: str, public_key: bytes, address: str, seen: str = "") -> list[str]:
    """What a ban of this node holds on to: `id:` its node id, `key:` its identity key; `addr:` the
    exact address it claimed to serve on, where its carrier confirms the claim (`seen`, the caller as
    gRPC or p2p saw it: "ipv4:1.2.3.4:5678", "p2p:<peer id>"; its host or peer id is the address's)
    or cannot tell (""); and `host:` the host its join came from, if public (a private or loopback one
    is shared by unrelated nodes). Never a host it only claimed: anyone may claim a victim's, and the
    ban locked the victim out (issue 39, finding 7)."""
    marks = [f"id:{node_id}"] + ([f"key:{public_key.hex()}"] if public_key else [])
    kind, _, caller = seen.partition(":")
    host = host_of(caller) if kind in ("ipv4", "ipv6") else ""
    if address and (not seen or _claimed(address) in (host or None, caller if kind == "p2p" else None)):
        marks.append(f"addr:{address}")
    try:
        public = bool(host) and ipaddress.ip_address(host).is_global
    except ValueError:
        public = False
    return marks + ([f"host:{host}"] if public else [])


def _claimed(address: str) -> str:
    """The host of a host:port address, the peer id of a p2p one."""
    if address.startswith("/"):
        return address.rsplit("/p2p/", 1)[-1] if "/p2p/" in address else ""
    return host_of(address)


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
        # sender (and, once banned, its other marks) -> when its ban ends
        self.until: dict[str, float] = {}

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

    def ban(self, node_id: str) -> float:
        """Ban `node_id` now for the policy's time (a verdict reached elsewhere); when it ends."""
        self.until[node_id] = max(self.until.get(node_id, 0.0), self.clock() + self.policy.ban_s)
        return self.until[node_id]

    def left(self, node_id: str) -> float:
        """Seconds the node's ban still lasts (0: not banned)."""
        end = self.until.get(node_id)
        if end is None:
            return 0.0
        if end <= self.clock():
            del self.until[node_id]
            return 0.0
        return end - self.clock()
