"""A data-plane frame without copies of its data: an OutgoingFrame holds views of the envelope's
body until it is written, a ReceivedFrame's data is a view of the bytes that came off the wire.

A ReceivedFrame is bounded where it is parsed: its data's view keeps the whole message alive, so a
message with unknown fields, or more than FRAME_HEAD_BYTES beside its data, is no frame of ours."""

from __future__ import annotations

from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from ..proto import tahnode_pb2 as pb
from .body import WIRE_LEN, UnusualField, fields, varint

__all__ = ["FRAME_HEAD_BYTES", "OutgoingFrame", "PaddedFrame", "ReceivedFrame"]

DATA_FIELD = pb.Frame.DESCRIPTOR.fields_by_name["data"].number
DATA_KEY = varint(DATA_FIELD << 3 | WIRE_LEN)
# what a frame may carry beside its data: ids, run, seq, index, count, MAC and signature take about
# 200 bytes; more is padding that the data's view would keep in memory
FRAME_HEAD_BYTES = 4096


class PaddedFrame(DecodeError):
    """A frame with unknown fields or more than FRAME_HEAD_BYTES beside its data (a DecodeError: the
    data plane's parsers answer INVALID_ARGUMENT, as for bytes that are no Frame)."""


class OutgoingFrame:
    """A frame to send: its fields but the data (`head`, a Frame) and its data as views of the
    envelope's body (`parts`). Reads and writes like a Frame; `SerializeToString()` writes the
    Frame's wire bytes in one join."""

    __slots__ = ("head", "parts")

    def __init__(self, head: pb.Frame, parts: list):
        object.__setattr__(self, "head", head)
        object.__setattr__(self, "parts", parts)

    def __getattr__(self, name: str):
        return getattr(self.head, name)

    def __setattr__(self, name: str, value) -> None:
        if name == "data":
            object.__setattr__(self, "parts", [value])
        elif name in self.__slots__:
            object.__setattr__(self, name, value)
        else:
            setattr(self.head, name, value)

    @property
    def data(self) -> bytes:
        return b"".join(self.parts)

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's name: gRPC and p2p serialize requests with it)
        n = sum(memoryview(p).nbytes for p in self.parts)
        tail = [DATA_KEY, varint(n), *self.parts] if n else []
        return b"".join([self.head.SerializeToString(), *tail])


class ReceivedFrame:
    """A frame as it came off the wire: its fields but the data parsed (`head`), its data a view of
    the received bytes, and the size of those bytes (`wire_bytes`: what the frame holds in memory).
    Reads like a Frame; `FromString` is the request parser of the data plane's streams (gRPC and p2p)."""

    __slots__ = ("head", "data", "wire_bytes")
    DESCRIPTOR = pb.Frame.DESCRIPTOR

    def __init__(self, head: pb.Frame, data, wire_bytes: int):
        self.head, self.data, self.wire_bytes = head, data, wire_bytes

    def __getattr__(self, name: str):
        return getattr(self.head, name)

    @classmethod
    def FromString(cls, raw) -> "ReceivedFrame":  # noqa: N802 (protobuf's name, as the parsers call it)
        """Raises DecodeError for bytes that are no Frame, PaddedFrame for a frame with more (unknown
        fields, a head beyond FRAME_HEAD_BYTES: a second data field protobuf drops included)."""
        view = memoryview(raw).cast("B")
        try:
            found = [(at, value_at, end) for number, wire, at, value_at, end in fields(view, 0, len(view))
                     if number == DATA_FIELD and wire == WIRE_LEN]
        except UnusualField:
            frame = pb.Frame.FromString(raw)  # the plain way (it copies the data)
            return cls._bounded(frame, frame.data, len(view))
        if not found:
            return cls._bounded(pb.Frame.FromString(raw), b"", len(view))
        rest, pos = [], 0
        for at, _, end in found:  # the head is what lies around the data fields (protobuf keeps the last)
            rest.append(view[pos:at])
            pos = end
        rest.append(view[pos:])
        head = pb.Frame.FromString(b"".join(rest))
        return cls._bounded(head, view[found[-1][1]:found[-1][2]], len(view))

    @classmethod
    def _bounded(cls, head: pb.Frame, data, wire_bytes: int) -> "ReceivedFrame":
        if len(UnknownFieldSet(head)):
            raise PaddedFrame(f"a frame from {head.sender[:64]!r} carries fields a Frame does not have")
        if wire_bytes - len(data) > FRAME_HEAD_BYTES:
            raise PaddedFrame(f"a frame from {head.sender[:64]!r} carries {wire_bytes - len(data)} bytes beside its "
                              f"{len(data)} bytes of data, more than {FRAME_HEAD_BYTES}")
        return cls(head, data, wire_bytes)


