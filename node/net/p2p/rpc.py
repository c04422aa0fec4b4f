"""tahnode's gRPC services carried over libp2p streams instead of HTTP/2: `serve_service` puts a
servicer (the same class grpc.aio serves) on a P2PHost, `P2PChannel` is what the generated stubs
call through, so callers and servicers do not know which carrier they use.

One call is one libp2p stream, named /tahnode/1/<Service>/<Method>, of records
(tahnode.net.p2p.records). The caller sends MESSAGE records and one END; the callee answers with
MESSAGE records and one STATUS (an RpcStatus: gRPC's code and details, so errors keep their
type). Records above MAX_RECORD_BYTES are refused, like gRPC's message limit, and a request that
does not parse is INVALID_ARGUMENT, as RefuseUnparsable does.

Calls are counted per authenticated sender (the node id a first request's MAC vouches for), not per
libp2p peer: relayed calls all arrive under their relay's id. A stream whose first request does not
come within FIRST_RECORD_S, or is not authentic, is closed; until then it counts against its
libp2p peer, at most PENDING_PER_PEER at once."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError

from ...proto import tahnode_pb2 as pb
from ..errors import P2PError
from ..framing import request_type
from .callers import call_owner
from .host import process_host
from .records import RecordKind, RecordTooLarge, StreamsPerPeer, protocol_name, read_record, write_record

log = logging.getLogger("tahnode.p2p")

__all__ = ["serve_service", "P2PChannel", "P2PServicerContext", "RpcAborted", "CALLS_PER_PEER"]

CALLS_PER_PEER = 16                   # calls one sender may have open here at once (each may hold a record in memory)
# streams of one libp2p peer (a relay carries many senders) waiting for a first request
PENDING_PER_PEER = 64
FIRST_RECORD_S = 10.0                 # a stream's first request must arrive within this


class RpcAborted(Exception):
    """A servicer ended the call with a status (what grpc's context.abort does)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class P2PServicerContext:
    """The part of grpc.aio.ServicerContext that tahnode's servicers use."""

    def __init__(self, peer_id: str):
        self._peer = f"p2p:{peer_id}"

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise RpcAborted(code, details)


def _parse(kind: RecordKind, payload: bytes, message_type):
    if kind is not RecordKind.MESSAGE:
        raise RpcAborted(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected {kind.name} record from the caller")
    try:
        return message_type.FromString(payload)
    except DecodeError as exc:
        raise RpcAborted(grpc.StatusCode.INVALID_ARGUMENT, "the request does not parse as a "
                         f"{message_type.DESCRIPTOR.full_name} message: {exc}") from None


async def _requests(reader: asyncio.StreamReader, message_type, first) -> AsyncIterator[Any]:
    """The caller's requests, parsed, `first` (already read) then the rest until its END."""
    if first is None:
        return
    yield first
    while True:
        try:
            kind, payload = await read_record(reader)
        except RecordTooLarge as exc:
            raise RpcAborted(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        if kind is RecordKind.END:
            return
        yield _parse(kind, payload, message_type)


class CallLimits:
    """The streams each libp2p peer has waiting for a first request, and the calls each authenticated
    sender has open, over every method of a service."""

    def __init__(self, key, keys=None):
        self.key, self.keys, self.pending, self.calls = key, keys, StreamsPerPeer(), StreamsPerPeer()


async def _first(reader: asyncio.StreamReader, input_type):
    """The call's first request (None if the caller sent END at once), within FIRST_RECORD_S."""
    try:
        kind, payload = await asyncio.wait_for(read_record(reader), FIRST_RECORD_S)
    except RecordTooLarge as exc:
        raise RpcAborted(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
    except asyncio.TimeoutError:
        raise RpcAborted(grpc.StatusCode.DEADLINE_EXCEEDED, f"no request within {FIRST_RECORD_S:.0f} s") from None
    return None if kind is RecordKind.END else _parse(kind, payload, input_type)


def _handler(behaviour: Callable, method, input_type, limits: CallLimits) -> Callable:
    """The libp2p stream handler that runs one method of a servicer."""

    async def handle(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(stream_info.peer_id)
        try:
            with limits.pending.holding(peer) as waiting:
                if waiting > PENDING_PER_PEER:
                    raise RpcAborted(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"{peer} has {PENDING_PER_PEER} calls starting here already")
                first = await _first(reader, input_type)
            sender = (call_owner(first, limits.key, limits.keys, peer) if first is not None and limits.key is not None
                      else peer)
            if sender is None:
                raise RpcAborted(grpc.StatusCode.UNAUTHENTICATED,
                                 "the call's first request failed authentication (wrong swarm token?)")
        except RpcAborted as exc:
            await _finish(writer, reader, pb.RpcStatus(code=exc.code.value[0], details=exc.details))
            return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        with limits.calls.holding(sender) as calls_of_sender:
            await _run_call(behaviour, method, input_type, P2PServicerContext(peer), reader, writer, calls_of_sender,
                            sender, first)

    return handle


async def _run_call(behaviour: Callable, method, input_type, context: P2PServicerContext, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter, calls_of_sender: int, sender: str, first) -> None:
    """One call: the requests in, the servicer's responses out, and the status last."""
    status = pb.RpcStatus(code=grpc.StatusCode.OK.value[0])
    try:
        if calls_of_sender > CALLS_PER_PEER:
            raise RpcAborted(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"{sender} has {CALLS_PER_PEER} calls open here already")
        requests = _requests(reader, input_type, first)
        if method.client_streaming:
            argument = requests
        else:
            argument = await anext(requests, None)
            if argument is None:
                raise RpcAborted(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request")
        if method.server_streaming:
            async for response in behaviour(argument, context):
                await write_record(writer, RecordKind.MESSAGE, response.SerializeToString())
        else:
            response = await behaviour(argument, context)
            await write_record(writer, RecordKind.MESSAGE, response.SerializeToString())
    except RpcAborted as exc:
        status = pb.RpcStatus(code=exc.code.value[0], details=exc.details)
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()  # the caller went away (or spoke nonsense): nobody to tell
        return
    except Exception as exc:  # a servicer's bug must not end the daemon; the caller gets UNKNOWN, as from gRPC
        log.exception("p2p handler %s failed", method.full_name)
        status = pb.RpcStatus(code=grpc.StatusCode.UNKNOWN.value[0], details=f"{type(exc).__name__} in {method.name}")
    await _finish(writer, reader, status)


async def _finish(writer: asyncio.StreamWriter, reader: asyncio.StreamReader, status: pb.RpcStatus) -> None:
    try:
        await write_record(writer, RecordKind.STATUS, status.SerializeToString())
        await _until_caller_closes(reader)
    except ConnectionError:
        pass
    finally:
        writer.close()


async def _until_caller_closes(reader: asyncio.StreamReader, timeout: float = 5.0) -> None:
    """Wait (discarding what still comes) until the caller, having read the status, closes the
    stream: closing first could reset the stream before the status reached the caller."""
    async def drain():
        while await reader.read(1 << 16):
            pass

    try:
        await asyncio.wait_for(drain(), timeout)
    except asyncio.TimeoutError:
        pass


async def serve_service(host, service_name: str, servicer, key=None, keys=None) -> None:
    """Serve every method of the gRPC service `service_name` (as in tahnode.proto) of `servicer`
    on `host` (tahnode.net.p2p.host.P2PHost); `key` (the SwarmKey) counts calls per authenticated
    sender (`call_owner`, with `keys` the node keys known here; without a key, per libp2p peer:
    tests of the carrier alone)."""
    service = pb.DESCRIPTOR.services_by_name[service_name]
    limits = CallLimits(key, keys)
    for method in service.methods:
        input_type = request_type(getattr(pb, method.input_type.name))
        path = f"/{service.full_name}/{method.name}"
        await host.handle(protocol_name(path), _handler(getattr(servicer, method.name), method, input_type, limits))


_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class P2PCall:
    """One call on its own stream: `write`/`done_writing` send requests; `responses()` yields the
    callee's replies and raises grpc.aio.AioRpcError for a status other than OK (UNAVAILABLE when
    the stream cannot be opened or breaks). Awaiting the call gives its single response."""

    def __init__(self, channel: "P2PChannel", method: str, serialize: Callable, deserialize: Callable,
                 timeout: float | None):
        self.serialize, self.deserialize, self.timeout = serialize, deserialize, timeout
        self.name = protocol_name(method)
        self._stream = asyncio.ensure_future(channel.open(self.name))
        self._feeder: asyncio.Task | None = None

    async def _writer(self) -> asyncio.StreamWriter:
        try:
            return (await self._stream)[1]
        except P2PError as exc:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, str(exc)) from None

    async def write(self, request) -> None:
        writer = await self._writer()
        try:
            await write_record(writer, RecordKind.MESSAGE, self.serialize(request))
        except ConnectionError as exc:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"p2p stream {self.name} broke: {exc}") from None

    async def done_writing(self) -> None:
        writer = await self._writer()
        try:
            await write_record(writer, RecordKind.END)
        except ConnectionError as exc:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"p2p stream {self.name} broke: {exc}") from None

    def feed(self, requests) -> None:
        """Send every request of the (async or plain) iterable `requests`, then END."""
        async def run():
            if hasattr(requests, "__aiter__"):
                async for request in requests:
                    await self.write(request)
            else:
                for request in requests:
                    await self.write(request)
            await self.done_writing()

        self._feeder = asyncio.ensure_future(run())

    def _stop_feeder(self) -> None:
        if self._feeder is None:
            return
        if not self._feeder.done():
            self._feeder.cancel()
        elif not self._feeder.cancelled():
            self._feeder.exception()  # retrieved: the call's own error says the same

    async def responses(self) -> AsyncIterator[Any]:
        try:
            await self._writer()
        except grpc.aio.AioRpcError:
            self._stop_feeder()
            raise
        reader, writer = await self._stream
        try:
            while True:
                try:
                    kind, payload = await read_record(reader)
                except (asyncio.IncompleteReadError, ConnectionError) as exc:
                    if self._feeder is not None and self._feeder.done() and self._feeder.exception() is not None:
                        raise self._feeder.exception()
                    raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"p2p stream {self.name} closed without a status "
                                    f"({type(exc).__name__})") from None
                if kind is RecordKind.MESSAGE:
                    yield self.deserialize(payload)
                elif kind is RecordKind.STATUS:
                    status = pb.RpcStatus.FromString(payload)
                    code = _STATUS_BY_VALUE.get(status.code, grpc.StatusCode.UNKNOWN)
                    if code is not grpc.StatusCode.OK:
                        raise rpc_error(code, status.details)
                    return
                else:
                    raise rpc_error(grpc.StatusCode.INTERNAL, f"unexpected {kind.name} record from the callee")
        finally:
            self._stop_feeder()
            writer.close()

    async def single(self):
        """The one response of a unary-response call."""
        async def one():
            result = None
            async for response in self.responses():
                result = response
            if result is None:
                raise rpc_error(grpc.StatusCode.INTERNAL, f"{self.name} ended without a response")
            return result

        try:
            return await asyncio.wait_for(one(), self.timeout) if self.timeout else await one()
        except asyncio.TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"{self.name} took longer than {self.timeout:.0f} s") from None
        finally:
            if not self._stream.done():
                self._stream.cancel()

    def __await__(self):
        return self.single().__await__()

    def __aiter__(self):
        return self.responses()


class P2PChannel:
    """What a generated stub (tahnode_pb2_grpc.*Stub) needs of a channel, over libp2p streams (of
    this process's P2PHost) to the peer at `address` (tahnode.net.p2p.host.P2PAddress). `delay_s`
    adds an emulated one-way delay before each unary request and its reply (tahnode.net.emulation)."""

    def __init__(self, address: str, delay_s: float = 0.0):
        self.address, self.delay_s = address, delay_s

    async def open(self, name: str):
        return await (await process_host()).open_stream(self.address, name)

    def unary_unary(self, method: str, request_serializer: Callable, response_deserializer: Callable, **_):
        async def call(request, timeout: float | None = None, **_kw):
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            c = P2PCall(self, method, request_serializer, response_deserializer, timeout)
            c.feed([request])
            reply = await c
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            return reply

        return call

    def unary_stream(self, method: str, request_serializer: Callable, response_deserializer: Callable, **_):
        def call(request, timeout: float | None = None, **_kw) -> P2PCall:
            c = P2PCall(self, method, request_serializer, response_deserializer, timeout)
            c.feed([request])
            return c

        return call

    def stream_unary(self, method: str, request_serializer: Callable, response_deserializer: Callable, **_):
        def call(request_iterator=None, timeout: float | None = None, **_kw) -> P2PCall:
            c = P2PCall(self, method, request_serializer, response_deserializer, timeout)
            if request_iterator is not None:
                c.feed(request_iterator)
            return c

        return call

    async def channel_ready(self) -> None:
        """Nothing to wait for: every call opens its own stream (directly or through a relay), and
        an unreachable peer fails that call with UNAVAILABLE."""
        await process_host()

    async def close(self) -> None:
        pass

    async def __aenter__(self) -> "P2PChannel":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
