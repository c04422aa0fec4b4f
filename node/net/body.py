"""An envelope's bytes without copying its payload: the envelope serialized without the tensor's
payload, then that payload as a field of its own (protobuf merges the two: the same Envelope).

The sender hands the payload's host buffer to the frames as it is (tahnode.net.wire_frame writes
each frame in one join); the receiver finds the payload at the end of the reassembled bytes and reads it
in place. A body in any other protobuf form still parses, the usual (copying) way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from google.protobuf.message import DecodeError

from ..codecs.host import payload_field_bytes
from ..proto import tahnode_pb2 as pb

__all__ = ["Body", "PendingBody", "UnusualField", "body_of", "fields", "open_body", "payload_field_bytes",
           "tail_prefix", "varint", "WIRE_LEN"]

WIRE_LEN = 2  # protobuf wire type of a length-delimited field
# fields scanned in Python at one level of a message at most: ours have a handful; bytes made of
# many tiny fields (a neighbour's way to stall the scan) go to protobuf's own parser instead
MAX_FIELDS = 64
# Envelope.micro_batch -> MicroBatch.tensor -> EncodedTensor.payload (its key one byte: codecs.host.payload_field_bytes)
PAYLOAD_PATH = (pb.Envelope.DESCRIPTOR.fields_by_name["micro_batch"].number,
                pb.MicroBatch.DESCRIPTOR.fields_by_name["tensor"].number,
                pb.EncodedTensor.DESCRIPTOR.fields_by_name["payload"].number)


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    """(value, position after it); raises DecodeError past the end or beyond 64 bits."""
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise DecodeError("truncated or overlong varint")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos


def tail_prefix(n: int) -> bytes:
    """The bytes before an `n`-byte payload that make it Envelope.micro_batch.tensor.payload."""
    out, inner = b"", n
    for number in reversed(PAYLOAD_PATH):
        head = varint(number << 3 | WIRE_LEN) + varint(inner)
        out, inner = head + out, inner + len(head)
    return out


@dataclass(frozen=True)
class Body:
    """The bytes of one envelope as a few buffers in order (the last may be a payload's host buffer,
    uncopied)."""

    segments: tuple  # of bytes-like objects

    def __len__(self) -> int:
        return sum(memoryview(s).nbytes for s in self.segments)

    def chunks(self, size: int):
        """The body cut into pieces of `size` bytes (the last shorter), each as a list of views."""
        piece, room = [], size
        for segment in self.segments:
            view = memoryview(segment).cast("B")
            while len(view):
                take = view[:room]
                piece.append(take)
                view, room = view[len(take):], room - len(take)
                if room == 0:
                    yield piece
                    piece, room = [], size
        if piece or not len(self):
            yield piece

    def envelope(self) -> pb.Envelope:
        """The whole Envelope these bytes are (payload included), parsed: for tools and tests that
        look into what a stage sends."""
        return pb.Envelope.FromString(self.joined())

    def joined(self, allocate: Callable[[int], Any] = bytearray):
        """The body in one new writable buffer, `allocate(len(self))` (a bytearray by default)."""
        out, at = allocate(len(self)), 0
        into = memoryview(out).cast("B")  # (a bytearray's own slice assignment copies what it is given first)
        for segment in self.segments:
            n = memoryview(segment).nbytes
            into[at : at + n] = memoryview(segment).cast("B")
            at += n
        return out


def body_of(envelope: pb.Envelope, payload=None) -> Body:
    """`envelope`'s body; `payload` (bytes-like): its micro-batch tensor's payload, kept apart
    from it (the envelope's own payload field must then be empty)."""
    head = envelope.SerializeToString()
    if payload is None:
        return Body((head,))
    n = memoryview(payload).nbytes
    return Body((head, tail_prefix(n), payload))


@dataclass(frozen=True)
class PendingBody:
    """An envelope whose micro-batch payload is still on its way to the host (a codec's
    PendingPayload, train.host_copy = "overlap"): finish() waits for it on the calling thread (the
    outgoing link's, not the compute thread) and makes the Body."""

    envelope: pb.Envelope
    payload: Any  # tahnode.codecs.PendingPayload: finish() -> the payload's bytes, its checksum written

    def finish(self) -> Body:
        return body_of(self.envelope, self.payload.finish())


class UnusualField(Exception):
    """A group, an unknown wire type or more than MAX_FIELDS fields: left to protobuf's own parser."""


def fields(data: memoryview, start: int, end: int):
    """(number, wire type, start of the field, start of its value, end of the field) of each
    top-level field in data[start:end]; raises DecodeError (truncated) or UnusualField."""
    pos, seen = start, 0
    while pos < end:
        seen += 1
        if seen > MAX_FIELDS:
            raise UnusualField(f"more than {MAX_FIELDS} fields")
        key, value_at = _read_varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == WIRE_LEN:
            size, value_at = _read_varint(data, value_at)
            field_end = value_at + size
        elif wire == 0:
            field_end = _read_varint(data, value_at)[1]
        elif wire in (1, 5):
            field_end = value_at + (8 if wire == 1 else 4)
        else:
            raise UnusualField(f"wire type {wire}")
        if field_end > end:
            raise DecodeError("a field runs past the end of its message")
        yield number, wire, pos, value_at, field_end
        pos = field_end


def _last_field(data: memoryview, start: int, end: int) -> tuple[int, int, int, int] | None:
    """(number, start of the field, start of its value, end) of the last field in data[start:end]
    if it is length-delimited, else None."""
    last = None
    for number, wire, at, value_at, field_end in fields(data, start, end):
        last = (number, at, value_at, field_end) if wire == WIRE_LEN else None
    return last


def _payload_at(data: memoryview) -> tuple[int, int, int] | None:
    """(end of the head, payload start, payload end) if the body ends in the payload's own field
    (as body_of writes it), else None."""
    start, end, head_end = 0, len(data), None
    for depth, number in enumerate(PAYLOAD_PATH):
        last = _last_field(data, start, end)
        if last is None or last[0] != number or last[3] != end:
            return None
        if depth == 0:
            head_end = last[1]
        elif last[1] != start:  # the inner message must hold nothing but the path
            return None
        start = last[2]
    return head_end, start, end


def open_body(data) -> tuple[pb.Envelope, memoryview | None]:
    """The envelope of a received body, and its payload as a view of `data` when the body ends in
    the payload's own field (then the envelope's payload field is to be ignored); raises
    DecodeError. `data`: a writable buffer (a bytearray) when the payload is to be decoded in place."""
    view = memoryview(data).cast("B")
    try:
        found = _payload_at(view)
    except (DecodeError, UnusualField):
        found = None
    if found is not None:
        head_end, start, end = found
        env = pb.Envelope.FromString(view[:head_end])
        if env.WhichOneof("body") in (None, "micro_batch"):
            env.micro_batch.tensor.SetInParent()  # the tail names it, as a plain parse would
            env.micro_batch.tensor.ClearField("payload")
            return env, view[start:end]
    return pb.Envelope.FromString(view), None
