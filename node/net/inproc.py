"""An in-process transport: the stages of a swarm in one event loop, linked by queues with the same
contract as gRPC (queues, generations, new streams after a failure). For unit tests of the
pipeline: they run in milliseconds, and a link can be cut on purpose."""

from __future__ import annotations

import asyncio
import time

from ..config.emulation import LinkEmulation
from .body import open_body
from .links import LinkedTransport, OutLink
from .transport import Direction, Inbound

__all__ = ["InProcessNetwork", "InProcessTransport"]


class InProcessNetwork:
    """The transports of several nodes, addressed by node id."""

    def __init__(self):
        self.nodes: dict[str, InProcessTransport] = {}

    def transport(self, node_id: str, emulation: LinkEmulation = LinkEmulation()) -> "InProcessTransport":
        return InProcessTransport(self, node_id, emulation)

    def cut(self, node_id: str, direction: Direction) -> None:
        """Break the outgoing link of `direction` of node `node_id` as a network failure would: its
        queue is dropped, its generation moves on, and it reconnects (the receiver sees a new stream)."""
        link = self.nodes[node_id].links[direction]
        link.restart(f"{direction} link to {link.peer_id} failed: cut")


class InProcessLink(OutLink):
    """One direction's stream: envelopes go (serialized and parsed again) into the peer's inbox."""

    async def carry(self) -> None:
        while (peer := self.transport.network.nodes.get(self.address)) is None:
            await asyncio.sleep(0.01)  # not started yet: wait, as a gRPC channel would
        stream = None
        while True:
            data = await self.next_or_end()
            if data is None:  # every envelope is in the peer's inbox already
                self.ended.set()
                return
            start = time.perf_counter()
            if stream is None:
                stream = peer.next_stream(self.direction)
                await peer.inbox.put(Inbound(self.direction, self.transport.node_id, stream, None))
            envelope, payload = open_body(data.joined())
            await peer.inbox_bytes.put(peer.inbox, Inbound(self.direction, self.transport.node_id, stream, envelope,
                                                           len(data), payload))
            self.delivered(len(data), time.perf_counter() - start)


class InProcessTransport(LinkedTransport):
    """Transport between stages of one process; see tahnode.net.transport.Transport."""

    Link = InProcessLink

    def __init__(self, network: InProcessNetwork, node_id: str, emulation: LinkEmulation = LinkEmulation()):
        super().__init__(node_id, emulation)
        self.network = network

    async def start(self) -> str:
        self.open_links()
        self.address = self.node_id
        self.network.nodes[self.node_id] = self
        return self.address

    async def close(self) -> None:
        self.close_links()
        self.network.nodes.pop(self.node_id, None)
