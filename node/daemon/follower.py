"""Following the coordinator's assignments: the neighbours of this node's stage can change (a
standby took one over), and the data plane's links must point at them; an assignment without
this node's stage means it lost the stage (`lost`)."""

from __future__ import annotations

import asyncio
import logging

from ..net.transport import BACKWARD, FORWARD, Transport
from ..proto import tahnode_pb2 as pb
from .heartbeats import Heartbeats

log = logging.getLogger("tahnode.daemon")

__all__ = ["AssignmentFollower"]


class AssignmentFollower:
    """Points the transport's links at the peers of every assignment of stage `stage`; sets `lost`
    once an assignment names another stage (or none)."""

    def __init__(self, transport: Transport, stage: int, heartbeats: Heartbeats):
        self.t, self.stage, self.beats = transport, stage, heartbeats
        self.task: asyncio.Task | None = None
        self.lost = asyncio.Event()
        self.assignment: pb.Assignment | None = None  # the one that took the stage away

    def apply(self, assignment: pb.Assignment) -> None:
        if assignment.stage != self.stage:
            if not self.lost.is_set():
                log.warning("the coordinator no longer gives stage %d to this node (it was declared failed and the stage "
                            "went to another); stopping the stage", self.stage)
                self.assignment = assignment
                self.lost.set()
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
