"""Whom a p2p call counts against: the node its first request names where the token's MAC and that
node's bound key vouch for it, else that name and the libp2p peer it came on (tahnode.net.p2p.rpc)."""

from __future__ import annotations

from ...proto import tahnode_pb2 as pb
from ..auth import signed_bytes
from ..identity import verify_signature
from ..wire_frame import ReceivedFrame

__all__ = ["authentic_sender", "call_owner", "signed_by"]


def authentic_sender(message, key) -> str | None:
    """The node id a request's MAC vouches for (a frame's sender, a sealed message's seal), or None."""
    if isinstance(message, (pb.Frame, ReceivedFrame)):
        return message.sender if key.verify_frame(message) else None
    seal = getattr(message, "seal", None)
    if seal is None or not hasattr(message, "mac"):
        return None
    return (seal.sender or "?") if key.verify(message) else None


def call_owner(message, key, keys, peer: str) -> str | None:
    """Whom a call counts against: the node its first request names, where the token's MAC vouches
    for the request and that node's bound key (`keys`: node id -> public key) signed it; a request
    only the token vouches for (pings, probes, or a node whose key is not known here) counts against
    the name and the libp2p peer it came on together, so that a token holder naming a neighbour fills
    a quota of its own, never the neighbour's (issue 39, finding 10). None: the MAC fails."""
    named = authentic_sender(message, key)
    if named is None:
        return None
    public = keys.get(named) if keys is not None else None
    if public is not None and signed_by(message, public):
        return named
    return f"{named}@{peer}"


def signed_by(message, public: bytes) -> bool:
    """Whether a frame or a sealed message carries `public`'s signature of what its MAC covers."""
    if isinstance(message, (pb.Frame, ReceivedFrame)):
        return verify_signature(public, message.signature, message.mac)
    seal = message.seal
    return seal.public_key == public and verify_signature(public, seal.signature, signed_bytes(message))
