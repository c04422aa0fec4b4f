"""A node's identity: an Ed25519 key pair made on its first start and kept in its state directory
(`NodeKey`); the coordinator binds a node id to its public key at the first join, and every message
and frame the node sends carries its signature (`verify_signature`)."""

from __future__ import annotations

import functools

from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ..config.token import write_secret

__all__ = ["NodeKey", "verify_signature", "KEY_FILE", "KEY_BYTES"]

KEY_FILE = "node.key"
KEY_BYTES = 32  # a raw Ed25519 public key


class NodeKey:
    """An Ed25519 private key; `public` is its raw 32-byte public key."""

    def __init__(self, private: Ed25519PrivateKey):
        self.private = private
        self.public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @classmethod
    def generate(cls) -> "NodeKey":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: Path) -> "NodeKey":
        """The key kept at `path`, or a new one written there readable by its owner only."""
        if path.exists():
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            if not isinstance(key, Ed25519PrivateKey):
                raise ValueError(f"{path} does not hold an Ed25519 key")
            return cls(key)
        key = cls.generate()
        write_secret(path, key.private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
        return key

    def sign(self, data: bytes) -> bytes:
        return self.private.sign(data)


@functools.lru_cache(maxsize=4096)
def _public_key(public: bytes) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(public)


def verify_signature(public: bytes, signature: bytes, data: bytes) -> bool:
    """True if `signature` is `public`'s Ed25519 signature of `data` (a malformed key: False)."""
    try:
        _public_key(public).verify(signature, data)
        return True
    except (InvalidSignature, ValueError):
        return False
