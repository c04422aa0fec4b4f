"""A data-plane frame without copies of its data: an OutgoingFrame holds views of the envelope's
body until it is written, a ReceivedFrame's data is a view of the bytes that came off the wire."""

from __future__ import annotations

from ..proto import tahnode_pb2 as pb
from .body import WIRE_LEN, UnusualField, fields, varint

__all__ = ["OutgoingFrame", "ReceivedFrame"]

DATA_FIELD = pb.Frame.DESCRIPTOR.fields_by_name["data"].number
DATA_KEY = varint(DATA_FIELD << 3 | WIRE_LEN)


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
    the received bytes. Reads like a Frame; `FromString` is the request parser of the data plane's
    streams (gRPC and p2p)."""

    __slots__ = ("head", "data")
    DESCRIPTOR = pb.Frame.DESCRIPTOR

    def __init__(self, head: pb.Frame, data):
        self.head, self.data = head, data

    def __getattr__(self, name: str):
        return getattr(self.head, name)

    @classmethod
    def FromString(cls, raw) -> "ReceivedFrame":  # noqa: N802 (protobuf's name, as the parsers call it)
        """Raises DecodeError for bytes that are no Frame."""
        view = memoryview(raw).cast("B")
        try:
            found = [(at, value_at, end) for number, wire, at, value_at, end in fields(view, 0, len(view))
                     if number == DATA_FIELD and wire == WIRE_LEN]
        except UnusualField:
            frame = pb.Frame.FromString(raw)  # the plain way (it copies the data)
            return cls(frame, frame.data)
        if not found:
            return cls(pb.Frame.FromString(raw), b"")
        rest, pos = [], 0
        for at, _, end in found:  # the head is what lies around the data fields (protobuf keeps the last)
            rest.append(view[pos:at])
            pos = end
        rest.append(view[pos:])
        head = pb.Frame.FromString(b"".join(rest))
        return cls(head, view[found[-1][1]:found[-1][2]])


