"""Envelopes on a byte stream: each serialized Envelope travels as authenticated frames of at most
1 MiB, sealed for one recipient and run; the receiver checks every frame, the envelope's seal,
their order and the size before parsing the envelope.

A frame's data is a view of the envelope's body until the frame is written (one join: the only
copy of the payload on the way out); a received frame's data is a view of the bytes that came off
the wire, copied once into the reassembled body (tahnode.tools.bench_copies counts both). What a
stream holds is counted in those bytes, every frame's whole message, against the envelope cap."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..proto import tahnode_pb2 as pb
from .auth import BadMac, Sealer
from .body import Body, open_body
from .freshness import SealRefused
from .wire_frame import OutgoingFrame, ReceivedFrame

__all__ = ["CHUNK_BYTES", "MAX_ENVELOPE_BYTES", "FrameError", "FrameNotAuthenticated", "FrameNotFresh", "FrameTooLarge",
           "frames_of", "OutgoingFrame", "ReceivedFrame", "Reassembler", "open_envelope", "request_type"]

CHUNK_BYTES = 1 << 20            # an Envelope travels in frames of at most 1 MiB of data
MAX_ENVELOPE_BYTES = 1 << 31     # refuse reassembling anything larger (until the run sets a tighter cap)


class FrameError(ValueError):
    """A frame or envelope that cannot be accepted (malformed, out of order, too large)."""


class FrameNotAuthenticated(FrameError):
    """A frame whose MAC does not match: the sender lacks the swarm token."""


class FrameTooLarge(FrameError):
    """An envelope larger than the largest a peer of this run sends (tahnode.pipeline.admission.envelope_cap)."""


class FrameNotFresh(FrameError):
    """An envelope whose seal is refused: replayed, for another node or run, or off the clock."""


def request_type(message_type):
    """What parses a request of `message_type` on this node's servers: frames as ReceivedFrame."""
    return ReceivedFrame if message_type is pb.Frame else message_type


def frames_of(sealer: Sealer, recipient: str, data: bytes | Body):
    """The frames of one envelope's body for `recipient`, under one fresh seal counter."""
    body = data if isinstance(data, Body) else Body((data,))
    seq = sealer.counter.next()
    count = max(1, -(-len(body) // CHUNK_BYTES))
    for index, parts in enumerate(body.chunks(CHUNK_BYTES)):
        yield sealer.frame(recipient, seq, index, count, parts)


class Reassembler:
    """Frames -> whole envelopes, checking authentication, freshness, order and sizes."""

    def __init__(self, sealer: Sealer, cap: int = MAX_ENVELOPE_BYTES, peer_keys: Mapping[str, bytes] | None = None,
                 allocate: Callable[[int], Any] = bytearray):
        """`allocate(n)`: a writable buffer of n bytes for each whole envelope (page-locked memory on
        a GPU stage, tahnode.codecs.base.pinned_buffer)."""
        self.sealer, self.cap, self.allocate = sealer, cap, allocate
        self.peer_keys = peer_keys if peer_keys is not None else {}  # who may send frames here, by node id
        self.parts: list[bytes] = []
        self.seq: int | None = None
        self.sender = ""
        self.count = 0  # frames in the envelope being received, as its first frame said
        self.size = 0   # bytes of the messages its frames came in (what their data's views hold)

    def add(self, frame: pb.Frame | ReceivedFrame):
        """The envelope's bytes, in one new buffer from `allocate`, once its last frame arrived, else
        None; raises FrameError. Every frame must give its envelope's count, and the messages its
        frames came in count against the cap (a ReceivedFrame's data holds all of its message)."""
        data = frame.data  # read once: each read of a protobuf Frame's data copies it
        try:
            self.sealer.check_frame(frame, first=frame.index == 0, signed_by=self.peer_keys.get(frame.sender),
                                    data=data)
        except BadMac as exc:
            raise FrameNotAuthenticated(str(exc)) from None
        except SealRefused as exc:
            raise FrameNotFresh(f"envelope from {frame.sender!r} refused: {exc}") from None
        if frame.count == 0 or frame.index >= frame.count:
            raise FrameError(f"malformed frame: index {frame.index} of {frame.count}")
        if frame.index and (frame.seq != self.seq or frame.sender != self.sender or frame.index != len(self.parts)):
            raise FrameError(f"frames out of order: seq {frame.seq} index {frame.index}")
        if frame.index and frame.count != self.count:
            raise FrameError(f"frame {frame.index} gives a count of {frame.count} frames, its "
                             f"envelope's first {self.count}")
        if frame.index == 0:
            self.parts, self.seq, self.sender, self.count, self.size = [], frame.seq, frame.sender, frame.count, 0
        if frame.index == 0 and (frame.count - 1) * CHUNK_BYTES >= self.cap:
            raise FrameTooLarge(f"an envelope of {frame.count} frames is larger than the largest this run "
                                f"sends ({self.cap} bytes)")
        if len(data) > CHUNK_BYTES:
            raise FrameError(f"a frame of {len(data)} bytes of data, more than {CHUNK_BYTES}")
        self.size += frame.wire_bytes if isinstance(frame, ReceivedFrame) else frame.ByteSize()
        if self.size > self.cap:
            raise FrameTooLarge(f"envelope larger than the largest this run sends ({self.cap} bytes)")
        self.parts.append(data)
        if frame.index + 1 == frame.count:
            body, self.parts = Body(tuple(self.parts)).joined(self.allocate), []
            return body
        return None


    def reset(self) -> None:
        """Drop a partly received envelope (the stream ended or was refused)."""
        self.parts, self.count, self.size = [], 0, 0


def open_envelope(data: bytearray) -> tuple[pb.Envelope, memoryview | None]:
    """A whole envelope from its bytes, and its tensor's payload as a view of them where the
    sender kept it apart (tahnode.net.body); raises FrameError if it is malformed or empty."""
    try:
        env, payload = open_body(data)
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError and others (as tahnode.proto.parse)
        raise FrameError(f"malformed envelope: {exc}") from None
    if env.WhichOneof("body") is None:
        raise FrameError("empty envelope")
    return env, payload
