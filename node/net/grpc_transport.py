"""gRPC data plane (grpc.aio): a StageService server that authenticates and reassembles incoming
frames into the inbox, and one client stream per outgoing direction fed by a queue."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from ..config.emulation import LinkEmulation
from ..proto import tahnode_pb2 as pb
from ..proto import tahnode_pb2_grpc as pb_grpc
from .auth import BadMac, Sealer
from .framing import (FrameError, FrameNotAuthenticated, FrameNotFresh, FrameTooLarge, Reassembler, frames_of,
                      open_envelope, request_type)
from .freshness import COORDINATOR, SealRefused
from .links import LinkedTransport, OutLink
from .memory import return_freed_memory
from .channels import open_channel
from .tls import TlsCertificate, add_port
from .transport import BACKWARD, FORWARD, Direction, Inbound, Measurer
from .unparsable import RefuseUnparsable

__all__ = ["GrpcTransport", "CHANNEL_OPTIONS", "DIRECT", "SERVER_OPTIONS", "add_stage_service"]

log = logging.getLogger("tahnode.transport")

MAX_MESSAGE_BYTES = 4 << 20      # explicit gRPC limit; frames stay far below it
STREAMS_PER_PEER = 3             # incoming streams per direction one sender may hold open at once (reconnects overlap)
PEER_WAIT_S = 3.0                # how long frames from an authentic sender wait for the assignment that names it
PROBE_IDLE_S = 10.0              # a probe's next chunk comes within this, and the probe ends within PROBE_MAX_S
PROBE_MAX_S = 120.0              # (the prober's own deadline): held open, probes filled a sender's call quota
KEEPALIVE = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# Peers and the coordinator are always dialled directly: an http(s)_proxy set for downloads would
# otherwise carry (or, where it cannot be reached, block) stage links and falsify bandwidth probes.
DIRECT = [("grpc.enable_http_proxy", 0)]
CHANNEL_OPTIONS = KEEPALIVE + DIRECT + [
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


STAGE_SERVICE = pb.DESCRIPTOR.services_by_name["StageService"]
METHOD_HANDLERS = {(False, False): grpc.unary_unary_rpc_method_handler,
                   (True, False): grpc.stream_unary_rpc_method_handler,
                   (False, True): grpc.unary_stream_rpc_method_handler,
                   (True, True): grpc.stream_stream_rpc_method_handler}


def add_stage_service(servicer, server) -> None:
    """Serve StageService's methods of `servicer` on `server`, as the generated
    add_StageServiceServicer_to_server does, but with frames parsed as ReceivedFrame (their data a
    view of the received bytes, not a copy)."""
    handlers = {m.name: METHOD_HANDLERS[m.client_streaming, m.server_streaming](
        getattr(servicer, m.name), request_deserializer=request_type(getattr(pb, m.input_type.name)).FromString,
        response_serializer=getattr(pb, m.output_type.name).SerializeToString) for m in STAGE_SERVICE.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(STAGE_SERVICE.full_name, handlers),))


def _frame_bytes(frame) -> bytes:
    """A frame's wire bytes (an OutgoingFrame writes its data in one join)."""
    return frame.SerializeToString()


FRAME_CODES = {FrameNotAuthenticated: grpc.StatusCode.UNAUTHENTICATED, FrameNotFresh: grpc.StatusCode.PERMISSION_DENIED,
               FrameTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED}


class StageServicer(pb_grpc.StageServiceServicer):
    def __init__(self, transport: "GrpcTransport"):
        self.t = transport
        self.open_streams: dict[tuple[Direction, str], int] = {}  # (direction, sender) -> its incoming streams now

    async def _check(self, msg, context, what: str, signed_by: bytes | None = None) -> None:
        """Abort the call unless `msg` is authentic (UNAUTHENTICATED), fresh, for this node and run,
        and signed by `signed_by` if given (PERMISSION_DENIED)."""
        try:
            self.t.sealer.check(msg, signed_by=signed_by)
        except BadMac:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{what} failed authentication (wrong swarm token?)")
        except SealRefused as exc:
            log.warning("refused a %s from %s: %s", what, context.peer(), exc)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{what} refused: {exc}")

    async def _stream(self, direction: Direction, request_iterator, context) -> pb.StreamAck:
        stream = self.t.next_stream(direction)
        asm = Reassembler(self.t.sealer, self.t.envelope_cap, self.t.peer_keys, allocate=self.t.receive_buffer)
        frames = nbytes = 0
        announced = False
        slot: tuple[Direction, str] | None = None
        try:
            async for frame in request_iterator:
                if frame.sender not in self.t.peer_keys and self.t.sealer.key.verify_frame(frame):
                    # a token holder: perhaps a neighbour we will hear of
                    await self.t.peer_known(frame.sender, self.t.peer_wait_s)
                try:
                    data = asm.add(frame)
                    env, payload = open_envelope(data) if data is not None else (None, None)
                except FrameError as exc:
                    log.warning("refused %s stream from %s: %s", direction, context.peer(), exc)
                    asm.reset()
                    return_freed_memory()  # what the refused stream held goes back to the system, not only to malloc
                    await context.abort(FRAME_CODES.get(type(exc), grpc.StatusCode.INVALID_ARGUMENT), str(exc))
                if slot is None:  # its first frame is authentic: the stream counts against its sender's streams
                    slot = (direction, frame.sender)
                    self.open_streams[slot] = self.open_streams.get(slot, 0) + 1
                    if self.open_streams[slot] > STREAMS_PER_PEER:
                        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{frame.sender} has "
                                            f"{STREAMS_PER_PEER} {direction} streams open here already")
                frames += 1
                nbytes += len(frame.data)
                if env is None:
                    continue
                if not announced:
                    await self.t.inbox.put(Inbound(direction, frame.sender, stream, None))
                    announced = True
                await self.t.inbox_bytes.put(self.t.inbox,  # backpressure
                                             Inbound(direction, frame.sender, stream, env, len(data), payload))
        finally:
            if slot is not None:
                self.open_streams[slot] -= 1
            # a refused stream's handler frame outlives it (gRPC keeps the abort's traceback): drop its data
            asm.reset()
        return pb.StreamAck(frames=frames, bytes=nbytes)

    async def Forward(self, request_iterator, context):
        return await self._stream(FORWARD, request_iterator, context)

    async def Backward(self, request_iterator, context):
        return await self._stream(BACKWARD, request_iterator, context)

    async def Ping(self, request, context):
        await self._check(request, context, "ping")
        return pb.PingReply(nonce=request.nonce, node_id=self.t.node_id, stage=max(self.t.stage, 0))

    async def Probe(self, request_iterator, context):
        first = last = None
        total = 0
        chunks, ends = aiter(request_iterator), time.monotonic() + PROBE_MAX_S
        while True:
            wait = min(PROBE_IDLE_S, ends - time.monotonic())
            try:
                chunk = await asyncio.wait_for(anext(chunks), max(wait, 0.0))
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "a probe sends a chunk every "
                                    f"{PROBE_IDLE_S:.0f} s and ends within {PROBE_MAX_S:.0f} s")
            await self._check(chunk, context, "probe chunk")
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            total += len(chunk.data)
        return pb.ProbeReply(bytes=total, seconds=(last - first) if first is not None else 0.0)

    async def Measure(self, request, context):
        # only the coordinator asks (pings and probes come from any node it asks to measure: the
        # token and the seal authenticate them, no node key; they change nothing here)
        coordinator = self.t.peer_keys.get(COORDINATOR)
        if coordinator is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "this node has not joined a coordinator yet: it measures nothing")
        await self._check(request, context, "measure request", signed_by=coordinator)
        if request.compute:  # its own compute again, as at its join (placement, before it refuses a slow chain)
            if self.t.compute_measurer is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "this node does not measure its compute yet")
            return pb.MeasureReply(layer_ms=await self.t.compute_measurer())
        if self.t.measurer is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this node does not measure links")
        mbps, rtt = await self.t.measurer(request.target_id, request.target_address, request.payload_bytes,
                                          request.target_cert)
        return pb.MeasureReply(mbps=mbps, rtt_ms=rtt)


class GrpcLink(OutLink):
    """One direction's client stream (StageService.Forward or .Backward), written frame by frame."""

    async def carry(self) -> None:
        async with open_channel(self.address, self.transport.peer_certs.get(self.peer_id, b""),
                                CHANNEL_OPTIONS) as channel:
            try:
                await asyncio.wait_for(channel.channel_ready(), timeout=5.0)
                method = f"/{STAGE_SERVICE.full_name}/{'Forward' if self.direction == FORWARD else 'Backward'}"
                call = channel.stream_unary(method, request_serializer=_frame_bytes,
                                            response_deserializer=pb.StreamAck.FromString)(wait_for_ready=True)
                log.info("%s link to %s (%s) open", self.direction, self.peer_id, self.address)
                await self._write(call)
            except grpc.aio.AioRpcError as exc:
                raise ConnectionError(exc.details()) from None

    async def _write(self, call) -> None:
        done = asyncio.ensure_future(call)  # completes (with an error) when the peer goes away
        getter = None
        try:
            while True:
                getter = asyncio.ensure_future(self.next_or_end())
                finished, _ = await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
                if done in finished:
                    getter.cancel()
                    await done  # raises the RPC error
                    raise ConnectionError("stream closed by peer")
                data = getter.result()
                if data is None:  # flush(): the peer's StreamAck comes once it has read every frame
                    await call.done_writing()
                    await done
                    self.ended.set()
                    return
                start = time.perf_counter()
                for frame in frames_of(self.transport.sealer, self.peer_id, data):
                    await call.write(frame)
                self.delivered(len(data), time.perf_counter() - start)
        finally:
            if not done.done():
                done.cancel()
            # a stream cancelled while it waited (the link restarted): its wait for the queue ends with it, or it
            # would take the next stream's first envelope off the queue and drop it
            if getter is not None and not getter.done():
                getter.cancel()


class GrpcTransport(LinkedTransport):
    """Transport over gRPC; see tahnode.net.transport.Transport for the contract. `sealer` signs
    what this node sends and checks what it receives; `measurer` answers the coordinator's
    requests to measure a link from this node (None: refused), `compute_measurer` (set once the
    node knows its run) those to measure its compute; `tls`: serve over TLS with this certificate
    (None: plain gRPC)."""

    Link = GrpcLink

    def __init__(self, sealer: Sealer, listen: str, advertise: str = "", measurer: Measurer | None = None,
                 emulation: LinkEmulation = LinkEmulation(), tls: TlsCertificate | None = None):
        super().__init__(sealer.me, emulation)
        self.tls = tls
        self.sealer = sealer
        self.peer_wait_s = PEER_WAIT_S
        self.listen, self.advertise = listen, advertise
        self.measurer = measurer
        self.compute_measurer: Callable[[], Awaitable[float]] | None = None  # -> one layer's ms on this device
        self.server: grpc.aio.Server | None = None

    async def start(self) -> str:
        self.server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[RefuseUnparsable()])
        add_stage_service(StageServicer(self), self.server)
        port = add_port(self.server, self.listen, self.tls)
        if port == 0:
            raise OSError(f"cannot listen on {self.listen}")
        await self.server.start()
        host = self.listen.rsplit(":", 1)[0]
        if host in ("0.0.0.0", "[::]", ""):
            host = "127.0.0.1"
        self.address = self.advertise or f"{host}:{port}"
        self.open_links()
        return self.address

    async def close(self) -> None:
        self.close_links()
        if self.server:
            await self.server.stop(grace=0.5)
