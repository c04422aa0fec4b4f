"""gRPC data plane (grpc.aio): a StageService server that authenticates and reassembles incoming
frames into the inbox, and one client stream per outgoing direction with a bounded window."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Callable

import grpc

from .auth import SwarmKey
from .proto import tahnode_pb2 as pb
from .proto import tahnode_pb2_grpc as pb_grpc
from .transport import BACKWARD, FORWARD, Inbound, LinkCounters

log = logging.getLogger("tahnode.transport")

CHUNK_BYTES = 1 << 20            # an Envelope travels in frames of at most 1 MiB of data
MAX_MESSAGE_BYTES = 4 << 20      # explicit gRPC limit; frames stay far below it
MAX_ENVELOPE_BYTES = 1 << 31     # refuse reassembling anything larger
KEEPALIVE = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
CHANNEL_OPTIONS = KEEPALIVE + [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
SERVER_OPTIONS = KEEPALIVE + [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.so_reuseport", 0),
]


def frames_of(key: SwarmKey, sender: str, seq: int, data: bytes):
    count = max(1, -(-len(data) // CHUNK_BYTES))
    for index in range(count):
        chunk = data[index * CHUNK_BYTES : (index + 1) * CHUNK_BYTES]
        yield pb.Frame(sender=sender, seq=seq, index=index, count=count, data=chunk, mac=key.frame_mac(sender, seq, index, count, chunk))


class Reassembler:
    """Frames -> whole envelopes, checking authentication, order and sizes."""

    def __init__(self, key: SwarmKey):
        self.key = key
        self.parts: list[bytes] = []
        self.seq: int | None = None
        self.size = 0

    def add(self, frame: pb.Frame) -> tuple[bytes | None, str | None]:
        """-> (envelope bytes when complete, error message)."""
        if not self.key.verify_frame(frame):
            return None, f"frame from {frame.sender or '?'} failed authentication (wrong swarm token?)"
        if frame.count == 0 or frame.index >= frame.count:
            return None, f"malformed frame: index {frame.index} of {frame.count}"
        if frame.index == 0:
            self.parts, self.seq, self.size = [], frame.seq, 0
        elif frame.seq != self.seq or frame.index != len(self.parts):
            return None, f"frames out of order: seq {frame.seq} index {frame.index}"
        self.size += len(frame.data)
        if self.size > MAX_ENVELOPE_BYTES:
            return None, "envelope larger than 2 GiB"
        self.parts.append(frame.data)
        if frame.index + 1 == frame.count:
            data, self.parts = b"".join(self.parts), []
            return data, None
        return None, None


class StageServicer(pb_grpc.StageServiceServicer):
    def __init__(self, transport: "GrpcTransport"):
        self.t = transport

    async def _stream(self, direction: str, request_iterator, context) -> pb.StreamAck:
        stream = self.t.next_stream(direction)
        asm = Reassembler(self.t.key)
        frames = nbytes = 0
        announced = False
        async for frame in request_iterator:
            data, error = asm.add(frame)
            if error:
                log.warning("refused %s stream from %s: %s", direction, context.peer(), error)
                code = grpc.StatusCode.UNAUTHENTICATED if "authentication" in error else grpc.StatusCode.INVALID_ARGUMENT
                await context.abort(code, error)
            frames += 1
            nbytes += len(frame.data)
            if data is None:
                continue
            env = pb.Envelope()
            try:
                env.ParseFromString(data)
            except Exception as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed envelope: {exc}")
            if env.WhichOneof("body") is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty envelope")
            if not announced:
                await self.t.inbox.put(Inbound(direction, frame.sender, stream, None))
                announced = True
            await self.t.inbox.put(Inbound(direction, frame.sender, stream, env, len(data)))  # full inbox: backpressure
        return pb.StreamAck(frames=frames, bytes=nbytes)

    async def Forward(self, request_iterator, context):
        return await self._stream(FORWARD, request_iterator, context)

    async def Backward(self, request_iterator, context):
        return await self._stream(BACKWARD, request_iterator, context)

    async def Ping(self, request, context):
        return pb.PingReply(nonce=request.nonce, node_id=self.t.node_id, stage=max(self.t.stage, 0))

    async def Probe(self, request_iterator, context):
        first = last = None
        total = 0
        async for chunk in request_iterator:
            if not self.t.key.verify_frame(pb.Frame(sender="probe", data=chunk.data, mac=chunk.mac)):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "probe failed authentication (wrong swarm token?)")
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            total += len(chunk.data)
        return pb.ProbeReply(bytes=total, seconds=(last - first) if first is not None else 0.0)

    async def Measure(self, request, context):
        if not self.t.key.verify(request):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "measure request failed authentication")
        if self.t.measure_handler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this node does not measure links")
        mbps, rtt = await self.t.measure_handler(request.target_address, request.payload_bytes)
        return pb.MeasureReply(mbps=mbps, rtt_ms=rtt)


class OutLink:
    """The client stream of one direction: a bounded queue of envelopes, written frame by frame;
    on failure the queue is dropped, the generation bumps and the link reconnects."""

    def __init__(self, t: "GrpcTransport", direction: str, window: int):
        self.t, self.direction = t, direction
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=window)
        self.generation = 0
        self.peer_id = ""
        self.address = ""
        self.counters = LinkCounters()
        self.task: asyncio.Task | None = None
        self.seq = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def set_peer(self, node_id: str, address: str) -> None:
        if (node_id, address) == (self.peer_id, self.address):
            return
        old = self.peer_id
        self.peer_id, self.address = node_id, address
        self.counters.peer = node_id
        if self.task:
            self.task.cancel()
            self.task = None
            self._fail(f"peer changed from {old or 'none'} to {node_id or 'none'}")
        if address:
            self.task = asyncio.create_task(self._run(), name=f"link-{self.direction}")

    def _fail(self, reason: str) -> None:
        self.generation += 1
        self.counters.failures += 1
        while not self.queue.empty():
            self.queue.get_nowait()
        self.idle.set()
        for cb in self.t.down_callbacks:
            cb(self.direction, reason)

    async def _run(self) -> None:
        backoff = 0.2
        while True:
            channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
            try:
                await asyncio.wait_for(channel.channel_ready(), timeout=5.0)
                stub = pb_grpc.StageServiceStub(channel)
                call = (stub.Forward if self.direction == FORWARD else stub.Backward)(wait_for_ready=True)
                log.info("%s link to %s (%s) open", self.direction, self.peer_id, self.address)
                backoff = 0.2
                await self._pump(call)
            except asyncio.CancelledError:
                await channel.close(grace=None)
                raise
            except (grpc.aio.AioRpcError, asyncio.TimeoutError, ConnectionError) as exc:
                reason = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
                log.warning("%s link to %s (%s) failed: %s", self.direction, self.peer_id, self.address, reason)
                self._fail(f"{self.direction} link to {self.peer_id} failed: {reason}")
            finally:
                await channel.close(grace=None)
            await asyncio.sleep(backoff)
            backoff = min(2.0, backoff * 2)

    async def _pump(self, call) -> None:
        done = asyncio.ensure_future(call)  # completes (with an error) when the peer goes away
        try:
            while True:
                getter = asyncio.ensure_future(self.queue.get())
                finished, _ = await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
                if done in finished:
                    getter.cancel()
                    await done  # raises the RPC error
                    raise ConnectionError("stream closed by peer")
                generation, data = getter.result()
                if generation != self.generation:
                    continue
                self.seq += 1
                start = time.perf_counter()
                for frame in frames_of(self.t.key, self.t.node_id, self.seq, data):
                    await call.write(frame)
                self.counters.seconds += time.perf_counter() - start
                self.counters.bytes += len(data)
                self.counters.envelopes += 1
                if self.queue.empty():
                    self.idle.set()
        finally:
            if not done.done():
                done.cancel()


class GrpcTransport:
    """Transport over gRPC; see tahnode.transport.Transport for the contract."""

    def __init__(self, node_id: str, key: SwarmKey, listen: str, advertise: str = "", window: int = 4, inbox_size: int = 8):
        self.node_id, self.key = node_id, key
        self.listen, self.advertise = listen, advertise
        self.inbox: asyncio.Queue = asyncio.Queue(maxsize=inbox_size)
        self.links = {FORWARD: None, BACKWARD: None}
        self.window = window
        self.down_callbacks: list[Callable[[str, str], None]] = []
        self.streams = {FORWARD: 0, BACKWARD: 0}
        self.stage = -1
        self.measure_handler = None
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self) -> str:
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        pb_grpc.add_StageServiceServicer_to_server(StageServicer(self), self.server)
        port = self.server.add_insecure_port(self.listen)
        if port == 0:
            raise OSError(f"cannot listen on {self.listen}")
        await self.server.start()
        host = self.listen.rsplit(":", 1)[0]
        if host in ("0.0.0.0", "[::]", ""):
            host = "127.0.0.1"
        self.address = self.advertise or f"{host}:{port}"
        self.links = {d: OutLink(self, d, self.window) for d in (FORWARD, BACKWARD)}
        return self.address

    def next_stream(self, direction: str) -> int:
        self.streams[direction] += 1
        return self.streams[direction]

    def set_peer(self, direction: str, node_id: str, address: str) -> None:
        self.links[direction].set_peer(node_id, address)

    def peer(self, direction: str) -> str:
        return self.links[direction].peer_id

    def generation(self, direction: str) -> int:
        return self.links[direction].generation

    async def send(self, direction: str, envelope: pb.Envelope, generation: int) -> bool:
        link = self.links[direction]
        if generation != link.generation or not link.address:
            return False
        data = envelope.SerializeToString()
        link.idle.clear()
        await link.queue.put((generation, data))
        return generation == link.generation

    def on_link_down(self, callback: Callable[[str, str], None]) -> None:
        self.down_callbacks.append(callback)

    def counters(self, direction: str) -> LinkCounters:
        return self.links[direction].counters

    async def flush(self, timeout: float) -> None:
        waits = [link.idle.wait() for link in self.links.values() if link and link.task]
        if waits:
            try:
                await asyncio.wait_for(asyncio.gather(*waits), timeout)
            except asyncio.TimeoutError:
                log.warning("gave up waiting for queued envelopes after %.0f s", timeout)

    async def close(self) -> None:
        for link in self.links.values():
            if link and link.task:
                link.task.cancel()
        if self.server:
            await self.server.stop(grace=0.5)


async def probe(key: SwarmKey, address: str, payload_bytes: int, chunk: int = 256 << 10) -> tuple[float, float]:
    """Measure the link to `address`: (throughput Mbit/s over payload_bytes, median RTT ms)."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.StageServiceStub(channel)
        rtts = []
        for _ in range(5):
            start = time.perf_counter()
            await stub.Ping(pb.PingRequest(nonce=os.urandom(8)), timeout=10)
            rtts.append((time.perf_counter() - start) * 1e3)
        data = os.urandom(chunk)
        mac = key.frame_mac("probe", 0, 0, 0, data)

        async def chunks():
            sent = 0
            while sent < payload_bytes:
                yield pb.ProbeChunk(data=data, mac=mac)
                sent += len(data)

        start = time.perf_counter()
        reply = await stub.Probe(chunks(), timeout=120)
        elapsed = time.perf_counter() - start
        return reply.bytes * 8 / max(elapsed, 1e-9) / 1e6, sorted(rtts)[len(rtts) // 2]
