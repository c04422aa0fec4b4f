"""The rules both sides of a stage's averaging share (StageAverager in the node's process, hivemind's
averager in its own: tahnode.net.averaging_parts): the deadlines of a round, the key of the served
state, which part is usable, and the ledger of what was refused, sent and received."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

import torch

from ..train.clip_rule import SenderView

__all__ = ["Ledger", "Tally", "usable", "MIN_MATCHMAKING_S", "REQUEST_TIMEOUT_S", "CHUNK_TIMEOUT_S", "GRACE_S",
           "allreduce_timeout_s", "CONTROL_TIMEOUT_S", "STATE_KEY"]

MIN_MATCHMAKING_S = 0.5      # the least time a replica looks for its group
REQUEST_TIMEOUT_S = 0.3      # how long a would-be leader may take to answer (below MIN_MATCHMAKING_S: hivemind)
# a sender silent this long between two parts (of at most 512 KiB: 0.4 s at 10 Mbit/s) is dropped, a
# reducer after twice this: a replica that dies in an all-reduce costs the others 15 s at most, within
# the outer step's deadline (swarm.outer_timeout_s, 30 s); with 20 s it cost them 70 s
CHUNK_TIMEOUT_S = 5.0
GRACE_S = 1.5                # after the deadline, the time the leader's "begin" message may take to arrive
SLOWEST_LINK_BPS = 10e6      # the slowest link tahnode is built for (10 Mbit/s)
CONTROL_TIMEOUT_S = 30.0     # the most the averager's process may take to answer a control message
STATE_KEY = "tahnode"        # served metadata is wrapped: hivemind takes an empty dict for "no state"


def allreduce_timeout_s(values: int, bits: int) -> float:
    """The most an all-reduce of `values` at `bits` bits may take once its group formed: a minute, and
    four times what a replica sends and receives in it (its vector twice) takes on the slowest link.
    A fixed 600 s let a round whose other two replicas had left hold its stage for over nine minutes."""
    return 60.0 + 4 * 2 * values * bits / SLOWEST_LINK_BPS


def usable(part: torch.Tensor | None, shape) -> torch.Tensor | None:
    """`part` as float32 if it is a floating tensor of `shape` with every value finite, else None."""
    if not torch.is_tensor(part) or tuple(part.shape) != tuple(shape) or not part.is_floating_point():
        return None
    part = part.detach().to(torch.float32)
    return part if bool(torch.isfinite(part).all()) else None


@dataclass
class Tally:
    """One round as the averager's process counted it, for the parent: the evidence its peers' standing
    is judged on (tahnode.pipeline.peer_standing), and the bytes."""

    refused: dict[str, int] = field(default_factory=dict)  # peer id -> its parts (or averages) refused
    sent: int = 0             # serialized bytes sent
    received: int = 0
    partial: bool = False     # a part's average never came back: some values are this replica's own
    dropped: int = 0          # the most replicas of the group that a part's average left out (silent senders)
    views: dict[str, SenderView] = field(default_factory=dict)  # peer id -> what this reducer saw of its parts
    stalled: set[str] = field(default_factory=set)  # reducers whose averages never came back in time
    silent: set[str] = field(default_factory=set)   # senders whose parts never came in time
    group: list[str] = field(default_factory=list)  # the round's group (peer ids), once it formed


class Ledger:
    """What the averager's process tallies until the parent takes it after a round: parts refused per
    peer, what it saw of each sender's parts, reducers and senders that went silent, the serialized bytes
    it sent and received, the replicas its averages left out; and the peers allowed in its groups (before
    the parent names them: none)."""

    def __init__(self):
        self.members: frozenset[str] = frozenset()
        self.suspended: frozenset[str] = frozenset()
        self.tally = Tally()

    def admits(self, peer) -> bool:
        """Members only: none before the parent names them (set_members). A member serves and is served a state."""
        return str(peer) in self.members

    def groups_with(self, peer) -> bool:
        """A member not sitting out this round (set_suspended: it stalled the last one) joins a group with it."""
        return str(peer) in self.members and str(peer) not in self.suspended

    def refuse(self, peer) -> None:
        self.tally.refused[str(peer)] = self.tally.refused.get(str(peer), 0) + 1

    def observe(self, peer, view: SenderView) -> None:
        self.tally.views.setdefault(str(peer), SenderView()).add(view)

    def mark_partial(self, reducer=None) -> None:
        self.tally.partial = True
        if reducer is not None:
            self.tally.stalled.add(str(reducer))

    def mark_silent(self, sender) -> None:
        self.tally.silent.add(str(sender))

    def mark_dropped(self, count: int) -> None:
        self.tally.dropped = max(self.tally.dropped, count)

    def take(self) -> Tally:
        tally, self.tally = self.tally, Tally()
        return tally

    async def counting_received(self, stream: AsyncIterator) -> AsyncIterator:
        async for message in stream:
            self.tally.received += message.ByteSize()
            yield message

    async def counting_averages(self, stream: AsyncIterator) -> AsyncIterator:
        """A reducer's answers, counted; each average's `weight` is how many of the group's replicas
        it left out (senders silent past the sender timeout), which this replica's mean then lacks."""
        async for message in self.counting_received(stream):
            if message.HasField("tensor_part") and message.weight >= 1:
                self.mark_dropped(int(min(message.weight, 1 << 16)))
            yield message
