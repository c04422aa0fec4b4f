"""What every transport shares: one outgoing link per direction (a bounded queue of envelopes'
bodies, tahnode.net.body, with a generation that moves on when the link fails) and the
bookkeeping around it. A transport subclasses both and says how a link carries its queue."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from ..config.emulation import LinkEmulation
from ..proto import tahnode_pb2 as pb
from .body import Body, PendingBody, body_of
from .emulation import pacer_for
from .framing import MAX_ENVELOPE_BYTES
from .freshness import COORDINATOR
from .transport import BACKWARD, FORWARD, QUEUE_LIMIT, ByteBudget, Direction, LinkCounters

log = logging.getLogger("tahnode.transport")

__all__ = ["OutLink", "LinkedTransport"]

INBOX_ENVELOPES = 4  # the inbox holds at most this many of the run's largest envelopes (in bytes)


class OutLink:
    """The outgoing stream of one direction. `carry()` (a subclass's) takes envelopes off the queue
    and delivers them until it fails; on failure the queue is dropped, the generation bumps, every
    listener hears of it, and `carry()` runs again (a new stream)."""

    def __init__(self, transport: "LinkedTransport", direction: Direction):
        self.transport, self.direction = transport, direction
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_LIMIT)
        self.generation = 0
        self.peer_id = self.address = ""
        self.counters = LinkCounters()
        self.pacer = pacer_for(transport.emulation)
        self.task: asyncio.Task | None = None
        self.idle = asyncio.Event()
        self.idle.set()
        self.ending = asyncio.Event()  # flush(): end the stream once nothing is left to send
        self.ended = asyncio.Event()   # ... and the peer confirmed it read everything (or it failed)

    async def carry(self) -> None:
        """Deliver queued envelopes to self.address until the stream fails (raise ConnectionError
        or asyncio.TimeoutError) or is cancelled; once `next_or_end()` says the stream ends, make
        sure the peer read everything, set `ended` and return."""
        raise NotImplementedError

    def set_peer(self, node_id: str, address: str) -> None:
        if (node_id, address) == (self.peer_id, self.address):
            return
        old = self.peer_id
        self.peer_id, self.address = node_id, address
        self.counters.peer = node_id
        self.pacer = pacer_for(self.transport.emulation, node_id)
        self.restart(f"peer changed from {old or 'none'} to {node_id or 'none'}" if self.task else None)

    def restart(self, reason: str | None) -> None:
        """Drop the current stream (a failure, if `reason`) and open a new one to the peer."""
        if self.task:
            self.task.cancel()
            self.task = None
        if reason:
            self.fail(reason)
        if self.address:
            self.task = asyncio.get_running_loop().create_task(self._run(), name=f"link-{self.direction}")

    def fail(self, reason: str) -> None:
        self.generation += 1
        self.counters.failures += 1
        while not self.queue.empty():
            self.queue.get_nowait()
        self.idle.set()
        for cb in self.transport.down_callbacks:
            cb(self.direction, reason)

    async def next_envelope(self) -> Body:
        """The next queued envelope of the current generation (stale ones are skipped), once an
        emulated link would have carried it (tahnode.net.emulation); a PendingBody finished first,
        on a thread of the loop's executor."""
        while True:
            generation, data, queued_at = await self.queue.get()
            if generation == self.generation and isinstance(data, PendingBody):  # its payload's copy and checksum
                data = await asyncio.get_running_loop().run_in_executor(None, data.finish)
            if generation == self.generation:
                await self.pacer.wait(len(data), queued_at)
                if generation == self.generation:
                    return data
            self.mark_idle()

    async def next_or_end(self) -> Body | None:
        """The next envelope to deliver, or None once flush() asked the stream to end and nothing
        is queued or in flight (so giving up the wait loses nothing)."""
        getter = asyncio.ensure_future(self.next_envelope())
        end = asyncio.ensure_future(self._end_requested())
        try:
            finished, _ = await asyncio.wait({getter, end}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (getter, end):
                if not task.done():
                    task.cancel()
        return getter.result() if getter in finished else None

    async def _end_requested(self) -> None:
        await self.ending.wait()
        await self.idle.wait()

    def delivered(self, nbytes: int, seconds: float) -> None:
        self.counters.bytes += nbytes
        self.counters.seconds += seconds
        self.counters.envelopes += 1
        self.mark_idle()

    def mark_idle(self) -> None:
        if self.queue.empty():
            self.idle.set()

    async def _run(self) -> None:
        backoff = 0.2
        while not self.ended.is_set():
            try:
                await self.carry()
                backoff = 0.2
            except (ConnectionError, asyncio.TimeoutError) as exc:
                reason = str(exc) or type(exc).__name__
                # at the end, a peer may be gone first
                log.log(logging.INFO if self.ending.is_set() else logging.WARNING,
                        "%s link to %s (%s) failed: %s", self.direction, self.peer_id, self.address, reason)
                self.fail(f"{self.direction} link to {self.peer_id} failed: {reason}")
                if self.ending.is_set():  # what was queued is lost with the stream: nothing left to end
                    self.ended.set()
            if self.ended.is_set():
                return
            await asyncio.sleep(backoff)
            backoff = min(2.0, backoff * 2)


class LinkedTransport:
    """The parts of a Transport (tahnode.net.transport) that do not depend on the medium."""

    Link: type[OutLink] = OutLink

    def __init__(self, node_id: str, emulation: LinkEmulation = LinkEmulation()):
        self.node_id = node_id
        self.emulation = emulation
        self.inbox: asyncio.Queue = asyncio.Queue(maxsize=2 * QUEUE_LIMIT)  # both directions come in here
        self.inbox_bytes = ByteBudget(INBOX_ENVELOPES * MAX_ENVELOPE_BYTES)  # ... within this many bytes
        self.links: dict[Direction, OutLink] = {}
        self.streams = {FORWARD: 0, BACKWARD: 0}
        self.down_callbacks: list[Callable[[Direction, str], None]] = []
        self.stage = -1
        self.address = ""
        self.envelope_cap = MAX_ENVELOPE_BYTES  # the run's largest legitimate envelope, once known (set_envelope_cap)
        self.peer_keys: dict[str, bytes] = {}  # node id -> public key: only these (the neighbours) may send frames here
        self.peer_certs: dict[str, bytes] = {}  # node id -> its TLS certificate (PEM), pinned when dialling it
        self.peers_changed = asyncio.Event()     # set (and replaced) whenever a link is pointed at a peer
        self.receive_buffer: Callable[[int], Any] = bytearray  # where a received envelope is reassembled (n bytes)

    def open_links(self) -> None:
        self.links = {d: self.Link(self, d) for d in (FORWARD, BACKWARD)}

    def set_stage(self, stage: int) -> None:
        self.stage = stage

    def set_envelope_cap(self, nbytes: int) -> None:
        """Refuse incoming envelopes larger than `nbytes` (what the run's largest message can be)."""
        self.envelope_cap = nbytes
        self.inbox_bytes.limit = INBOX_ENVELOPES * nbytes

    def next_stream(self, direction: Direction) -> int:
        """Number a new incoming stream of `direction` (its codec state starts afresh)."""
        self.streams[direction] += 1
        return self.streams[direction]

    def set_peer(self, direction: Direction, node_id: str, address: str, public_key: bytes = b"",
                 tls_cert: bytes = b"") -> None:
        old = self.links[direction].peer_id
        other = {link.peer_id for d, link in self.links.items() if d != direction}
        if old and old != node_id and old not in other:  # a former neighbour may send nothing more here
            self.peer_keys.pop(old, None)
            self.peer_certs.pop(old, None)
        if node_id:
            self.peer_certs[node_id] = tls_cert
        if node_id and public_key:
            self.peer_keys[node_id] = public_key
        self.links[direction].set_peer(node_id, address)
        self.peers_changed.set()
        self.peers_changed = asyncio.Event()

    async def wait_for_peer(self, direction: Direction, timeout: float) -> bool:
        """Whether the outgoing link of `direction` points at a peer, waiting up to `timeout` for an
        assignment that names one."""
        return await self._until(lambda: bool(self.links[direction].address), timeout)

    async def peer_known(self, node_id: str, timeout: float) -> bool:
        """Wait up to `timeout` for an assignment that names `node_id` as a neighbour (a neighbour
        may learn of this node a heartbeat earlier than this node learns of it)."""
        return await self._until(lambda: node_id in self.peer_keys, timeout)

    async def _until(self, holds: Callable[[], bool], timeout: float) -> bool:
        """Whether `holds()`, waiting up to `timeout` for the set_peer that makes it so."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not holds():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self.peers_changed.wait(), left)
            except asyncio.TimeoutError:
                return False
        return True

    def peer(self, direction: Direction) -> str:
        link = self.links.get(direction)
        return link.peer_id if link else ""

    def generation(self, direction: Direction) -> int:
        return self.links[direction].generation

    async def send(self, direction: Direction, envelope: pb.Envelope | Body | PendingBody, generation: int) -> bool:
        link = self.links[direction]
        if generation != link.generation or not link.address:
            return False
        data = envelope if isinstance(envelope, (Body, PendingBody)) else body_of(envelope)
        link.idle.clear()
        await link.queue.put((generation, data, time.monotonic()))
        return generation == link.generation

    def on_link_down(self, callback: Callable[[Direction, str], None]) -> None:
        self.down_callbacks.append(callback)

    def counters(self, direction: Direction) -> LinkCounters:
        return self.links[direction].counters

    async def drained(self, direction: Direction) -> None:
        await self.links[direction].idle.wait()

    async def flush(self, timeout: float) -> None:
        links = [link for link in self.links.values() if link.task]
        for link in links:
            link.ending.set()
        if links:
            try:
                await asyncio.wait_for(asyncio.gather(*(link.ended.wait() for link in links)), timeout)
            except asyncio.TimeoutError:
                log.warning("gave up waiting for the peers to read the last envelopes after %.0f s", timeout)

    def reset_links(self) -> None:
        """Drop every outgoing link (also one ended by flush()) and start afresh without peers, for
        a new holder of a stage on this transport; callbacks of the old one are forgotten."""
        self.close_links()
        self.down_callbacks.clear()
        for node_id in [k for k in self.peer_keys if k != COORDINATOR]:  # former neighbours may send nothing more
            del self.peer_keys[node_id]
        self.peer_certs.clear()
        # what the old holder had taken up but not handled is gone with it
        self.inbox_bytes.release(self.inbox_bytes.held)
        self.open_links()

    def close_links(self) -> None:
        for link in self.links.values():
            if link.task:
                link.task.cancel()
