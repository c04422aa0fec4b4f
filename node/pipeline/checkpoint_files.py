"""The file side of stage checkpoints (tahnode.pipeline.checkpoint): the SHA-256 that vouches for a
file, durable and owner-only writes, and the chunks a file travels in."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from .checkpoint_errors import CorruptCheckpoint

CHUNK_BYTES = 1 << 20  # a checkpoint travels in chunks of this size
DIGEST_KEY = "sha256"  # metadata key of the checksum


def digest(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """SHA-256 over the metadata (all but the checksum itself) and every tensor's name, dtype,
    shape and bytes, in name order."""
    h = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != DIGEST_KEY}, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def read_verified(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a checkpoint file, after checking its SHA-256; raises
    CorruptCheckpoint (a file without a checksum too: whoever wrote it, nothing vouches for it)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise CorruptCheckpoint(f"checkpoint {path} is unreadable: {exc}") from None
    recorded = meta.get(DIGEST_KEY)
    if recorded is None:
        raise CorruptCheckpoint(f"checkpoint {path} has no checksum: it cannot be verified, so it is not used")
    if digest(tensors, meta) != recorded:
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: its contents do not match the SHA-256 recorded in it")
    return tensors, meta


def durable_replace(tmp: Path, final: Path) -> None:
    """Flush `tmp` to disk, rename it to `final` and flush the directory: after a crash the name
    holds either the old file or the whole new one."""
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_chunks(path: str | Path, size: int = CHUNK_BYTES) -> Iterator[tuple[bytes, bool]]:
    """(data, last) pieces of a file; the last piece is shorter than `size` (possibly empty)."""
    with open(path, "rb") as fh:
        while True:
            data = fh.read(size)
            last = len(data) < size
            yield data, last
            if last:
                return


def owner_only(path: Path) -> None:
    """Checkpoints hold a stage's weights: readable by their owner only."""
    os.chmod(path, 0o600)
