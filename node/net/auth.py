"""Swarm authentication: every control message carries an HMAC-SHA256 made with a key derived from
the swarm token (`SwarmKey`) over the message and its seal, every data-plane frame a keyed BLAKE3
MAC (as fast as a copy of its data) with a key derived from the same, and both the sender's Ed25519
signature (`Sealer`, with the node's identity of tahnode.net.identity)."""

from __future__ import annotations

import hashlib
import hmac
import struct

import blake3

from ..proto import tahnode_pb2 as pb
from .freshness import TOKEN_ONLY, RefusalReason, ReplayGuard, SealCounter, SealRefused
from .identity import KEY_BYTES, NodeKey, verify_signature
from .wire_frame import OutgoingFrame

__all__ = ["SwarmKey", "Sealer", "BadMac"]

FRAME_KEY_CONTEXT = "tahnode 2026-11-25 data-plane frame MAC"  # BLAKE3 derive_key context of the frame key


class BadMac(ValueError):
    """A message or frame whose MAC does not match: the sender lacks the swarm token (or the message
    was altered on the way)."""


def frame_parts(frame, data=None) -> tuple:
    """What a frame's MAC covers (and so its signature, which signs the MAC): run, sender,
    recipient, seq, index, count, data. `data`: the frame's data where the caller holds it already
    (each read of a Frame's `data` copies it out of protobuf), as one buffer or a list of pieces."""
    head = b"\0".join(s.encode() for s in (frame.run, frame.sender, frame.recipient))
    data = frame.data if data is None else data
    pieces = tuple(data) if isinstance(data, (list, tuple)) else (data,)
    return (head, b"\0", struct.pack("<QII", frame.seq, frame.index, frame.count), *pieces)


def canonical_bytes(msg, without_signature: bool) -> bytes:
    """Its type name, a zero byte and its deterministic bytes with an empty `mac` (what the MAC
    covers) and, `without_signature`, an empty seal signature too (what the signature covers)."""
    mac, signature = msg.mac, msg.seal.signature if without_signature else b""
    msg.mac = b""
    if without_signature:
        msg.seal.signature = b""
    data = msg.SerializeToString(deterministic=True)
    msg.mac = mac
    if without_signature:
        msg.seal.signature = signature
    return type(msg).__name__.encode() + b"\0" + data


def signed_bytes(msg) -> bytes:
    """What a message's signature covers."""
    return canonical_bytes(msg, without_signature=True)


class SwarmKey:
    """HMAC key of one swarm (derived from its token)."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("the swarm token must not be empty")
        self.key = hashlib.sha256(b"tahnode-v1\0" + token.encode()).digest()
        self._keyed = hmac.new(self.key, digestmod=hashlib.sha256)  # copied per MAC: the key is set up once
        self.frame_key = blake3.blake3(self.key, derive_key_context=FRAME_KEY_CONTEXT).digest()

    def _mac(self, *parts: bytes) -> bytes:
        h = self._keyed.copy()
        for part in parts:
            h.update(part)
        return h.digest()

    def frame_mac(self, frame, data=None, kind: int = pb.BLAKE3_KEYED) -> bytes:
        """The MAC of kind `kind` of the frame's fields and data; raises BadMac for a kind this
        build does not know."""
        parts = frame_parts(frame, data)
        if kind == pb.HMAC_SHA256:
            return self._mac(*parts)
        if kind != pb.BLAKE3_KEYED:
            raise BadMac(f"frame from {frame.sender or '?'} carries an unknown MAC kind {kind}")
        h = blake3.blake3(key=self.frame_key)
        for part in parts:
            h.update(part)
        return h.digest()

    def message_mac(self, msg) -> bytes:
        """MAC of a protobuf message over its deterministic bytes with the `mac` field empty."""
        return self._mac(canonical_bytes(msg, without_signature=False))

    def sign(self, msg):
        msg.mac = self.message_mac(msg)
        return msg

    def verify(self, msg) -> bool:
        return hmac.compare_digest(msg.mac, self.message_mac(msg))

    def verify_frame(self, frame, data=None) -> bool:
        try:
            return hmac.compare_digest(frame.mac, self.frame_mac(frame, data, frame.mac_kind))
        except BadMac:
            return False


class Sealer:
    """One process's signing identity: it seals and signs what it sends (`seal`, `frame`) and checks
    what it receives (`check`, `check_frame`: the MAC, then the seal with its ReplayGuard). `run`
    is the swarm's run id once known (a node learns it when it joins)."""

    def __init__(self, key: SwarmKey, me: str, run: str = "", identity: NodeKey | None = None, seen_file=None):
        self.key, self.me, self.identity = key, me, identity
        self.counter = SealCounter()
        self.guard = ReplayGuard(me, run, store=seen_file)  # seen_file: the senders' counters kept across a restart

    @property
    def run(self) -> str:
        return self.guard.run

    @run.setter
    def run(self, run: str) -> None:
        self.guard.run = run

    def seal(self, msg, recipient: str):
        """`msg` sealed for `recipient` and signed (in place; returned for convenience)."""
        msg.seal.CopyFrom(pb.Seal(run=self.run, sender=self.me, recipient=recipient, counter=self.counter.next()))
        if self.identity is not None:
            msg.seal.public_key = self.identity.public
            msg.seal.signature = self.identity.sign(signed_bytes(msg))
        return self.key.sign(msg)

    def check(self, msg, speaks_for: str | None = None, run_optional: bool = False,
              signed_by: bytes | None = None) -> str:
        """The sender of a received message; raises BadMac or SealRefused. `speaks_for`: the node the
        message acts for, which must be its sender; `run_optional`: a message sent before the
        sender knew the run (a join); `signed_by`: the public key that must have signed it."""
        if not self.key.verify(msg):
            self.guard.refused[RefusalReason.BAD_MAC] += 1
            raise BadMac(f"{type(msg).__name__} failed authentication (wrong swarm token?)")
        s = msg.seal
        if speaks_for is not None and s.sender != speaks_for:
            self._refuse(RefusalReason.WRONG_SENDER, f"sealed by {s.sender!r} but speaks for {speaks_for!r}")
        if signed_by is not None and len(signed_by) != KEY_BYTES:
            self._refuse(RefusalReason.WRONG_KEY, f"{type(msg).__name__} carries no node key (every node needs one)")
        if signed_by is not None and (s.public_key != signed_by
                                      or not verify_signature(signed_by, s.signature, signed_bytes(msg))):
            self._refuse(RefusalReason.WRONG_KEY, f"not signed by the key node {s.sender!r} is bound to")
        # only a message its sender's key signed counts against that sender's counters: a token
        # holder's ping sealed as V with a counter 59 s ahead raised V's floor, and after a restart
        # the receiver refused V's own frames for that long (issue 39, low); token-only ones keep theirs apart
        counted = s.sender if signed_by is not None else TOKEN_ONLY + s.sender
        self.guard.check(s.run, counted, s.recipient, s.counter, run_optional=run_optional)
        return s.sender

    def _refuse(self, reason: RefusalReason, detail: str):
        self.guard.refused[reason] += 1
        raise SealRefused(reason, detail)

    def frame(self, recipient: str, seq: int, index: int, count: int, data) -> OutgoingFrame:
        """A sealed frame whose data is `data` (one buffer or a list of pieces), uncopied until it is
        written (tahnode.net.wire_frame.OutgoingFrame)."""
        parts = list(data) if isinstance(data, (list, tuple)) else [data]
        f = pb.Frame(run=self.run, sender=self.me, recipient=recipient, seq=seq, index=index, count=count,
                     mac_kind=pb.BLAKE3_KEYED)
        f.mac = self.key.frame_mac(f, parts)
        if self.identity is not None:  # the MAC commits to every byte of the frame: signing it is signing them
            f.signature = self.identity.sign(f.mac)
        return OutgoingFrame(f, parts)

    def check_frame(self, frame, first: bool, signed_by: bytes | None, data=None) -> None:
        """Raises BadMac or SealRefused. Every frame must be signed by `signed_by`, the sender's
        bound key (None: the sender is no neighbour of this node, refused); the first frame of an
        envelope carries its seal (`seq`), the later ones are held to it by the reassembler.
        `data`: the frame's data, if the caller read it already."""
        # HMAC-SHA256 (older senders) costs a receiver 5x the CPU: not the sender's pick
        if frame.mac_kind != pb.BLAKE3_KEYED:
            self.guard.refused[RefusalReason.BAD_MAC] += 1
            raise BadMac(f"frame from {frame.sender or '?'} carries an HMAC-SHA256 MAC; this swarm's "
                         "frames carry keyed BLAKE3")
        if not self.key.verify_frame(frame, data):
            self.guard.refused[RefusalReason.BAD_MAC] += 1
            raise BadMac(f"frame from {frame.sender or '?'} failed authentication (wrong swarm token?)")
        if signed_by is None:
            self._refuse(RefusalReason.STRANGER,
                         f"{frame.sender!r} is not a neighbour of {self.me!r} (or not yet known here)")
        if not verify_signature(signed_by, frame.signature, frame.mac):
            self._refuse(RefusalReason.WRONG_KEY, f"frame not signed by the key node {frame.sender!r} is bound to")
        if first:
            self.guard.check(frame.run, frame.sender, frame.recipient, frame.seq)
