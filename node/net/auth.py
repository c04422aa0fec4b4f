"""Swarm authentication: every data-plane frame and control request carries an HMAC-SHA256 made
with a key derived from the swarm token, so peers without the token are refused by name."""

from __future__ import annotations

import hashlib
import hmac
import struct

from ..config.node import DEFAULT_TOKEN

__all__ = ["SwarmKey"]


class SwarmKey:
    """HMAC key of one swarm (derived from its token)."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("the swarm token must not be empty")
        self.key = hashlib.sha256(b"tahnode-v1\0" + token.encode()).digest()
        self.is_default = token == DEFAULT_TOKEN
        self._keyed = hmac.new(self.key, digestmod=hashlib.sha256)  # copied per MAC: the key is set up once

    def _mac(self, *parts: bytes) -> bytes:
        h = self._keyed.copy()
        for part in parts:
            h.update(part)
        return h.digest()

    def frame_mac(self, sender: str, seq: int, index: int, count: int, data: bytes) -> bytes:
        return self._mac(sender.encode(), b"\0", struct.pack("<QII", seq, index, count), data)

    def message_mac(self, msg) -> bytes:
        """MAC of a protobuf request over its deterministic bytes with the `mac` field empty."""
        saved = msg.mac
        msg.mac = b""
        data = msg.SerializeToString(deterministic=True)
        msg.mac = saved
        return self._mac(type(msg).__name__.encode(), b"\0", data)

    def sign(self, msg):
        msg.mac = self.message_mac(msg)
        return msg

    def verify(self, msg) -> bool:
        return hmac.compare_digest(msg.mac, self.message_mac(msg))

    def verify_frame(self, frame) -> bool:
        return hmac.compare_digest(frame.mac, self.frame_mac(frame.sender, frame.seq, frame.index, frame.count, frame.data))
