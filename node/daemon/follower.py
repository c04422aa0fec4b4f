"""Following the coordinator's assignments: the neighbours of this node's stage can change (a
standby took one over), and the data plane's links must point at them; how many pipelines train
changes (whom its stage averages with); an assignment without this node's stage of its pipeline
means it lost the stage (`lost`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from ..net.transport import BACKWARD, FORWARD, Transport
from ..proto import tahnode_pb2 as pb
from .heartbeats import Heartbeats

log = logging.getLogger("tahnode.daemon")

__all__ = ["AssignmentFollower"]


class AssignmentFollower:
    """Points the transport's links at the peers of every assignment of stage `stage` of pipeline
    `pipeline`, and hands each such assignment to `on_assignment` (how many pipelines train); sets
    `lost` once an assignment names another stage or pipeline (or none)."""

    def __init__(self, transport: Transport, stage: int, heartbeats: Heartbeats, pipeline: int = 0,
                 on_assignment: Callable[[pb.Assignment], None] | None = None):
        self.t, self.stage, self.pipeline, self.beats = transport, stage, pipeline, heartbeats
        self.on_assignment = on_assignment
        self.task: asyncio.Task | None = None
        self.lost = asyncio.Event()
        self.assignment: pb.Assignment | None = None  # the one that took the stage away

    def apply(self, assignment: pb.Assignment) -> None:
        if (assignment.stage, assignment.pipeline) != (self.stage, self.pipeline):
            if not self.lost.is_set():
                log.warning("the coordinator no longer gives stage %d of pipeline %d to this node (it was declared "
                            "failed and the stage went to another, or its pipeline was dissolved); stopping the stage",
                            self.stage, self.pipeline)
                self.assignment = assignment
                self.lost.set()
            return
        for direction, peer in ((FORWARD, assignment.next), (BACKWARD, assignment.prev)):
            self.t.set_peer(direction, peer.node_id, peer.address, peer.public_key, peer.tls_cert)
        if self.on_assignment is not None:
            self.on_assignment(assignment)

    async def _follow(self) -> None:
        while True:
            self.apply(await self.beats.next_assignment())

    def start(self, first: pb.Assignment) -> None:
        self.apply(first)
        self.task = asyncio.create_task(self._follow())

    def stop(self) -> None:
        if self.task:
            self.task.cancel()
