"""The data-plane interface between stages: send an Envelope towards the next or previous stage,
receive Envelopes from them. The pipeline sees only this; gRPC (and libp2p) implement it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum
from typing import Awaitable, Callable, Protocol

from ..proto import tahnode_pb2 as pb
from .body import Body, PendingBody

__all__ = ["Direction", "FORWARD", "BACKWARD", "EnvelopeKind", "Inbound", "LinkCounters", "Measurer", "Transport",
           "ByteBudget", "MAX_IN_FLIGHT", "QUEUE_LIMIT"]


class Direction(Enum):
    """Which way an envelope travels along the chain of stages."""

    FORWARD = "forward"    # activations, step ends, syncs: towards the next stage
    BACKWARD = "backward"  # gradients, sync acks: towards the previous stage

    def __str__(self) -> str:
        return self.value


FORWARD, BACKWARD = Direction.FORWARD, Direction.BACKWARD

# The pipeline keeps at most this many micro-batches in flight; a transport's queues hold that many
# envelopes per direction (and a few control ones), so no stage ever blocks on a full queue while
# its peer waits on it.
MAX_IN_FLIGHT = 256
QUEUE_LIMIT = MAX_IN_FLIGHT + 32


class EnvelopeKind(Enum):
    """What an Envelope carries (the name of its `body` field)."""

    MICRO_BATCH = "micro_batch"
    STEP_END = "step_end"
    SYNC = "sync"
    SYNC_ACK = "sync_ack"
    SHUTDOWN = "shutdown"

    @classmethod
    def of(cls, envelope: pb.Envelope) -> "EnvelopeKind | None":
        body = envelope.WhichOneof("body")
        return cls(body) if body else None

    def travels(self, direction: "Direction") -> bool:
        """Whether envelopes of this kind go `direction`: forward from the previous stage carries
        activations, step ends, syncs and the shutdown; backward from the next, gradients and sync acks."""
        return self in (FORWARD_KINDS if direction is Direction.FORWARD else BACKWARD_KINDS)


FORWARD_KINDS = {EnvelopeKind.MICRO_BATCH, EnvelopeKind.STEP_END, EnvelopeKind.SYNC, EnvelopeKind.SHUTDOWN}
BACKWARD_KINDS = {EnvelopeKind.MICRO_BATCH, EnvelopeKind.SYNC_ACK}


@dataclass
class Inbound:
    """One received envelope. `stream` numbers the incoming streams of this direction: a new
    number means the sender (re)connected and its per-stream codec state starts afresh."""

    direction: Direction
    sender: str
    stream: int
    envelope: pb.Envelope | None  # None: only marks the start of a new stream
    nbytes: int = 0
    payload: memoryview | None = None  # its tensor's payload where it travelled apart (tahnode.net.body)


@dataclass
class LinkCounters:
    """What one outgoing link has carried (for stats and the coordinator's bandwidth matrix)."""

    peer: str = ""
    bytes: int = 0
    seconds: float = 0.0
    envelopes: int = 0
    failures: int = 0


# measure(target node id, its address, payload bytes or 0 for "size it yourself", its TLS certificate
# or b"") -> (Mbit/s, RTT ms)
Measurer = Callable[[str, str, int, bytes], Awaitable[tuple[float, float]]]


class ByteBudget:
    """Bytes of received envelopes a daemon holds (queued in its inbox or waiting to be handled):
    `reserve` waits while they would pass `limit` (backpressure on the sending stream; one envelope
    is always let in), `release` gives them back once the stage takes the envelope up."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self.changed = asyncio.Event()

    async def reserve(self, nbytes: int) -> None:
        while self.held and self.held + nbytes > self.limit:
            self.changed.clear()
            await self.changed.wait()
        self.held += nbytes

    def release(self, nbytes: int) -> None:
        self.held = max(0, self.held - nbytes)
        self.changed.set()

    async def put(self, inbox: asyncio.Queue, item: Inbound) -> None:
        """Into `inbox`, once the budget has room for the item's bytes."""
        await self.reserve(item.nbytes)
        await inbox.put(item)


class Transport(Protocol):
    inbox: asyncio.Queue
    inbox_bytes: ByteBudget  # bytes of received envelopes held; released as the stage takes each up
    address: str

    async def start(self) -> str:
        """Start serving; return the address peers reach this node at."""

    def set_stage(self, stage: int) -> None:
        """The stage this node holds (peers that ping it are told)."""

    def set_peer(self, direction: Direction, node_id: str, address: str, public_key: bytes = b"",
                 tls_cert: bytes = b"") -> None:
        """Point the outgoing link of `direction` at a peer ("" to close it); its frames to this
        node must be signed by `public_key` (its identity, as the coordinator bound it); it is
        dialled over TLS pinning `tls_cert` (empty: it serves plain gRPC)."""

    def peer(self, direction: Direction) -> str:
        """The node id the outgoing link of `direction` points at ("" if none)."""

    async def wait_for_peer(self, direction: Direction, timeout: float) -> bool:
        """Whether the outgoing link of `direction` points at a peer, waiting up to `timeout` for one."""

    def generation(self, direction: Direction) -> int:
        """Counter of the outgoing link's streams; it changes when the link failed. Encode with
        codec state of the current generation, and hand that number to `send`."""

    async def send(self, direction: Direction, envelope: pb.Envelope | Body | PendingBody, generation: int) -> bool:
        """Queue an envelope, or its body with a payload kept apart (tahnode.net.body; a PendingBody
        is finished by the link before it is sent; awaits only if QUEUE_LIMIT are queued). False if
        the link's generation moved on (the envelope is dropped: its step will be replayed)."""

    def on_link_down(self, callback: Callable[[Direction, str], None]) -> None:
        """Call callback(direction, reason) when an outgoing link fails."""

    def counters(self, direction: Direction) -> LinkCounters: ...

    async def drained(self, direction: Direction) -> None:
        """Return once the outgoing link has nothing queued or being sent."""

    async def flush(self, timeout: float) -> None:
        """At the end of a run or a stop: deliver what is queued, end the outgoing streams and
        wait until each peer confirmed it read every envelope (or the timeout passed). Written
        is not enough: a stream closed with frames still in its buffers loses them, and a
        Shutdown lost that way leaves the later stages waiting for ever. Nothing is sent after."""

    def reset_links(self) -> None:
        """Drop every outgoing link (also after flush()) and start afresh without peers: the node
        lost its stage and may hold another one later."""

    async def close(self) -> None: ...
