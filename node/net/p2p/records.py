"""The records every tahnode libp2p stream is made of: a kind byte, a 4-byte big-endian length, the
payload; a record above MAX_RECORD_BYTES is refused before it is read. Calls (tahnode.net.p2p.rpc)
and relay requests (tahnode.net.p2p.relay) speak them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from enum import IntEnum

__all__ = ["RecordKind", "RecordTooLarge", "MAX_RECORD_BYTES", "PROTOCOL_PREFIX", "protocol_name", "write_record",
           "read_record", "StreamsPerPeer"]

MAX_RECORD_BYTES = (4 << 20) + 4096   # gRPC's message limit here (grpc_transport.MAX_MESSAGE_BYTES), plus headroom
PROTOCOL_PREFIX = "/tahnode/1"


class RecordKind(IntEnum):
    MESSAGE = 0  # one serialized request or response
    END = 1      # the caller sends no more requests
    STATUS = 2   # the callee's last record: an RpcStatus


class RecordTooLarge(ConnectionError):
    """The other side announced a record above MAX_RECORD_BYTES."""


def protocol_name(method: str) -> str:
    """'/tahnode.StageService/Ping' (gRPC's method path) -> '/tahnode/1/StageService/Ping'."""
    service, name = method.strip("/").split("/")
    return f"{PROTOCOL_PREFIX}/{service.rsplit('.', 1)[-1]}/{name}"


async def write_record(writer: asyncio.StreamWriter, kind: RecordKind, payload: bytes = b"") -> None:
    writer.write(bytes([kind]) + len(payload).to_bytes(4, "big"))
    if payload:
        writer.write(payload)
    await writer.drain()


async def read_record(reader: asyncio.StreamReader) -> tuple[RecordKind, bytes]:
    """The next record; IncompleteReadError if the stream ends first, RecordTooLarge, or
    ConnectionError for an unknown kind."""
    head = await reader.readexactly(5)
    try:
        kind = RecordKind(head[0])
    except ValueError:
        raise ConnectionError(f"unknown record kind {head[0]} on a p2p stream") from None
    size = int.from_bytes(head[1:], "big")
    if size > MAX_RECORD_BYTES:
        raise RecordTooLarge(f"a record of {size} bytes is above the limit of {MAX_RECORD_BYTES}")
    return kind, (await reader.readexactly(size) if size else b"")


class StreamsPerPeer:
    """How many streams each remote peer has open with a handler now (what bounds the memory one
    peer can hold there)."""

    def __init__(self):
        self.open: dict[str, int] = {}

    @contextmanager
    def holding(self, peer: str) -> Iterator[int]:
        """Count one more stream of `peer` while inside; yields how many it has open, this one included."""
        self.open[peer] = self.open.get(peer, 0) + 1
        try:
            yield self.open[peer]
        finally:
            self.open[peer] -= 1
            if not self.open[peer]:
                del self.open[peer]
