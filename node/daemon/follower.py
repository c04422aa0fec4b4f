"""Following the coordinator's assignments: the neighbours of this node's stage can change (a
standby took one over), and the data plane's links must point at them."""

from __future__ import annotations

import asyncio
import logging

from ..net.transport import BACKWARD, FORWARD, Transport
from ..proto import tahnode_pb2 as pb
from .heartbeats import Heartbeats

log = logging.getLogger("tahnode.daemon")

__all__ = ["AssignmentFollower"]


class AssignmentFollower:
    """Points the transport's links at the peers of every assignment of stage `stage`."""

    def __init__(self, transport: Transport, stage: int, heartbeats: Heartbeats):
        self.t, self.stage, self.beats = transport, stage, heartbeats
        self.task: asyncio.Task | None = None

    def apply(self, assignment: pb.Assignment) -> None:
        if assignment.stage != self.stage:
            log.warning("the coordinator moved this node from stage %d to %d; it keeps stage %d until restarted",
                        self.stage, assignment.stage, self.stage)
            return
        for direction, peer in ((FORWARD, assignment.next), (BACKWARD, assignment.prev)):
            self.t.set_peer(direction, peer.node_id, peer.address, peer.public_key, peer.tls_cert)

    async def _follow(self) -> None:
        while True:
            self.apply(await self.beats.next_assignment())

    def start(self, first: pb.Assignment) -> None:
        self.apply(first)
        self.task = asyncio.create_task(self._follow())

    def stop(self) -> None:
        if self.task:
            self.task.cancel()
