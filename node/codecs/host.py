"""A message's bytes on the host: its payload's one copy out of the device, on a side stream
(copy_to_host), waited for at once or beside the next compute (PendingPayload: train.host_copy
"inline" or "overlap"); the message's wire size, and the checksum over its header and payload."""

from __future__ import annotations

import dataclasses
import functools
import struct
import zlib
from typing import Any

import crc32c
import torch

from ..kernels.wire import CodecError
from ..proto import tahnode_pb2 as pb

__all__ = ["copy_to_host", "PendingPayload", "checksum", "payload_field_bytes", "CRC_FIELD_BYTES"]


def _bytes_of(payload: torch.Tensor) -> torch.Tensor:
    """A payload as flat uint8, on the GPU where it is on one, else on the host (uncopied there)."""
    flat = payload.detach().contiguous().reshape(-1).view(torch.uint8)
    return flat if flat.device.type in ("cuda", "cpu") else flat.cpu()


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream a device's payloads are copied to the host on, beside the compute stream."""
    return torch.cuda.Stream(device)


def copy_to_host(payload: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A payload's bytes (uint8) on their way to the host: (a CPU payload itself, None), or (pinned
    memory, the CUDA event that marks the copy done) for a CUDA payload, copied on the device's
    side stream once the compute stream's work so far (the encode) is done."""
    flat = _bytes_of(payload)
    if flat.device.type != "cuda":
        return flat, None
    side = _side_stream(flat.device)
    side.wait_stream(torch.cuda.current_stream(flat.device))
    host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
    with torch.cuda.stream(side):
        host.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    flat.record_stream(side)  # its memory is not reused before the copy has read it
    return host, done


CRC_FIELD_BYTES = 5  # EncodedTensor.crc32 serialized (fixed32: key, 4 bytes), which PendingPayload.finish() adds
PAYLOAD_KEY_BYTES = 1  # EncodedTensor.payload's field key (number and wire type) in one varint byte


def _varint_bytes(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def payload_field_bytes(n: int) -> int:
    """What an `n`-byte payload adds to its EncodedTensor's serialized size (key, length, bytes;
    nothing for an empty one, which protobuf leaves out)."""
    return 0 if n == 0 else PAYLOAD_KEY_BYTES + _varint_bytes(n) + n


@dataclasses.dataclass
class PendingPayload:
    """A message (`msg`, every field but its payload and checksum) and its payload on its way to
    the host (copy_to_host): finish() waits for the copy, writes the checksum into `msg` and returns
    the payload's bytes, at once (train.host_copy "inline") or on the link's thread
    (tahnode.net.body's PendingBody, "overlap"). `wire_bytes`: the whole message's serialized size."""

    msg: pb.EncodedTensor
    host: torch.Tensor
    done: Any = None  # torch.cuda.Event, or None when `host` holds the bytes already

    @property
    def nbytes(self) -> int:
        return self.host.numel()

    @property
    def wire_bytes(self) -> int:
        return self.msg.ByteSize() + CRC_FIELD_BYTES * (not self.msg.crc32) + payload_field_bytes(self.nbytes)

    def finish(self) -> memoryview:
        if self.done is not None:
            self.done.synchronize()
        data = memoryview(self.host.numpy())
        self.msg.crc32 = checksum(self.msg, data)
        return data


def checksum(msg: pb.EncodedTensor, payload=None) -> int:
    """The checksum `msg.checksum` names (CRC-32C, or zlib's CRC-32 of older senders) of the
    canonical header followed by the payload (docs/wire-format.md): codec name, 0, version u32,
    dtype u32, ndim u32, dims u64, then each param sorted by key as key, 0, value f64; all
    little-endian. `payload`: the payload where it is kept apart. Raises CodecError for a checksum
    this build does not know."""
    head = bytearray(msg.codec.encode() + b"\0")
    head += struct.pack("<III", msg.version, msg.dtype, len(msg.shape))
    head += struct.pack(f"<{len(msg.shape)}Q", *msg.shape)
    for key in sorted(msg.params):
        head += key.encode() + b"\0" + struct.pack("<d", msg.params[key])
    data = msg.payload if payload is None else payload
    if msg.checksum == pb.CRC32C:
        return crc32c.crc32c(data, crc32c.crc32c(bytes(head)))
    if msg.checksum == pb.CRC32:
        return zlib.crc32(data, zlib.crc32(bytes(head)))
    raise CodecError(f"{msg.codec}: unknown checksum {msg.checksum} (this build checks CRC-32 and CRC-32C)")
