"""Envelopes on a byte stream: each serialized Envelope travels as authenticated frames of at most
1 MiB, sealed for one recipient and run; the receiver checks every frame, the envelope's seal,
their order and the size before parsing the envelope."""

from __future__ import annotations

from typing import Mapping

from ..proto import tahnode_pb2 as pb
from ..proto.parse import parse
from .auth import BadMac, Sealer
from .freshness import SealRefused

__all__ = ["CHUNK_BYTES", "MAX_ENVELOPE_BYTES", "FrameError", "FrameNotAuthenticated", "FrameNotFresh", "FrameTooLarge", "frames_of",
           "Reassembler", "parse_envelope"]

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


def frames_of(sealer: Sealer, recipient: str, data: bytes):
    """The frames of one serialized envelope for `recipient`, under one fresh seal counter."""
    seq = sealer.counter.next()
    count = max(1, -(-len(data) // CHUNK_BYTES))
    for index in range(count):
        yield sealer.frame(recipient, seq, index, count, data[index * CHUNK_BYTES : (index + 1) * CHUNK_BYTES])


class Reassembler:
    """Frames -> whole envelopes, checking authentication, freshness, order and sizes."""

    def __init__(self, sealer: Sealer, cap: int = MAX_ENVELOPE_BYTES, peer_keys: Mapping[str, bytes] | None = None):
        self.sealer, self.cap = sealer, cap
        self.peer_keys = peer_keys if peer_keys is not None else {}  # who may send frames here, by node id
        self.parts: list[bytes] = []
        self.seq: int | None = None
        self.sender = ""
        self.size = 0

    def add(self, frame: pb.Frame) -> bytes | None:
        """The envelope's bytes once its last frame arrived, else None; raises FrameError."""
        data = frame.data  # read once: each read copies the bytes out of protobuf
        try:
            self.sealer.check_frame(frame, first=frame.index == 0, signed_by=self.peer_keys.get(frame.sender), data=data)
        except BadMac as exc:
            raise FrameNotAuthenticated(str(exc)) from None
        except SealRefused as exc:
            raise FrameNotFresh(f"envelope from {frame.sender!r} refused: {exc}") from None
        if frame.count == 0 or frame.index >= frame.count:
            raise FrameError(f"malformed frame: index {frame.index} of {frame.count}")
        if frame.index and (frame.seq != self.seq or frame.sender != self.sender or frame.index != len(self.parts)):
            raise FrameError(f"frames out of order: seq {frame.seq} index {frame.index}")
        if frame.index == 0:
            self.parts, self.seq, self.sender, self.size = [], frame.seq, frame.sender, 0
        if frame.index == 0 and (frame.count - 1) * CHUNK_BYTES >= self.cap:
            raise FrameTooLarge(f"an envelope of {frame.count} frames is larger than the largest this run sends ({self.cap} bytes)")
        self.size += len(data)
        if self.size > self.cap:
            raise FrameTooLarge(f"envelope larger than the largest this run sends ({self.cap} bytes)")
        self.parts.append(data)
        if frame.index + 1 == frame.count:
            data, self.parts = b"".join(self.parts), []
            return data
        return None


    def reset(self) -> None:
        """Drop a partly received envelope (the stream ended or was refused)."""
        self.parts, self.size = [], 0


def parse_envelope(data: bytes) -> pb.Envelope:
    """A whole envelope from its bytes; raises FrameError if it is malformed or empty."""
    env = parse(pb.Envelope, data, FrameError, "envelope")
    if env.WhichOneof("body") is None:
        raise FrameError("empty envelope")
    return env
