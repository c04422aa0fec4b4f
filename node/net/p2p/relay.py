"""A relay of tahnode's own, for peers behind NAT. libp2p's circuit relay in hivemind's p2pd resets
a relayed connection after 128 KiB (go-libp2p's default limits; the daemon's -relayDataLimit
does not reach them, measured here): enough to introduce two peers, not to carry activations.

So a public peer (one that announces its address: the coordinator, public nodes) also serves
/tahnode/1/relay. A caller sends one RelayRequest, MACed with the swarm key and fresh within
60 s; the relay opens a stream of the asked protocol to the target over the connection the target
keeps to it (its relay reservation), answers with an OK status, and copies bytes both ways until
either side ends. What it forwards carries tahnode's own MACs, seals and signatures end to end, so
a relay can read but not forge or replay it; only token holders use its bandwidth."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from google.protobuf.message import DecodeError

from ...proto import tahnode_pb2 as pb
from ..errors import PeerUnreachable
from .records import PROTOCOL_PREFIX, RecordKind, StreamsPerPeer, read_record, write_record

log = logging.getLogger("tahnode.p2p")

__all__ = ["RELAY_PROTOCOL", "serve_relay", "open_relayed"]

RELAY_PROTOCOL = PROTOCOL_PREFIX + "/relay"
RELAYED_PER_PEER = 16    # streams one caller may have relayed at once
FRESH_S = 60.0           # a request more than this far from the relay's clock is refused
REQUEST_WAIT_S = 10.0    # how long a relay waits for the request record


def _status(code: grpc.StatusCode, details: str = "") -> bytes:
    return pb.RpcStatus(code=code.value[0], details=details).SerializeToString()


async def _copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter, host) -> None:
    """Bytes from src to dst until src ends (then dst's write side ends too) or either breaks."""
    try:
        while chunk := await src.read(1 << 16):
            dst.write(chunk)
            await dst.drain()
            host.relayed_bytes += len(chunk)
        if dst.can_write_eof():
            dst.write_eof()
    except (ConnectionError, OSError):
        pass


async def serve_relay(host, key) -> None:
    """Relay streams for callers holding the swarm key `key` (tahnode.net.auth.SwarmKey) on `host`."""
    relayed = StreamsPerPeer()

    async def handle(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            with relayed.holding(str(stream_info.peer_id)) as streams_of_caller:
                await _relay(host, key, reader, writer, streams_of_caller > RELAYED_PER_PEER)
        finally:
            writer.close()

    await host.handle(RELAY_PROTOCOL, handle)


async def _relay(host, key, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, too_many: bool) -> None:
    try:
        kind, payload = await asyncio.wait_for(read_record(reader), REQUEST_WAIT_S)
        request = pb.RelayRequest.FromString(payload)
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, DecodeError):
        return
    refusal = None
    if too_many:
        refusal = (grpc.StatusCode.RESOURCE_EXHAUSTED, f"{RELAYED_PER_PEER} streams relayed for this caller already")
    elif kind is not RecordKind.MESSAGE or not key.verify(request):
        refusal = (grpc.StatusCode.UNAUTHENTICATED, "relay request failed authentication (wrong swarm token?)")
    elif abs(time.time() - request.sent_at) > FRESH_S:
        refusal = (grpc.StatusCode.PERMISSION_DENIED,
                   "relay request is stale (or the clocks differ by more than a minute)")
    if refusal is None:
        try:
            target_reader, target_writer = await host.open_to(request.target, request.protocol)
        except PeerUnreachable as exc:
            refusal = (grpc.StatusCode.UNAVAILABLE, f"{request.target} is not reachable from this relay: {exc}")
    try:
        if refusal is not None:
            log.info("refused to relay to %s: %s", request.target or "?", refusal[1])
            await write_record(writer, RecordKind.STATUS, _status(*refusal))
            return
        await write_record(writer, RecordKind.STATUS, _status(grpc.StatusCode.OK))
    except ConnectionError:
        return
    try:
        await asyncio.gather(_copy(reader, target_writer, host), _copy(target_reader, writer, host))
    finally:
        target_writer.close()


async def open_relayed(host, relay: str, target: str, protocol: str,
                       key) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream of `protocol` to peer `target` through the relay at p2p address `relay`;
    PeerUnreachable if the relay cannot be reached or refuses."""
    reader, writer = await host.open_direct(relay, RELAY_PROTOCOL)
    request = key.sign(pb.RelayRequest(target=target, protocol=protocol, sent_at=time.time()))
    try:
        await write_record(writer, RecordKind.MESSAGE, request.SerializeToString())
        kind, payload = await asyncio.wait_for(read_record(reader), REQUEST_WAIT_S * 2)
        status = pb.RpcStatus.FromString(payload)
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, DecodeError) as exc:
        writer.close()
        raise PeerUnreachable(f"relay {relay} did not answer ({type(exc).__name__})") from None
    if kind is not RecordKind.STATUS or status.code != grpc.StatusCode.OK.value[0]:
        writer.close()
        raise PeerUnreachable(f"relay {relay} refused to reach {target}: {status.details}")
    return reader, writer
