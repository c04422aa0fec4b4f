"""Envelopes on a byte stream: each serialized Envelope travels as authenticated frames of at most
1 MiB; the receiver checks every frame, their order and the size before parsing the envelope."""

from __future__ import annotations

from ..proto import tahnode_pb2 as pb
from ..proto.parse import parse
from .auth import SwarmKey

__all__ = ["CHUNK_BYTES", "MAX_ENVELOPE_BYTES", "FrameError", "FrameNotAuthenticated", "frames_of", "Reassembler",
           "parse_envelope"]

CHUNK_BYTES = 1 << 20            # an Envelope travels in frames of at most 1 MiB of data
MAX_ENVELOPE_BYTES = 1 << 31     # refuse reassembling anything larger


class FrameError(ValueError):
    """A frame or envelope that cannot be accepted (malformed, out of order, too large)."""


class FrameNotAuthenticated(FrameError):
    """A frame whose MAC does not match: the sender lacks the swarm token."""


def frames_of(key: SwarmKey, sender: str, seq: int, data: bytes):
    """The frames of one serialized envelope, numbered `seq` by its sender."""
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

    def add(self, frame: pb.Frame) -> bytes | None:
        """The envelope's bytes once its last frame arrived, else None; raises FrameError."""
        if not self.key.verify_frame(frame):
            raise FrameNotAuthenticated(f"frame from {frame.sender or '?'} failed authentication (wrong swarm token?)")
        if frame.count == 0 or frame.index >= frame.count:
            raise FrameError(f"malformed frame: index {frame.index} of {frame.count}")
        if frame.index == 0:
            self.parts, self.seq, self.size = [], frame.seq, 0
        elif frame.seq != self.seq or frame.index != len(self.parts):
            raise FrameError(f"frames out of order: seq {frame.seq} index {frame.index}")
        self.size += len(frame.data)
        if self.size > MAX_ENVELOPE_BYTES:
            raise FrameError("envelope larger than 2 GiB")
        self.parts.append(frame.data)
        if frame.index + 1 == frame.count:
            data, self.parts = b"".join(self.parts), []
            return data
        return None


def parse_envelope(data: bytes) -> pb.Envelope:
    """A whole envelope from its bytes; raises FrameError if it is malformed or empty."""
    env = parse(pb.Envelope, data, FrameError, "envelope")
    if env.WhichOneof("body") is None:
        raise FrameError("empty envelope")
    return env
